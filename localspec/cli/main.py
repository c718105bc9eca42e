"""The `localspec` command line. Answer text goes to stdout; everything else to stderr.
Domain errors become one `error:` line and an exit code here, and only here."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from localspec import __version__
from localspec import settings as config
from localspec.errors import LocalspecError, UsageError

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
def _plain_type_names() -> None:
    """Help shows TEXT / N / X / PATH, not typer's internal type names (`<bool>`, `<str>`, `<list[str]>`)."""
    try:
        from typer.core import _TyperParameter
    except ImportError:  # pragma: no cover - other typer versions print click's own metavars
        return
    orig = getattr(_TyperParameter, "display_type", None)
    if orig is None or getattr(orig, "_localspec", False):
        return
    names = {"<bool>": None, "<str>": "TEXT", "<int>": "N", "<float>": "X", "<list[str]>": "TEXT", "<path>": "PATH",
             "<Path>": "PATH"}

    def display_type(self, ctx):
        label = orig(self, ctx)
        if getattr(self, "is_flag", False):
            return None
        return names.get(label, label.strip("<>").upper() if isinstance(label, str) else label)

    display_type._localspec = True
    _TyperParameter.display_type = display_type


_plain_type_names()


def _rich_pipe_is_quiet() -> None:
    """rich ends the process with exit 1 when stdout's reader goes away (`localspec --help | head -1`); a closed
    pipe is the reader's choice, not an error: raise BrokenPipeError so main() ends quietly like for the answer."""
    from rich.console import Console

    def on_broken_pipe(self) -> None:
        _quiet_pipe()
        raise BrokenPipeError

    Console.on_broken_pipe = on_broken_pipe


_rich_pipe_is_quiet()

models_app = typer.Typer(help="List, download, inspect and add model pairs.", no_args_is_help=True)
app.add_typer(models_app, name="models")

DEBUG = False
INTERRUPT_REPORTED = False  # `run` prints its own summary when interrupted


def _err(msg: str) -> None:
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()


# how the CLI names a setting in an error message (the library names the setting itself)
SETTING_WORDS = {"draft_tokens": "-k", "max_tokens": "-n", "ctx_size": "-c", "draft": "-d PATH or a pair with a draft"}


def setting_words(key: str) -> str:
    return SETTING_WORDS.get(key) or "--" + key.replace("_", "-")


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
    global DEBUG
    DEBUG = debug or os.environ.get("LOCALSPEC_DEBUG", "") not in ("", "0")


# ----------------------------------------------------------------- shared options
def _setting_help(key: str, text: str | None = None) -> str:
    typ, default, desc = config.SETTINGS[key]
    shown = {None: None}.get(default, default)
    d = f" (default: {shown})" if shown not in (None, "") else ""
    return (text or desc[0].upper() + desc[1:] + ".") + d


def _opt(key: str, *names: str, help: str | None = None, typ=None):
    """An option for a setting: None when not given (so env, config file, tune results and pair defaults apply);
    the help shows the built-in default."""
    t = typ or config.SETTINGS[key][0]
    return Annotated[Optional[t], typer.Option(*names, help=_setting_help(key, help), show_default=False, metavar=_META[t])]


_META = {str: "TEXT", int: "N", float: "X"}

ModelOpt = _opt("model", "-m", "--model", help="Pair name, GGUF path, hf://OWNER/REPO/FILE.gguf or OWNER/REPO[:QUANT].")
DraftOpt = _opt("draft", "-d", "--draft", help="Draft GGUF path, hub name, or a pair name (its draft).")
MethodOpt = _opt("method", "--method", help="How to speculate: auto | draft | lookup | none.")
KOpt = _opt("draft_tokens", "-k", "--draft-tokens", help="Draft tokens per step (auto: the most it may use); default: the pair's k, else 4.")
TempOpt = _opt("temperature", "-t", "--temperature", "--temp", help="Sampling temperature; 0 = greedy.")
SystemOpt = _opt("system", "-s", "--system", help="System prompt.")
MaxTokOpt = _opt("max_tokens", "-n", "--max-tokens", help="Most tokens to generate.")
CtxOpt = _opt("ctx_size", "-c", "--ctx-size", help="Context size in tokens; default: the pair's, else 4096.")
GpuOpt = _opt("gpu_layers", "-ngl", "--gpu-layers", "--n-gpu-layers", help="Target layers offloaded to the GPU (-1 = all).")
DraftGpuOpt = _opt("draft_gpu_layers", "--draft-gpu-layers", "-ngld", help="Draft layers offloaded to the GPU (-1 = all).")
ThreadsOpt = _opt("threads", "--threads", help="CPU threads; default: all cores.")
ExactnessOpt = _opt("exactness", "--exactness", help="Exactness level: auto | bit | lossless (see README, Exactness).")
RpcOpt = _opt("rpc", "--rpc", help="llama.cpp RPC workers HOST:PORT[,...] for the target's layers (`localspec worker`); the draft stays local.")
SplitOpt = _opt("tensor_split", "--tensor-split", help="With --rpc: share of the target's layers per worker, e.g. 3,1.")
TemplateOpt = Annotated[Optional[Path], typer.Option("--chat-template", help="Jinja chat template file to use instead of the model's.", show_default=False, metavar="FILE")]


def use_template(sess, path: Optional[Path]) -> None:
    """--chat-template: read (and check) the file before any model loads."""
    if path is not None:
        from localspec.core.chat_template import read_template_file

        sess.chat_template = read_template_file(path)


def flags(**kw) -> dict:
    """The options the user actually gave (None = not given)."""
    return {k: v for k, v in kw.items() if v is not None}


# ----------------------------------------------------------------- status output
class Status:
    """Live status on a terminal's stderr, plus the final summary. When the answer streams to the same terminal,
    a status line would overwrite it: the figures then go to the terminal's title instead. A ticker refreshes the
    figures twice a second even while no token arrives."""

    INTERVAL = 0.5

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.live = not quiet and sys.stderr.isatty()
        self.in_title = self.live and sys.stdout.isatty()
        self._last = 0.0
        self._shown = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.clear()
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()

    def start(self, get_stats) -> None:
        if not self.live or self._ticker is not None:
            return
        self._stop.clear()

        def tick() -> None:
            while not self._stop.wait(self.INTERVAL):
                st = get_stats()
                if st is not None:
                    self.update(st, force=True)

        self._ticker = threading.Thread(target=tick, name="localspec-status", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=1.0)
            self._ticker = None
        self.clear()

    def update(self, stats, force: bool = False) -> None:
        if not self.live or stats is None:
            return
        with self._lock:
            now = time.perf_counter()
            if not force and now - self._last < 0.2:
                return
            self._last = now
            line = live_line(stats)
            if self.in_title:
                sys.stderr.write(f"\x1b]0;localspec {line}\x07")
            else:
                sys.stderr.write("\r\x1b[2K\x1b[2m" + line + "\x1b[0m")
            sys.stderr.flush()
            self._shown = True

    def clear(self) -> None:
        with self._lock:
            if self._shown:
                sys.stderr.write("\x1b]0;localspec\x07" if self.in_title else "\r\x1b[2K")
                sys.stderr.flush()
                self._shown = False


