"""The `localspec` command line. Answer text goes to stdout; everything else to stderr.
Domain errors become one `error:` line and an exit code here, and only here. Every command is registered on the
app in this one place (the command modules import nothing from here)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer

from localspec import __version__
from localspec.cli import bench as bench_cmds
from localspec.cli import cache as cache_cmds
from localspec.cli import chat as chat_cmd
from localspec.cli import config as config_cmds
from localspec.cli import doctor as doctor_cmd
from localspec.cli import history as history_cmds
from localspec.cli import models as models_cmds
from localspec.cli import replay as replay_cmd
from localspec.cli import run as run_cmd
from localspec.cli import serve as serve_cmd
from localspec.cli import stop_during_start_up
from localspec.cli import worker as worker_cmd
from localspec.cli.options import err, quiet_pipe, setting_words, state
from localspec.errors import LocalspecError

app = typer.Typer(
    name="localspec",
    help="Speculative decoding for local GGUF models: the same answer as plain decoding, sooner.",
    rich_markup_mode="rich",
    no_args_is_help=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog=(
        "Examples:\n\n"
        "  localspec run \"Write a Python function that reverses a string\"\n\n"
        "  cat main.py | localspec run \"Add type hints to this code\" --json\n\n"
        "  localspec chat -m qwen2.5-coder-1.5b\n\n"
        "  localspec bench --methods none,draft,lookup --k 2,4,8"
    ),
)


def _version_cb(value: bool):
    if value:
        try:
            from localspec.llama.sysinfo import llama_cpp_version
            ll = llama_cpp_version()
        except Exception:
            ll = "not importable"
        typer.echo(f"localspec {__version__} (llama-cpp-python {ll})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version_cb, is_eager=True, help="Show versions and exit.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks (or set LOCALSPEC_DEBUG=1).")] = False,
):
    state.debug = debug or os.environ.get("LOCALSPEC_DEBUG", "") not in ("", "0")


# the commands, in the order help lists them
app.add_typer(models_cmds.models_app, name="models")
app.command(epilog=run_cmd.EPILOG)(run_cmd.run)
app.add_typer(config_cmds.config_app, name="config")
app.command()(doctor_cmd.doctor)
app.command()(chat_cmd.chat)
app.command()(bench_cmds.bench)
app.command()(bench_cmds.tune)
app.command(epilog=replay_cmd.EPILOG)(replay_cmd.replay)
app.command(epilog=worker_cmd.EPILOG)(worker_cmd.worker)
app.add_typer(history_cmds.history_app, name="history")
app.command(epilog=serve_cmd.EPILOG)(serve_cmd.serve)
app.add_typer(cache_cmds.cache_app, name="cache")

COMMANDS = {"run", "chat", "models", "doctor", "config", "bench", "tune", "replay", "worker", "history", "serve", "cache"}


def _on_signal(signum, frame) -> None:
    """SIGINT, SIGTERM and SIGHUP stop a generation: the first one raises KeyboardInterrupt (the partial answer and
    the summary are then kept); more of them while that stop is under way are ignored (a second KeyboardInterrupt
    raised inside the clean-up lost the answer, or freed a model halfway: SIGSEGV), but a third forces the exit."""
    state.signals += 1
    if state.signals == 1:
        state.interrupt_exit = 128 + signum
        raise KeyboardInterrupt
    if state.signals >= 3:
        os.write(2, b"\ninterrupted\n")
        os._exit(state.interrupt_exit)


_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


def _install_signals():
    """Our handlers; returns SIGINT's previous one (main() puts it back for embedders)."""
    try:
        previous = signal.signal(signal.SIGINT, _on_signal)
    except (ValueError, OSError):  # not the main thread (embedded use)
        return None
    if previous is stop_during_start_up:
        previous = signal.default_int_handler
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            try:
                signal.signal(sig, _on_signal)
            except (ValueError, OSError):  # not the main thread (embedded use)
                pass
    return previous


def _interrupted() -> None:
    from localspec.models import download

    if not state.interrupt_reported:
        note = " (the partial download is kept and resumes next time)" if download.STARTED_DOWNLOAD else ""
        sys.stderr.write(f"\ninterrupted{note}\n")
    sys.exit(state.interrupt_exit)


def _bytes_text(arg: str) -> str:
    """An undecodable argument as the bytes it was (b'caf\\xe9'), for the error line."""
    try:
        return repr(arg.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:
        return ascii(arg)


def main(argv: list[str] | None = None) -> None:
    # a closed stdout/stderr (`localspec run ... >&-`) is a place where output goes nowhere, not a crash
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")
    state.reset()
    previous = None
    try:
        previous = _install_signals()
        _main(argv)
    except KeyboardInterrupt:  # a stop before _main's own handler is in place (while it imports its parts)
        _interrupted()
    finally:
        try:
            if state.signals and argv is None:  # the process stops: the interpreter's teardown (freeing the
                # models) resets Python handlers to the default, which a second Ctrl-C then dies of; ignoring
                # survives. Called in-process (an embedder, tests), Ctrl-C is given back below instead.
                for sig in _STOP_SIGNALS:
                    signal.signal(sig, signal.SIG_IGN)
            elif previous is not None:
                signal.signal(signal.SIGINT, previous)
        except (ValueError, OSError):
            pass


def _main(argv: list[str] | None) -> None:
    from localspec.cli import progress

    progress.install()  # download progress bars on stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(argv, 1):  # undecodable bytes arrive as lone surrogates (PEP 383)
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            err(f"argument {i} ({_bytes_text(a)}) is not valid UTF-8 text")
            sys.exit(2)
    first = next((a for a in argv if a not in ("--debug",)), None)
    if first is None:
        if not sys.stdin.isatty():
            argv.append("run")
    elif first not in COMMANDS and first not in ("-h", "--help", "--version"):
        argv.insert(argv.index(first), "run")  # `localspec "prompt"` behaves as `localspec run "prompt"`
    try:
        rc = app(args=argv, prog_name="localspec", standalone_mode=False)
        sys.stdout.flush()
    except LocalspecError as exc:
        if state.debug:
            raise
        err(exc.worded(setting_words))
        sys.exit(exc.exit_code)
    except BrokenPipeError:
        quiet_pipe()
        sys.exit(0)
    except SystemExit as exc:  # click ends with exit 1 on a broken pipe: the reader's choice is not an error
        if isinstance(exc.__context__, OSError) and exc.__context__.errno == 32:
            quiet_pipe()
            sys.exit(0)
        raise
    except KeyboardInterrupt:
        _interrupted()
    except Exception as exc:  # click's (typer may vendor it) exit, abort and usage errors; anything unexpected
        kind = type(exc).__name__
        if kind == "Exit":
            sys.exit(getattr(exc, "exit_code", 0))
        if kind == "Abort":
            if isinstance(exc.__context__, KeyboardInterrupt):
                _interrupted()
            sys.stderr.write("aborted\n")
            sys.exit(1)
        if kind == "NoArgsIsHelpError":  # a command group without its subcommand: its help is the answer
            help_text = exc.format_message()  # empty where typer has printed its rich help already
            if help_text.strip():
                print(help_text)
            sys.exit(2)
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):  # bad flags, missing values
            err((exc.format_message().splitlines() or [kind])[0] + " (see --help)")
            sys.exit(2)
        if isinstance(exc.__context__, BrokenPipeError) or isinstance(exc, OSError) and exc.errno == 32:
            quiet_pipe()
            sys.exit(0)
        if state.debug:
            raise
        err(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)")
        sys.exit(1)
    if rc == 130:  # typer turns Ctrl-C into exit code 130
        _interrupted()
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
