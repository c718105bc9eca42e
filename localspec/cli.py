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

from . import __version__, config
from .errors import LocalspecError, UsageError

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
models_app = typer.Typer(help="List, download, inspect and add model pairs.", no_args_is_help=True)
app.add_typer(models_app, name="models")

DEBUG = False
INTERRUPT_REPORTED = False  # `run` prints its own summary when interrupted


def _err(msg: str) -> None:
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()


def _version_cb(value: bool):
    if value:
        try:
            from .backend import llama_cpp_version

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
ModelOpt = Annotated[Optional[str], typer.Option("-m", "--model", help="Pair name, hub model (OWNER/REPO[:QUANT], hf://OWNER/REPO/FILE.gguf) or target GGUF path.", show_default=False)]
DraftOpt = Annotated[Optional[str], typer.Option("-d", "--draft", help="Draft: hub model (OWNER/REPO[:QUANT], hf://…), GGUF path, or a pair name (its draft).", show_default=False)]
MethodOpt = Annotated[Optional[str], typer.Option("--method", help="auto | draft | lookup | none.", show_default=False)]
KOpt = Annotated[Optional[int], typer.Option("-k", "--draft-tokens", help="Draft tokens per step (auto: the most it may use).", show_default=False)]
TempOpt = Annotated[Optional[float], typer.Option("-t", "--temperature", help="0 = greedy (default).", show_default=False)]
SystemOpt = Annotated[Optional[str], typer.Option("-s", "--system", help="System prompt.", show_default=False)]


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


def summary_line(stats, finish: str) -> str:
    used = ", ".join(f"{m} {n}" for m, n in stats.method_used.most_common()) or "-"
    mal = f"{stats.mean_accepted_length:.2f}" if stats.drafting_steps else "—"
    return (
        f"{stats.completion_tokens} tokens in {stats.elapsed_s:.2f}s | {rate_text(stats.rate())} tok/s | "
        f"ttft {stats.ttft_s:.2f}s | accepted {stats.accepted}/{stats.drafted} ({stats.acceptance_rate:.0%}) | "
        f"{stats.tokens_per_pass:.2f} tokens per target pass | mean accepted length {mal} | steps: {used} | {finish}"
        + (f" | {stats.reason}" if stats.reason else "")
    )


def main_method(stats) -> str:
    """The method that actually produced the tokens (the most used drafter; none when it never drafted)."""
    used = {m: n for m, n in stats.method_used.items() if m != "none"}
    return max(used, key=used.get) if used else "none"