def rate_text(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.1f}"


def live_line(stats) -> str:
    """The figures shown while an answer streams: live tokens/s over the answer so far."""
    return (f"{rate_text(stats.rate()):>6} tok/s  accept {stats.acceptance_rate:4.0%}  "
            f"{stats.tokens_per_pass:4.2f} tok/pass  {stats.completion_tokens} tok")


def short_summary(stats, finish: str) -> str:
    """The default end-of-run line, e.g. `128 tokens · 27.9 tok/s · 1.3x vs plain est. · 64% accepted`."""
    parts = [f"{stats.completion_tokens} tokens", f"{rate_text(stats.rate())} tok/s"]
    est = stats.speedup_estimate()
    if est is not None:
        parts.append(f"{est:.1f}x vs plain est.")
    if stats.drafted:
        parts.append(f"{stats.acceptance_rate:.0%} accepted")
    else:
        parts.append("no drafts")
    if finish not in ("stop", "length"):
        parts.append(finish)
    if stats.rpc_workers:
        parts.append(f"rpc workers: {', '.join(stats.rpc_workers)}")
    if stats.drafted and stats.exactness:
        parts.append({"bit": "bit-exact", "lossless": "lossless"}.get(stats.exactness, stats.exactness))
    return " · ".join(parts)


def summary_line(stats, finish: str) -> str:
    used = ", ".join(f"{m} {n}" for m, n in stats.method_used.most_common()) or "-"
    mal = f"{stats.mean_accepted_length:.2f}" if stats.drafting_steps else "—"
    return (
        f"{stats.completion_tokens} tokens in {stats.elapsed_s:.2f}s | {rate_text(stats.rate())} tok/s | "
        f"ttft {stats.ttft_s:.2f}s | accepted {stats.accepted}/{stats.drafted} ({stats.acceptance_rate:.0%}) | "
        f"{stats.tokens_per_pass:.2f} tokens per target pass | mean accepted length {mal} | steps: {used} | {finish}"
        + (f" | {stats.reason}" if stats.reason else "")
        + (f" | rpc workers: {', '.join(stats.rpc_workers)}" if stats.rpc_workers else "")
        + f" | {stats.exactness_reason or stats.exactness}"
    )


def result_json(fin, stats, engine, gen_cfg, interrupted=False, text: str = "") -> dict:
    if stats is None:  # interrupted before the first step
        from localspec.core.stats import Stats

        stats = Stats()
    return {
        "text": fin.text if fin else text,
        "finish_reason": "interrupted" if interrupted else fin.finish_reason,
        "method": stats.main_method,
        "requested_method": gen_cfg.method,
        "draft_tokens": gen_cfg.k,
        "k_requested": gen_cfg.k,
        "k_in_use": stats.k_cap if stats is not None else None,
        "target": engine.target.name,
        "draft": engine.draft.name if engine.draft is not None else None,
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_pass": stats.tokens_per_pass,
        "drafting_steps": stats.drafting_steps,
        "mean_accepted_length": stats.mean_accepted_length,
        "acceptance_by_position": stats.acceptance_by_position,
        "ttft_s": stats.ttft_s,
        "tokens_per_second": stats.measured_rate(),  # the display also hides samples under 50 ms
        "elapsed_s": stats.elapsed_s,
        "draft_s": stats.draft_s,
        "verify_s": stats.verify_s,
        "steps_by_method": dict(stats.method_used),
        "steps_by_k": {str(k): v for k, v in sorted(stats.k_used.items())},
        "controller": stats.reason or None,
        "exactness": stats.exactness,
        "exactness_reason": stats.exactness_reason,
        "draft_dropped": engine.dropped_draft,
        "rpc_workers": list(stats.rpc_workers) if stats is not None else [],
    }


