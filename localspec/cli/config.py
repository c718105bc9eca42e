"""`localspec config`: the effective settings, and setting or unsetting them in the config file."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from localspec.printable import printable

from localspec import settings as config
from localspec.cli.options import ModelOpt, flags
from localspec.errors import UsageError

config_app = typer.Typer(help="Show the effective settings, or set and unset them in the config file.")


@config_app.callback(invoke_without_command=True)
def config_cmd(
    ctx: typer.Context,
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
):
    """Show the effective settings and where each came from.

    Precedence, highest first: flag > LOCALSPEC_* environment > config file > stored tune result > pair default >
    built-in default."""
    if ctx.invoked_subcommand is not None:
        return
    from localspec.session import resolve_settings, tuned_results

    eff = resolve_settings(flags(model=model), strict=False)
    tuned = tuned_results()
    if as_json:
        typer.echo(json.dumps({"config_file": str(config.config_file()),
                               "settings": {k: {"value": v.value, "source": v.source} for k, v in eff.items()},
                               "tuned": tuned}))
        return
    from localspec.cli.table import print_table

    print_table(["setting", "value", "from"], [[k, "" if v.value is None else str(v.value), v.source] for k, v in eff.items()],
                title=f"config file: {config.config_file()}")
    for name, vals in tuned.items():
        typer.echo(printable(f"tuned for {name}: " + ", ".join(f"{a}={b}" for a, b in vals.items())))


def _setting_key(key: str) -> str:
    k = key.replace("-", "_")
    if k not in config.SETTINGS:
        import difflib

        close = difflib.get_close_matches(k, list(config.SETTINGS), n=1)
        raise UsageError(f"unknown setting {key!r}" + (f"; did you mean {close[0]}?" if close else "; see `localspec config`"))
    return k


# a negative number is a value, not an option: `config set gpu_layers -1`
@config_app.command("set", context_settings={"ignore_unknown_options": True})
def config_set(key: Annotated[str, typer.Argument(help="Setting name, as `localspec config` lists them.")],
               value: Annotated[str, typer.Argument(help="The value.")]):
    """Store a setting in the config file (checked first; the file's other keys are kept)."""
    from localspec.session import resolve_settings, validate

    k = _setting_key(key)
    v = config.coerce(k, value, "config set")
    validate({kk: s.value for kk, s in resolve_settings({k: v}, strict=False).items()} | {k: v})
    config.update_file(config.config_file(), lambda d: d.__setitem__(k, v))
    sys.stderr.write(f"{k} = {v!r} in {config.config_file()}\n")


@config_app.command("unset")
def config_unset(key: Annotated[str, typer.Argument(help="Setting name.")]):
    """Remove a setting from the config file (the next source in the precedence applies again)."""
    k = _setting_key(key)
    found = []

    def drop(d):
        for name in (k, k.replace("_", "-")):
            if name in d:
                found.append(d.pop(name))

    config.update_file(config.config_file(), drop)
    sys.stderr.write(f"{k} removed from {config.config_file()}\n" if found else f"{k} was not set in {config.config_file()}\n")



@config_app.command("path")
def config_path():
    """Print the config file's path (without reading it: this works when the file is broken)."""
    typer.echo(str(config.config_file()))