def result_json(fin, stats, engine, gen_cfg, interrupted=False, text: str = "") -> dict:
    return {
        "text": fin.text if fin else text,
        "finish_reason": "interrupted" if interrupted else fin.finish_reason,
        "method": main_method(stats),
        "requested_method": gen_cfg.method,
        "draft_tokens": gen_cfg.k,
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
        "tokens_per_second": stats.rate(),
        "elapsed_s": stats.elapsed_s,
        "draft_s": stats.draft_s,
        "verify_s": stats.verify_s,
        "steps_by_method": dict(stats.method_used),
        "steps_by_k": {str(k): v for k, v in sorted(stats.k_used.items())},
        "controller": stats.reason or None,
        "draft_dropped": engine.dropped_draft,
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
    p_min: Annotated[Optional[float], typer.Option("--p-min", help="Draft model stops below this top probability.", show_default=False)] = None,
    lookup_min: Annotated[Optional[int], typer.Option("--lookup-min", help="Shortest n-gram for prompt lookup.", show_default=False)] = None,
    lookup_max: Annotated[Optional[int], typer.Option("--lookup-max", help="Longest n-gram for prompt lookup.", show_default=False)] = None,
    max_tokens: Annotated[Optional[int], typer.Option("-n", "--max-tokens", help="Most tokens to generate.", show_default=False)] = None,
    temperature: TempOpt = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", show_default=False)] = None,
    top_p: Annotated[Optional[float], typer.Option("--top-p", show_default=False)] = None,
    min_p: Annotated[Optional[float], typer.Option("--min-p", show_default=False)] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", show_default=False)] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop at this text (repeatable).", show_default=False)] = None,
    system: SystemOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="No chat template: the prompt goes in as-is.")] = False,
    ctx_size: Annotated[Optional[int], typer.Option("-c", "--ctx-size", show_default=False)] = None,
    gpu_layers: Annotated[Optional[int], typer.Option("--gpu-layers", show_default=False)] = None,
    draft_gpu_layers: Annotated[Optional[int], typer.Option("--draft-gpu-layers", show_default=False)] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", show_default=False)] = None,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Nothing on stderr but errors.")] = False,
    no_stream: Annotated[bool, typer.Option("--no-stream", help="Print the answer at the end.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object on stdout at the end.")] = False,
):
    """Answer one prompt (stdin is joined to it), streaming to stdout."""
    from .session import Session, generation_slot

    sess = Session(flags(
        model=model, draft=draft, method=method, draft_tokens=draft_tokens, p_min=p_min, lookup_min=lookup_min,
        lookup_max=lookup_max, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        seed=seed, system=system, ctx_size=ctx_size, gpu_layers=gpu_layers, draft_gpu_layers=draft_gpu_layers, threads=threads,
    ), quiet=quiet)
    piped = read_stdin()
    parts = [p for p in (piped, prompt) if p is not None and p.strip() != ""]
    if not parts:
        raise UsageError("no prompt: pass PROMPT or pipe text on stdin (see localspec run --help)")
    text = "\n\n".join(parts)
    status = Status(quiet)
    from .engine import Finished

    sess.check()  # bad sampling/k/thread values fail before loading gigabytes
    if sys.stderr.isatty():
        sess.announce = status.info
    engine = sess.load()
    try:
        s = sess.values()
        gen_cfg = sess.gen_config(stop)
        if engine.dropped_draft:
            status.info(f"warning: {engine.dropped_draft}; using prompt lookup")
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
                    sys.stderr.write(summary_line(stats, "interrupted") + "\n")
                raise typer.Exit(130)
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
            sys.stderr.write(summary_line(stats, fin.finish_reason) + "\n")
    finally:
        sess.close()


# ----------------------------------------------------------------- config
@app.command("config")
def config_cmd(
    model: ModelOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
):
    """Show the effective settings and where each came from.

    Precedence, highest first: flag > LOCALSPEC_* environment > config file > stored tune result > pair default >
    built-in default."""
    from .session import resolve_settings, tuned_results

    eff = resolve_settings(flags(model=model), strict=False)
    tuned = tuned_results()
    if as_json:
        typer.echo(json.dumps({"config_file": str(config.config_file()),
                               "settings": {k: {"value": v.value, "source": v.source} for k, v in eff.items()},
                               "tuned": tuned}))
        return
    from .output import print_table

    print_table(["setting", "value", "from"], [[k, "" if v.value is None else str(v.value), v.source] for k, v in eff.items()],
                title=f"config file: {config.config_file()}")
    for name, vals in tuned.items():
        typer.echo(f"tuned for {name}: " + ", ".join(f"{a}={b}" for a, b in vals.items()))