def read_stdin() -> str | None:
    if sys.stdin is None or sys.stdin.isatty():
        return None
    try:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read standard input: {exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError("standard input is not UTF-8 text") from None


# ----------------------------------------------------------------- run
@app.command(
    epilog=(
        "Examples:\n\n"
        "  localspec run \"Explain Python decorators\"\n\n"
        "  git diff | localspec run \"Write a commit message for this diff\"\n\n"
        "  localspec run -m ./model.gguf -d ./draft.gguf --method draft -k 4 \"hello\"\n\n"
        "  localspec run --json -n 64 \"List three primes\" | jq .tokens_per_second"
    )
)
def run(
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt. Piped stdin comes first, then a blank line, then PROMPT.", show_default=False)] = None,
    model: ModelOpt = None,
    draft: DraftOpt = None,
    method: MethodOpt = None,
    draft_tokens: KOpt = None,
    exactness: ExactnessOpt = None,
    p_min: _opt("p_min", "--p-min", help="The draft model stops drafting when its top probability falls below this.") = None,
    lookup_min: _opt("lookup_min", "--lookup-min", help="Shortest n-gram for prompt lookup.") = None,
    lookup_max: _opt("lookup_max", "--lookup-max", help="Longest n-gram for prompt lookup.") = None,
    max_tokens: MaxTokOpt = None,
    temperature: TempOpt = None,
    top_k: _opt("top_k", "--top-k", help="Sample from the k most likely tokens only; 0 = off.") = None,
    top_p: _opt("top_p", "--top-p", help="Nucleus sampling; 1 = off.") = None,
    min_p: _opt("min_p", "--min-p", help="Drop tokens below this fraction of the top probability; 0 = off.") = None,
    seed: _opt("seed", "--seed", help="Sampling seed (0 to 2^63-1); default: random.") = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop at this text (repeatable).", show_default=False)] = None,
    system: SystemOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template: the prompt goes in as-is.")] = False,
    chat_template: TemplateOpt = None,
    ctx_size: CtxOpt = None,
    gpu_layers: GpuOpt = None,
    draft_gpu_layers: DraftGpuOpt = None,
    threads: ThreadsOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Nothing on stderr but errors.")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="The full breakdown at the end (timings, steps, k, controller).")] = False,
    no_stream: Annotated[bool, typer.Option("--no-stream", help="Print the answer at the end.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout at the end.")] = False,
):
    """Answer one prompt (stdin is joined to it), streaming to stdout."""
    from localspec.session import Session, generation_slot

    sess = Session(flags(
        model=model, draft=draft, method=method, draft_tokens=draft_tokens, exactness=exactness, p_min=p_min, lookup_min=lookup_min,
        lookup_max=lookup_max, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        seed=seed, system=system, ctx_size=ctx_size, gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers, threads=threads,
        rpc=rpc, tensor_split=tensor_split,
    ), quiet=quiet)
    piped = read_stdin()
    parts = [p for p in (piped, prompt) if p is not None and p.strip() != ""]
    if not parts:
        raise UsageError("no prompt: pass PROMPT or pipe text on stdin (see localspec run --help)")
    text = "\n\n".join(parts)
    status = Status(quiet)
    from localspec.core.engine import Finished

    sess.check()  # bad sampling/k/thread values fail before loading gigabytes
    use_template(sess, chat_template)
    if sys.stderr.isatty():
        sess.announce = status.info
    engine = sess.load()
    try:
        s = sess.values()
        gen_cfg = sess.gen_config(stop)
        if engine.dropped_draft:
            status.info(f"warning: {engine.dropped_draft}; using prompt lookup")
        if engine.template_warning and not raw:
            status.info(f"warning: {engine.template_warning}")
        if raw:
            tokens = engine.raw_prompt(text)
        else:
            msgs = ([{"role": "system", "content": s["system"]}] if s["system"] else []) + [{"role": "user", "content": text}]
            tokens = engine.chat_prompt(msgs)
        stream = not (no_stream or as_json)
        fin = None
        out = sys.stdout
        got: list[str] = []  # the answer so far: kept when interrupted
        with generation_slot(waiting=None if quiet else status.info):
            status.start(lambda: engine.last_stats)
            try:
                for ev in engine.generate(tokens, gen_cfg):
                    if isinstance(ev, Finished):
                        fin = ev
                        break
                    got.append(ev.text)
                    if stream and ev.text:
                        out.write(ev.text)
                        out.flush()
                    status.update(engine.last_stats)
            except KeyboardInterrupt:
                global INTERRUPT_REPORTED
                INTERRUPT_REPORTED = True
                status.stop()
                stats = engine.last_stats
                partial = "".join(got)
                if stream:
                    out.write("\n")
                elif as_json:
                    out.write(json.dumps(result_json(None, stats, engine, gen_cfg, interrupted=True, text=partial)) + "\n")
                else:
                    out.write(partial + ("" if partial.endswith("\n") else "\n"))
                out.flush()
                if not quiet and stats is not None:
                    sys.stderr.write((summary_line if verbose else short_summary)(stats, "interrupted") + "\n")
                raise typer.Exit(INTERRUPT_EXIT)
            finally:
                status.stop()
        stats = fin.stats
        if as_json:
            out.write(json.dumps(result_json(fin, stats, engine, gen_cfg)) + "\n")
        elif stream:
            if not fin.text.endswith("\n"):
                out.write("\n")
        else:
            out.write(fin.text + ("" if fin.text.endswith("\n") else "\n"))
        out.flush()
        if not quiet:
            sys.stderr.write((summary_line if verbose else short_summary)(stats, fin.finish_reason) + "\n")
    finally:
        sess.close()


# ----------------------------------------------------------------- config
config_app = typer.Typer(help="Show the effective settings, or set and unset them in the config file.")
app.add_typer(config_app, name="config")


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
        typer.echo(f"tuned for {name}: " + ", ".join(f"{a}={b}" for a, b in vals.items()))


def _setting_key(key: str) -> str:
    k = key.replace("-", "_")
    if k not in config.SETTINGS:
        import difflib

        close = difflib.get_close_matches(k, list(config.SETTINGS), n=1)
        raise UsageError(f"unknown setting {key!r}" + (f"; did you mean {close[0]}?" if close else "; see `localspec config`"))
    return k


@config_app.command("set")
def config_set(key: Annotated[str, typer.Argument(help="Setting name, as `localspec config` lists them.")],
               value: Annotated[str, typer.Argument(help="The value.")]):
    """Store a setting in the config file (validated first; the file's other keys and comments-free layout kept)."""
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


# ----------------------------------------------------------------- models
@models_app.command("list")
def models_list(as_json: Annotated[bool, typer.Option("--json")] = False,
                local: Annotated[bool, typer.Option("--local", help="Only what is downloaded (any of its files).")] = False):
    """Pairs, and hub models fetched by name, whether downloaded, sizes and local paths."""
    from localspec.models import download
    from localspec.models import hubname as hfname
    from localspec.models import registry

    pairs, default = registry.load()

    def facts(spec):
        lp = download.local_path(spec)
        return {"file": spec.label, "size": spec.size or (lp.stat().st_size if lp else None),
                "downloaded": lp is not None, "path": str(lp) if lp else None}

    rows = []
    for name, p in pairs.items():
        entry = {"name": name, "default": name == default, "description": p.description, "k": p.k, "source": p.source}
        for role, spec in (("target", p.target), ("draft", p.draft)):
            entry[role] = None if spec is None else facts(spec)
        rows.append(entry)
    in_pairs = {r[role]["path"] for r in rows for role in ("target", "draft") if r[role] and r[role]["path"]}
    for name, spec in hfname.cached_models():  # fetched with -m OWNER/REPO:QUANT and not part of a pair
        f = facts(spec)
        if f["path"] not in in_pairs:
            rows.append({"name": name, "default": False, "description": "hub model", "k": None, "source": "hub cache",
                         "target": f, "draft": None})
    if local:
        rows = [r for r in rows if any(r[role] and r[role]["downloaded"] for role in ("target", "draft"))]
    if as_json:
        typer.echo(json.dumps(rows, indent=1))
        return
    from localspec.cli.table import print_table

    def fmt(f):
        if f is None:
            return "[dim]- (lookup)[/dim]"
        size = f"{f['size'] / 1e9:.2f} GB" if f["size"] else "?"
        mark = "[green]✓[/green]" if f["downloaded"] else "[dim]·[/dim]"
        return f"{mark} {Path(f['file']).name} [dim]{size}[/dim]"

    table = []
    for r in rows:
        paths = "\n".join(x["path"] for x in (r["target"], r["draft"]) if x and x["path"]) or "-"
        table.append([r["name"] + (" [bold](default)[/bold]" if r["default"] else ""), fmt(r["target"]), fmt(r["draft"]),
                      "-" if r["k"] is None else str(r["k"]), paths])
    print_table(["pair", "target", "draft", "k", "local"], table, right=["k"])


@models_app.command("pull")
def models_pull(name: Annotated[str, typer.Argument(help="Pair name, or a hub model (OWNER/REPO:QUANT, hf://…).")],
                check: Annotated[bool, typer.Option("--check/--no-check", help="Check pair compatibility from the remote headers first.")] = True):
    """Download both files of a pair, or one hub model (progress, resume, sha256 check)."""
    from localspec.models import download
    from localspec.models import hubname as hfname
    from localspec.models import registry

    kind, obj = registry.resolve_name(name)
    if kind == "hub":
        sys.stderr.write(f"model: {download.ensure(hfname.resolve(obj))}\n")
        return
    if kind == "path":
        raise UsageError(f"{name} is a local file: nothing to pull")
    pair = obj
    if check and pair.draft is not None and not download.offline():
        _remote_compat(pair)
    for role, spec in (("target", pair.target), ("draft", pair.draft)):
        if spec is None:
            continue
        path = download.ensure(spec)
        sys.stderr.write(f"{role}: {path}\n")


def _remote_compat(pair) -> None:
    """Pair check on the GGUF headers, read remotely (HTTP range requests) before fetching gigabytes."""
    from localspec.models import download

    why = download.remote_incompatibility(pair.target, pair.draft)
    if why:
        raise UsageError(f"pair {pair.name} cannot speculate: {why} (nothing was downloaded)")


@models_app.command("rm")
def models_rm(name: Annotated[str, typer.Argument(help="Pair name, or a downloaded hub model (OWNER/REPO:QUANT, hf://…).")],
              yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
              keep_files: Annotated[bool, typer.Option("--keep-files", help="Remove your pair's entry only.")] = False,
              files_only: Annotated[bool, typer.Option("--files-only", help="Delete the downloaded files only; keep your pair.")] = False):
    """Remove a pair you added: its entry in pairs.toml and its downloaded files (asks first). For a shipped pair or
    a hub model, delete the downloaded files. Your own local files, and files another pair uses, are never deleted."""
    from localspec.models import download
    from localspec.models import hubname as hfname
    from localspec.models import registry

    if keep_files and files_only:
        raise UsageError("--keep-files and --files-only exclude each other")
    pairs, _ = registry.load()
    if name in pairs:
        user = pairs[name].source != "shipped"
        specs = [pairs[name].target, pairs[name].draft]
    else:
        hub = hfname.parse(name)
        if hub is None:
            registry.get(name)  # the unknown-pair error, with suggestions
        user, specs = False, [hfname.cached_spec(hub)]
    if keep_files and not user:
        raise UsageError(f"{name} is not a pair you added: there is no entry to remove, only files")
    drop_entry = user and not files_only
    others = {download.local_path(s) for n, p in pairs.items() if n != name for s in (p.target, p.draft) if s is not None}
    present, shared = [], []
    for s in specs:
        lp = None if keep_files or s is None or s.path else download.local_path(s)
        if lp is not None:
            (shared if lp in others else present).append((s, lp))

    def keeping() -> None:
        for _, lp in shared:
            sys.stderr.write(f"keeping {lp}: another pair uses it\n")

    if not present and not drop_entry:
        keeping()
        sys.stderr.write(f"{name}: nothing {'else ' if shared else ''}downloaded\n")
        return
    what = [f"remove pair {name} from {registry.user_pairs_file()}"] if drop_entry else []
    if present:
        size = sum(lp.stat().st_size for _, lp in present)
        what.append(f"delete {len(present)} downloaded file(s), {size / 1e9:.2f} GB")
    if not yes:
        if not sys.stdin.isatty():
            raise UsageError(f"refusing to {' and '.join(what)} without confirmation; pass --yes")
        if not typer.confirm(" and ".join(what) + "?", err=True):
            raise typer.Exit(1)
    keeping()
    if drop_entry:
        registry.remove(name)
        sys.stderr.write(f"removed pair {name}\n")
    for s, _ in present:
        for p in download.remove(s):
            sys.stderr.write(f"removed {p}\n")


@models_app.command("info")
def models_info(what: Annotated[str, typer.Argument(help="Pair name or GGUF path.")],
                as_json: Annotated[bool, typer.Option("--json")] = False):
    """GGUF facts (architecture, size, quantization, context, vocab) and the pair's compatibility verdict."""
    from localspec.models import download
    from localspec.models import registry
    from localspec.models.pair import first_difference
    from localspec.models.gguf_header import read_file_metadata, summary, vocab_info

    files: dict[str, Path] = {}
    if registry.looks_like_path(what):
        p = Path(what).expanduser()
        if not p.is_file():
            raise UsageError(f"no such file: {what}")
        files["model"] = p
    else:
        pair = registry.get(what)
        for role, spec in (("target", pair.target), ("draft", pair.draft)):
            if spec is not None:
                lp = download.local_path(spec)
                if lp is None:
                    raise UsageError(f"{what}: {role} {spec.label} is not downloaded; run `localspec models pull {what}`")
                files[role] = lp
    out, metas = {}, {}
    for role, p in files.items():
        metas[role] = read_file_metadata(p)
        out[role] = {"path": str(p), "size": p.stat().st_size, **summary(metas[role])}
    if "draft" in metas:
        why = first_difference(vocab_info(metas["target"]), vocab_info(metas["draft"]))
        out["compatible"] = why is None
        out["difference"] = why
    if as_json:
        typer.echo(json.dumps(out, indent=1))
        return
    for role, facts in out.items():
        if isinstance(facts, dict):
            typer.echo(f"{role}:")
            for k, v in facts.items():
                typer.echo(f"  {k}: {v}")
    if "compatible" in out:
        typer.echo("pair: " + ("compatible (can speculate)" if out["compatible"] else f"INCOMPATIBLE: {out['difference']}"))


@models_app.command("add")
def models_add(
    name: Annotated[str, typer.Argument(help="A name for the pair.")],
    target: Annotated[str, typer.Option("--target", help="Local path, hf://OWNER/REPO/FILE.gguf or OWNER/REPO[:QUANT]")],
    draft: Annotated[Optional[str], typer.Option("--draft", help="Local path, hf://OWNER/REPO/FILE.gguf or OWNER/REPO[:QUANT]")] = None,
    k: Annotated[int, typer.Option("-k", help="Default draft tokens.")] = 4,
    ctx: Annotated[int, typer.Option("--ctx", help="Default context size.")] = 4096,
    description: Annotated[str, typer.Option("--description")] = "",
):
    """Add your own pair (stored in your user config, never in the shipped file). Names: letters, digits, . - _"""
    from localspec.models import download
    from localspec.models import hubname as hfname
    from localspec.models import registry

    registry.check_name(name)
    t = hfname.file_spec(target)
    d = hfname.file_spec(draft) if draft else None
    why = download.remote_incompatibility(t, d) if d is not None else None  # local files or remote headers
    if why:
        sys.stderr.write(f"warning: this draft cannot speculate for the target ({why}); `run` will use prompt lookup\n")
    path = registry.add(name, t, d, k=k, ctx=ctx, description=description)
    sys.stderr.write(f"added pair {name} to {path}\n")


# ----------------------------------------------------------------- doctor
@app.command()
def doctor(as_json: Annotated[bool, typer.Option("--json")] = False):
    """Versions, compiled backends and devices, CPU features, threads, cache, models and exactness probes."""
    from localspec.models import download
    from localspec.models import registry
    from localspec.llama.ggml import compiled_backends, devices, rpc_available
    from localspec.llama.sysinfo import default_threads, llama_cpp_version, supports_gpu_offload, system_info
    from localspec.core.exactness import cached_costs, cached_probes

    report: dict = {"localspec": __version__, "python": sys.version.split()[0]}
    backends: list[str] = []
    try:
        report["llama_cpp_python"] = llama_cpp_version()
        report["system_info"] = system_info().strip()
        report["gpu_offload"] = supports_gpu_offload()
        report["rpc"] = rpc_available()  # `localspec worker` and --rpc
        backends = compiled_backends()
        report["devices"] = devices()
    except Exception as exc:
        report["llama_cpp_python"] = f"not working: {exc}"
        report["devices"] = []
    flags = set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    report["cpu_features"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "bmi2")))
    report["backends"] = backends
    report["threads"] = default_threads()
    cd = download.cache_dir()
    report["cache_dir"] = str(cd)
    report["free_disk_gb"] = round(download.free_bytes(cd) / 1e9, 1)
    report["config_file"] = str(config.config_file())
    pairs, default = registry.load()
    report["models"] = {n: all(download.local_path(s) is not None for s in (p.target, p.draft) if s) for n, p in pairs.items()}
    report["exactness_probes"] = [
        {"model": p.get("model"), "llama_cpp": p.get("llama_cpp"), "threads": p.get("threads"), "gpu_layers": p.get("gpu_layers"),
         "kv_type": p.get("kv_type"), "long_prefix": p.get("long_prefix"), "exact_batch": p["batch"],
         "deviation": {str(b): v for b, v in sorted(p["deviation"].items())}}
        for p in cached_probes()
    ]
    report["verify_costs"] = [  # what a verify batch of b rows costs in one-token decodes (the controller's start)
        {"model": c["model"], "threads": c["threads"], "gpu_layers": c["gpu_layers"],
         "ratio": {str(b): round(v, 3) for b, v in sorted(c["ratio"].items())}}
        for c in cached_costs()
    ]
    notes = []
    if any(f.startswith("amx") for f in flags):
        notes.append("CPU has AMX: a default (-march=native) llama-cpp-python build can crash with SIGILL; "
                     "rebuild with the CMAKE_ARGS in the README, or set LOCALSPEC_NO_REPACK=1")
    if not any(d["type"] in ("gpu", "igpu") for d in report["devices"]):
        notes.append("CPU only. For an NVIDIA GPU (nvcc on PATH) or Apple Silicon, `bash .ci/install-llama-cpp` "
                     "builds llama.cpp with CUDA or Metal; layers then go to the GPU by default")
    report["notes"] = notes
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    for k, v in report.items():
        if k in ("system_info", "notes", "models", "devices", "exactness_probes", "verify_costs"):
            continue
        typer.echo(f"{k}: {', '.join(v) if isinstance(v, list) else v}")
    typer.echo(f"system_info: {report.get('system_info', '')}")
    for d in report["devices"]:
        mem = f"{d['memory_free'] / 2**30:.1f} of {d['memory_total'] / 2**30:.1f} GiB free" if d["memory_total"] else "memory n/a"
        typer.echo(f"device: {d['name']} ({d['type']}, {d['backend']}) {d['description']}: {mem}")
    typer.echo("models: " + ", ".join(f"{n} {'✓' if ok else '·'}" for n, ok in report["models"].items()))
    for p in report["exactness_probes"]:
        dev = " ".join(f"{b}:{v:.3g}" for b, v in p["deviation"].items()) or "-"
        typer.echo(f"exactness probe: {Path(p['model'] or '?').name} (threads {p['threads']}, gpu layers {p['gpu_layers']}, "
                   f"kv {p['kv_type']}, llama-cpp-python {p['llama_cpp']}): bit-exact up to {p['exact_batch']} rows; "
                   f"max |Δlogit| per batch size {dev}")
    for c in report["verify_costs"]:
        costs = " ".join(f"{b}:{v:.2f}" for b, v in c["ratio"].items())
        typer.echo(f"verify cost: {Path(c['model'] or '?').name} (threads {c['threads']}, gpu layers {c['gpu_layers']}): "
                   f"one-token decodes per batch size {costs}")
    for n in notes:
        typer.echo(f"note: {n}")


# ----------------------------------------------------------------- chat, bench, tune
@app.command()
def chat(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    method: MethodOpt = None,
    draft_tokens: KOpt = None,
    temperature: TempOpt = None,
    system: SystemOpt = None,
    max_tokens: MaxTokOpt = None,
    exactness: ExactnessOpt = None,
    ctx_size: CtxOpt = None,
    gpu_layers: GpuOpt = None,
    draft_gpu_layers: DraftGpuOpt = None,
    threads: ThreadsOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    cont: Annotated[bool, typer.Option("--continue", help="Reopen the most recent stored chat.")] = False,
    resume: Annotated[Optional[int], typer.Option("--resume", help="Reopen stored chat ID (`localspec history list`).", show_default=False)] = None,
    no_history: Annotated[bool, typer.Option("--no-history", help="Store nothing (or set history = false in the config).")] = False,
    chat_template: TemplateOpt = None,
):
    """Chat in the terminal, with live speculation statistics. Chats are stored as they happen (`localspec history`)."""
    from localspec.store.history import History
    from localspec.session import Session
    from localspec.tui.app import create_app

    sess = Session(flags(model=model, draft=draft, method=method, draft_tokens=draft_tokens, temperature=temperature,
                         system=system, max_tokens=max_tokens, ctx_size=ctx_size, gpu_layers=gpu_layers,
                         draft_gpu_layers=draft_gpu_layers, threads=threads, history=False if no_history else None,
                         exactness=exactness, rpc=rpc, tensor_split=tensor_split),
                   quiet=True)
    sess.check()
    use_template(sess, chat_template)
    if cont and resume is not None:
        raise UsageError("--continue reopens the latest chat and --resume ID a given one: use one of them")
    if (cont or resume is not None) and not sess["history"]:
        raise UsageError("--continue and --resume read the history, which is off (--no-history or history = false)")
    chat_id = None
    if cont or resume is not None:
        store = _history(create=False)
        chat_id = store.latest() if cont else store.get(resume).id
        if chat_id is None:
            raise UsageError("no stored chat to continue yet")
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("chat needs a terminal (stdin and stdout); for pipes and scripts use `localspec run`")
    store = History() if sess["history"] else None
    try:
        create_app(sess, store=store, resume=chat_id).run()
    finally:
        if store is not None:
            store.close()