# ----------------------------------------------------------------- models
@models_app.command("list")
def models_list(as_json: Annotated[bool, typer.Option("--json")] = False,
                local: Annotated[bool, typer.Option("--local", help="Only what is downloaded (any of its files).")] = False):
    """Pairs, and hub models fetched by name, whether downloaded, sizes and local paths."""
    from . import download, hfname, registry

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
    from .output import print_table

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
    from . import download, hfname, registry

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
    from . import download

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
    from . import download, hfname, registry

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
    from . import download, registry
    from .compat import first_difference
    from .gguf_meta import read_file_metadata, summary, vocab_info

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
    from . import download, hfname, registry

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
    """Versions, compiled backends and devices, CPU features, threads, cache and models."""
    from . import download, registry
    from .backend import default_threads, llama_cpp_version, supports_gpu_offload, system_info

    report: dict = {"localspec": __version__, "python": sys.version.split()[0]}
    try:
        report["llama_cpp_python"] = llama_cpp_version()
        info = system_info()
        report["system_info"] = info.strip()
        report["gpu_offload"] = supports_gpu_offload()
    except Exception as exc:
        report["llama_cpp_python"] = f"not working: {exc}"
        info = ""
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
    backends = [b for b in ("CUDA", "Metal", "Vulkan", "ROCm", "SYCL") if b.lower() in info.lower()]
    report["backends"] = ["CPU"] + backends
    report["threads"] = default_threads()
    cd = download.cache_dir()
    report["cache_dir"] = str(cd)
    report["free_disk_gb"] = round(download.free_bytes(cd) / 1e9, 1)
    report["config_file"] = str(config.config_file())
    pairs, default = registry.load()
    report["models"] = {n: all(download.local_path(s) is not None for s in (p.target, p.draft) if s) for n, p in pairs.items()}
    notes = []
    if any(f.startswith("amx") for f in flags):
        notes.append("CPU has AMX: a default (-march=native) llama-cpp-python build can crash with SIGILL; "
                     "rebuild with the CMAKE_ARGS in the README, or set LOCALSPEC_NO_REPACK=1")
    if not backends:
        notes.append('CPU only. For NVIDIA: CMAKE_ARGS="-DGGML_CUDA=on" pip install --no-cache-dir --force-reinstall '
                     'llama-cpp-python==0.3.36; for Apple: CMAKE_ARGS="-DGGML_METAL=on" (then use --gpu-layers -1)')
    report["notes"] = notes
    if as_json:
        typer.echo(json.dumps(report, indent=1))
        return
    for k, v in report.items():
        if k in ("system_info", "notes", "models"):
            continue
        typer.echo(f"{k}: {', '.join(v) if isinstance(v, list) else v}")
    typer.echo(f"system_info: {report.get('system_info', '')}")
    typer.echo("models: " + ", ".join(f"{n} {'✓' if ok else '·'}" for n, ok in report["models"].items()))
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
    max_tokens: Annotated[Optional[int], typer.Option("-n", "--max-tokens", show_default=False)] = None,
    ctx_size: Annotated[Optional[int], typer.Option("-c", "--ctx-size", show_default=False)] = None,
):
    """Chat in the terminal, with live speculation statistics."""
    from .session import Session
    from .tui.app import create_app

    sess = Session(flags(model=model, draft=draft, method=method, draft_tokens=draft_tokens, temperature=temperature,
                         system=system, max_tokens=max_tokens, ctx_size=ctx_size), quiet=True)
    sess.check()
    create_app(sess).run()


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
    categories: Annotated[Optional[str], typer.Option("--categories", help="Only these categories (comma-separated).", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="At most N prompts per category.", show_default=False)] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the full report as JSON.", show_default=False)] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Write per-run rows as CSV.", show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Speedup chart PNG (needs matplotlib).", show_default=False)] = None,
    ctx_size: Annotated[Optional[int], typer.Option("-c", "--ctx-size", show_default=False)] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", show_default=False)] = None,
):
    """A/B benchmark: the same prompts with and without speculation, interleaved."""
    sess = _bench_session(model, draft, ctx_size, threads)
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
    ctx_size: Annotated[Optional[int], typer.Option("-c", "--ctx-size", show_default=False)] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", show_default=False)] = None,
):
    """Sweep k (and p_min) on a sample, store the fastest config for this pair in the user config."""
    sess = _bench_session(model, draft, ctx_size, threads)
    _tune(sess, prompts=prompts, ks=ks, p_mins=p_mins, max_tokens=max_tokens, limit=limit)