@app.command()
def bench(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="JSON lines {id, category, prompt}; default: the built-in set.", show_default=False)] = None,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated: none,draft,lookup,auto.")] = "none,draft,lookup,auto",
    ks: Annotated[str, typer.Option("--k", help="Comma-separated k values.")] = "2,4,8",
    max_tokens: Annotated[int, typer.Option("-n", "--max-tokens")] = 128,
    repeat: Annotated[int, typer.Option("--repeat")] = 1,
    temperature: Annotated[float, typer.Option("-t", "--temperature")] = 0.0,
    exactness: ExactnessOpt = None,
    categories: Annotated[Optional[str], typer.Option("--categories", help="Only these categories (comma-separated).", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="At most N prompts per category.", show_default=False)] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the full report as JSON.", show_default=False)] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Write per-run rows as CSV.", show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Speedup chart PNG (needs matplotlib).", show_default=False)] = None,
    ctx_size: CtxOpt = None,
    gpu_layers: GpuOpt = None,
    draft_gpu_layers: DraftGpuOpt = None,
    threads: ThreadsOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    chat_template: TemplateOpt = None,
):
    """A/B benchmark: the same prompts with and without speculation, interleaved."""
    sess = _bench_session(model, draft, ctx_size, threads, gpu_layers, draft_gpu_layers, rpc, tensor_split, exactness)
    use_template(sess, chat_template)
    _bench(sess, prompts=prompts, methods=methods, ks=ks, max_tokens=max_tokens, repeat=repeat,
                temperature=temperature, categories=categories, limit=limit, json_out=json_out, csv_out=csv_out, plot=plot)


@app.command()
def tune(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", show_default=False)] = None,
    ks: Annotated[str, typer.Option("--k", help="k values to sweep.")] = "1,2,3,4,6,8",
    p_mins: Annotated[str, typer.Option("--p-min", help="p_min values to sweep (draft method).")] = "0.5,0.75",
    max_tokens: Annotated[int, typer.Option("-n", "--max-tokens")] = 96,
    limit: Annotated[int, typer.Option("--limit", help="Prompts per category in the sample.")] = 1,
    ctx_size: CtxOpt = None,
    gpu_layers: GpuOpt = None,
    draft_gpu_layers: DraftGpuOpt = None,
    threads: ThreadsOpt = None,
    chat_template: TemplateOpt = None,
):
    """Sweep k (and p_min) on a sample, store the fastest config for this pair in the user config."""
    sess = _bench_session(model, draft, ctx_size, threads, gpu_layers, draft_gpu_layers)
    use_template(sess, chat_template)
    _tune(sess, prompts=prompts, ks=ks, p_mins=p_mins, max_tokens=max_tokens, limit=limit)


def _bench_session(model, draft, ctx_size, threads, gpu_layers, draft_gpu_layers, rpc=None, tensor_split=None,
                   exactness=None):
    from localspec.session import Session

    # bench and tune compare methods themselves: the draft is loaded whatever the configured method is
    sess = Session(flags(model=model, draft=draft, ctx_size=ctx_size, threads=threads, gpu_layers=gpu_layers,
                         draft_gpu_layers=draft_gpu_layers, method="auto", rpc=rpc, tensor_split=tensor_split,
                         exactness=exactness))
    sess.check()
    return sess