def _bench_session(model, draft, ctx_size, threads):
    from .session import Session

    # bench and tune compare methods themselves: the draft is loaded whatever the configured method is
    sess = Session(flags(model=model, draft=draft, ctx_size=ctx_size, threads=threads, method="auto"))
    sess.check()
    return sess


def _bench(sess, *, prompts, methods, ks, max_tokens, repeat, temperature, categories, limit, json_out, csv_out, plot):
    from rich.console import Console
    from rich.progress import Progress

    from . import bench as B
    from .session import generation_slot

    for p in (json_out, csv_out, plot):
        B.check_out(p)
    if repeat < 1 or max_tokens < 1:
        raise UsageError("--repeat and --max-tokens must be >= 1")
    ps = B.load_prompts(prompts, categories.split(",") if categories else None, limit)
    console = Console(stderr=True)
    sess.announce = console.print
    engine = sess.load()
    try:
        configs = B.parse_configs(methods, ks, has_draft=engine.draft is not None)
        if not configs:
            raise UsageError("nothing to compare: no method besides none (draft needs a draft model)")
        with generation_slot(waiting=console.print):
            calib = B.calibrate(engine, max(c.k for c in configs) + 1)
            total = len(ps) * repeat * len(configs) * 2
            with Progress(console=console, transient=True) as prog:
                task = prog.add_task("benchmarking", total=total)
                results = B.run_bench(engine, ps, configs, max_tokens=max_tokens, repeat=repeat, temperature=temperature,
                                      on_run=lambda r: prog.advance(task))
        rows = B.summarize(results, calib)
        B.print_report(rows, Console())
        meta = {"target": sess.target_path.name, "draft": sess.draft_path.name if sess.draft_path else None,
                "max_tokens": max_tokens, "repeat": repeat, "temperature": temperature, "threads": engine.target.n_threads,
                "configs": [c.label for c in configs], "prompts": len(ps)}
        if json_out:
            B.write_json(json_out, rows, results, calib, meta)
        if csv_out:
            B.write_csv(csv_out, results)
        if plot:
            B.plot_png(plot, rows)
        return rows
    finally:
        sess.close()


def _tune(sess, *, prompts, ks, p_mins, max_tokens, limit):
    from rich.console import Console
    from rich.progress import Progress

    from . import bench as B
    from .session import generation_slot, tuned_key

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


# ----------------------------------------------------------------- entry point
COMMANDS = {"run", "chat", "models", "doctor", "config", "bench", "tune"}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in argv if a not in ("--debug",)), None)
    if first is None:
        if not sys.stdin.isatty():
            argv.append("run")
    elif first not in COMMANDS and first not in ("-h", "--help", "--version"):
        argv.insert(argv.index(first), "run")  # `localspec "prompt"` behaves as `localspec run "prompt"`
    try:
        rc = app(args=argv, prog_name="localspec", standalone_mode=False)
    except LocalspecError as exc:
        if DEBUG:
            raise
        _err(str(exc))
        sys.exit(exc.exit_code)
    except BrokenPipeError:
        _quiet_pipe()
        sys.exit(0)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        sys.exit(130)
    except Exception as exc:  # click's (typer may vendor it) exit, abort and usage errors; anything unexpected
        kind = type(exc).__name__
        if kind == "Exit":
            sys.exit(getattr(exc, "exit_code", 0))
        if kind == "Abort":
            sys.stderr.write("aborted\n")
            sys.exit(1)
        if hasattr(exc, "format_message") and hasattr(exc, "exit_code"):  # bad flags, missing values
            _err(exc.format_message().splitlines()[0] + " (see --help)")
            sys.exit(2)
        if DEBUG:
            raise
        _err(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)")
        sys.exit(1)
    if rc == 130 and not INTERRUPT_REPORTED:  # typer turns Ctrl-C into exit code 130
        sys.stderr.write("\ninterrupted (a partial download is kept and resumes next time)\n")
    sys.exit(rc if isinstance(rc, int) else 0)


def _quiet_pipe() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":  # pragma: no cover
    main()