def _bench(sess, *, prompts, methods, ks, max_tokens, repeat, temperature, categories, limit, json_out, csv_out, plot):
    from rich.console import Console
    from rich.progress import Progress

    from localspec.bench import runner as B
    from localspec.session import generation_slot

    for p in (json_out, csv_out, plot):
        B.check_out(p)
    if repeat < 1 or max_tokens < 1:
        raise UsageError("--repeat and --max-tokens must be >= 1")
    ps = B.load_prompts(prompts, categories.split(",") if categories else None, limit)
    exactness = sess["exactness"] or "auto"
    console = Console(stderr=True)
    sess.announce = console.print
    engine = sess.load()
    try:
        configs = B.parse_configs(methods, ks, has_draft=engine.draft is not None)
        if not configs:
            raise UsageError("nothing to compare: no method besides none (draft needs a draft model)")
        if getattr(engine.target, "rpc_servers", None):
            console.print(f"target layers on RPC workers: {', '.join(engine.target.rpc_servers)}")
        done: list = []
        calib = None
        total = len(ps) * repeat * len(configs) * 2
        try:
            with generation_slot(waiting=console.print):
                calib = B.calibrate(engine, max(c.k for c in configs) + 1)
                with Progress(console=console, transient=True) as prog:
                    task = prog.add_task("benchmarking", total=total)

                    def on_run(r):
                        done.append(r)
                        prog.advance(task)

                    results = B.run_bench(engine, ps, configs, max_tokens=max_tokens, repeat=repeat,
                                          temperature=temperature, exactness=exactness, on_run=on_run)
        except KeyboardInterrupt:
            global INTERRUPT_REPORTED
            INTERRUPT_REPORTED = True
            if done:
                B.print_report(B.summarize(done, calib), Console())
            console.print(f"interrupted after {len(done)} of {total} runs" + (" (the table above covers those)" if done else ""))
            raise typer.Exit(INTERRUPT_EXIT) from None
        rows = B.summarize(results, calib)
        B.print_report(rows, Console())
        meta = {"target": sess.target_path.name, "draft": sess.draft_path.name if sess.draft_path else None,
                "max_tokens": max_tokens, "repeat": repeat, "temperature": temperature, "threads": engine.target.n_threads,
                "exactness": exactness,
                "configs": [c.label for c in configs], "prompts": len(ps),
                "rpc_workers": list(getattr(engine.target, "rpc_servers", None) or [])}
        if json_out:
            B.write_json(json_out, rows, results, calib, meta)
        if csv_out:
            B.write_csv(csv_out, results)
        if plot:
            B.plot_png(plot, rows)
        bugs = sum(r.mismatch_kind == "bug" for r in results)
        if bugs:
            from localspec.errors import AlgorithmBugError

            raise AlgorithmBugError(f"{bugs} divergence{'s exceed' if bugs != 1 else ' exceeds'} the measured numeric "
                                    "deviation (algorithm bug)")
        return rows
    finally:
        sess.close()


def _tune(sess, *, prompts, ks, p_mins, max_tokens, limit):
    from rich.console import Console
    from rich.progress import Progress

    from localspec.bench import runner as B
    from localspec.session import generation_slot, tuned_key

    ps = B.load_prompts(prompts, None, limit)
    console = Console(stderr=True)
    sess.announce = console.print
    engine = sess.load()
    try:
        methods = "draft,lookup" if engine.draft is not None else "lookup"
        configs = B.parse_configs(methods, ks, p_mins, has_draft=engine.draft is not None)
        with generation_slot(waiting=console.print):
            with Progress(console=console, transient=True) as prog:
                task = prog.add_task("tuning", total=len(ps) * len(configs) * 2)
                results = B.run_bench(engine, ps, configs, max_tokens=max_tokens, on_run=lambda r: prog.advance(task))
        rows = B.summarize(results)
        best = B.choose_best(rows)
        key = tuned_key(sess["model"], sess.pair)
        entry = {"method": best["method"], "k": best["k"], "tokens_per_second": round(best["tps_median"], 2),
                 "speedup": round(best["speedup_median"], 3) if best["speedup_median"] else 1.0,
                 "tuned_at": time.strftime("%Y-%m-%d %H:%M")}
        cfg_label = best["config"]
        if cfg_label.startswith("draft") and " p=" in cfg_label:
            entry["p_min"] = float(cfg_label.split(" p=")[1])
        config.update_file(config.config_file(), lambda d: d.setdefault("tuned", {}).__setitem__(key, entry))
        if best["method"] == "none":
            console.print(f"speculation does not pay on this machine for {key}: plain decoding measured fastest "
                          f"({best['tps_median']:.1f} tok/s); stored method=none")
        else:
            console.print(f"chose {cfg_label} for {key}: {best['tps_median']:.1f} tok/s, "
                          f"{entry['speedup']:.2f}x plain (median of per-prompt ratios); stored in {config.config_file()}")
        return entry
    finally:
        sess.close()


# ----------------------------------------------------------------- worker
@app.command(epilog="Example: on the worker machine `localspec worker --host 0.0.0.0`, then on yours "
                    "`localspec run --rpc WORKER_IP:50052 \"prompt\"`.")
def worker(
    host: Annotated[str, typer.Option("--host", help="IPv4 address to listen on; anything but loopback exposes it to the network.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 50052,
    threads: Annotated[Optional[int], typer.Option("--threads", help="CPU threads (default: all cores).", show_default=False)] = None,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="Keep received tensors here (large ones are then sent once).", show_default=False)] = None,
):
    """Serve this machine's CPU/GPUs to other machines' `--rpc` (llama.cpp's RPC server). Ctrl-C stops it."""
    from localspec.rpc.worker import serve

    global INTERRUPT_REPORTED
    try:
        serve(host, port, threads, cache_dir)
    except KeyboardInterrupt:
        INTERRUPT_REPORTED = True
        sys.stderr.write("\nworker stopped\n")
        sys.stderr.flush()
        os._exit(130)  # llama.cpp's server thread is blocked in accept(): no interpreter teardown under it


# ----------------------------------------------------------------- history
history_app = typer.Typer(help="Stored chats: list, show, export and delete them.", no_args_is_help=True)
app.add_typer(history_app, name="history")

ChatIdArg = Annotated[int, typer.Argument(help="Chat number (`localspec history list`).", show_default=False)]


def _history(create: bool = False):
    """The history database; without `create`, an absent one reads as empty (nothing is written)."""
    from localspec.store.history import History, db_path

    if not create and not db_path().exists():
        return History(":memory:")
    return History()


def _ask(question: str, what: str) -> bool:
    """Yes/no on a terminal, No by default; without a terminal there is nobody to ask: refuse."""
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        raise UsageError(f"{question} (no terminal to ask on: {what})")
    return typer.confirm(question, default=False, err=True)


@history_app.command("list")
def history_list(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    limit: Annotated[Optional[int], typer.Option("-n", "--limit", help="At most N chats (newest first).", show_default=False)] = None,
):
    """Stored chats, newest first."""
    store = _history()
    chats = store.chats(limit=limit)
    if as_json:
        typer.echo(json.dumps([{k: v for k, v in c.to_dict().items() if k != "messages"} | {"messages": c.n_messages}
                               for c in chats], indent=1, ensure_ascii=False))
        return
    if not chats:
        sys.stderr.write("no stored chats yet (`localspec chat` stores them as they happen)\n")
        return
    from rich.markup import escape

    from localspec.cli.table import print_table

    rows = [[str(c.id), time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated)), str(c.n_messages),
             escape(c.title), escape(c.model or "-")] for c in chats]
    print_table(["id", "updated", "messages", "title", "model"], rows, right=["id", "messages"])


@history_app.command("show")
def history_show(chat_id: ChatIdArg):
    """Print a stored chat as Markdown."""
    from localspec.store.exports import to_markdown

    c = _history().get(chat_id)
    typer.echo(to_markdown(c.title, c.messages, c.model), nl=False)


@history_app.command("export")
def history_export(
    chat_id: ChatIdArg,
    fmt: Annotated[str, typer.Option("--format", "-f", help="md or json.")] = "md",
    out: Annotated[Optional[Path], typer.Option("-o", "--output", help="Write to FILE (asks before overwriting); default: stdout.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite FILE without asking.")] = False,
):
    """Export a stored chat as Markdown or JSON."""
    from localspec.store.cachefile import atomic_write
    from localspec.store.exports import to_json, to_markdown

    if fmt not in ("md", "json"):
        raise UsageError(f"--format takes md or json, got {fmt!r}")
    c = _history().get(chat_id)
    text = to_json(c.to_dict()) if fmt == "json" else to_markdown(c.title, c.messages, c.model)
    if out is None:
        typer.echo(text, nl=False)
        return
    if out.is_dir():
        raise UsageError(f"{out} is a directory")
    if out.exists() and not force and not _ask(f"{out} exists. Overwrite it?", "add --force to overwrite"):
        sys.stderr.write(f"{out} not overwritten\n")
        raise typer.Exit(1)
    try:
        atomic_write(out, text)
    except OSError as exc:
        raise UsageError(f"cannot write {out}: {exc.strerror or exc}") from None
    sys.stderr.write(f"wrote {out}\n")


@history_app.command("rm")
def history_rm(
    chat_id: ChatIdArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
):
    """Delete a stored chat (asks first)."""
    store = _history()
    c = store.get(chat_id)
    if not yes and not _ask(f"Delete chat {c.id} “{c.title}” ({c.n_messages} messages)?", "add --yes to delete"):
        sys.stderr.write(f"chat {c.id} kept\n")
        raise typer.Exit(1)
    store.delete(c.id)
    sys.stderr.write(f"deleted chat {c.id}\n")


# ----------------------------------------------------------------- entry point
COMMANDS = {"run", "chat", "models", "doctor", "config", "bench", "tune", "worker", "history", "serve"}


INTERRUPT_EXIT = 130  # 128 + the signal that stopped us (SIGINT 130, SIGHUP 129, SIGTERM 143)


def _on_signal(signum, frame) -> None:
    """SIGTERM and SIGHUP stop a generation the way Ctrl-C does: the partial answer and the summary are kept."""
    global INTERRUPT_EXIT
    INTERRUPT_EXIT = 128 + signum
    raise KeyboardInterrupt


def _install_signals() -> None:
    import signal

    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            try:
                signal.signal(sig, _on_signal)
            except (ValueError, OSError):  # not the main thread (embedded use)
                pass


def _interrupted() -> None:
    from localspec.models import download

    if not INTERRUPT_REPORTED:
        note = " (the partial download is kept and resumes next time)" if download.STARTED_DOWNLOAD else ""
        sys.stderr.write(f"\ninterrupted{note}\n")
    sys.exit(INTERRUPT_EXIT)
# ----------------------------------------------------------------- serve
@app.command(
    epilog=(
        "Examples:\n\n"
        "  localspec serve\n\n"
        "  localspec serve -m ./model.gguf -d ./draft.gguf --port 8000\n\n"
        "  LOCALSPEC_API_KEY=secret localspec serve --host 0.0.0.0"
    )
)
def serve(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    method: MethodOpt = None,
    draft_tokens: KOpt = None,
    exactness: ExactnessOpt = None,
    p_min: _opt("p_min", "--p-min", help="The draft model stops drafting when its top probability falls below this.") = None,
    max_tokens: _opt("max_tokens", "-n", "--max-tokens", help="Default for requests without max_tokens.") = None,
    temperature: _opt("temperature", "-t", "--temperature", "--temp", help="Default for requests without temperature (0 = greedy).") = None,
    ctx_size: CtxOpt = None,
    gpu_layers: GpuOpt = None,
    draft_gpu_layers: DraftGpuOpt = None,
    threads: ThreadsOpt = None,
    rpc: RpcOpt = None,
    tensor_split: SplitOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on; anything but loopback exposes the API.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port).")] = 8080,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="LOCALSPEC_API_KEY", help="Require Authorization: Bearer KEY (env LOCALSPEC_API_KEY).", show_default=False)] = None,
    queue: Annotated[int, typer.Option("--queue", help="Requests that may wait while one generates (more: 503).")] = 8,
    chat_template: TemplateOpt = None,
):
    """Serve the pair over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models)."""
    from localspec.server.app import serve as run_server
    from localspec.session import Session

    sess = Session(flags(
        model=model, draft=draft, method=method, draft_tokens=draft_tokens, p_min=p_min, max_tokens=max_tokens,
        temperature=temperature, ctx_size=ctx_size, gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers, threads=threads,
        exactness=exactness, rpc=rpc, tensor_split=tensor_split,
    ))
    use_template(sess, chat_template)
    run_server(sess, host=host, port=port, api_key=api_key, queue_size=queue)




def main(argv: list[str] | None = None) -> None:
    # a closed stdout/stderr (`localspec run ... >&-`) is a place where output goes nowhere, not a crash
    if sys.stdout is None:
        sys.stdout = open(os.devnull, "w")
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")
    _install_signals()
    from localspec.cli import progress

    progress.install()  # download progress bars on stderr
    argv = list(sys.argv[1:] if argv is None else argv)
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
        if DEBUG:
            raise
        _err(exc.worded(setting_words))
        sys.exit(exc.exit_code)
    except BrokenPipeError:
        _quiet_pipe()
        sys.exit(0)
    except SystemExit as exc:  # click ends with exit 1 on a broken pipe: the reader's choice is not an error
        if isinstance(exc.__context__, OSError) and exc.__context__.errno == 32:
            _quiet_pipe()
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
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):  # bad flags, missing values
            _err(exc.format_message().splitlines()[0] + " (see --help)")
            sys.exit(2)
        if isinstance(exc.__context__, BrokenPipeError) or isinstance(exc, OSError) and exc.errno == 32:
            _quiet_pipe()
            sys.exit(0)
        if DEBUG:
            raise
        _err(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)")
        sys.exit(1)
    if rc == 130:  # typer turns Ctrl-C into exit code 130
        _interrupted()
    sys.exit(rc if isinstance(rc, int) else 0)


def _quiet_pipe() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    main()
