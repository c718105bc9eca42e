"""`localspec bench` and `localspec tune`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from localspec import settings as config
from localspec.cli.options import (CtxOpt, DraftGpuOpt, DraftOpt, ExactnessOpt, GpuOpt, ModelOpt, RpcOpt, SplitOpt,
                                    TemplateOpt, ThreadsOpt, flags, state, use_template)
from localspec.errors import UsageError


def bench(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="JSON lines {id, category, prompt}; default: the built-in set.", show_default=False)] = None,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated: none,draft,lookup,ngram,suffix,auto.")] = "none,draft,lookup,auto",
    ks: Annotated[str, typer.Option("--k", help="Comma-separated k values.")] = "2,4,8",
    max_tokens: Annotated[int, typer.Option("-n", "--max-tokens", help="Tokens per answer.")] = 128,
    repeat: Annotated[int, typer.Option("--repeat", help="Runs of each configuration per prompt.")] = 1,
    temperature: Annotated[float, typer.Option("-t", "--temperature", help="Sampling temperature; 0 = greedy.")] = 0.0,
    exactness: ExactnessOpt = None,
    categories: Annotated[Optional[str], typer.Option("--categories", help="Only these categories (comma-separated).", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="At most N prompts per category.", show_default=False)] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the full report as JSON.", show_default=False)] = None,
    csv_out: Annotated[Optional[Path], typer.Option("--csv", help="Write per-run rows as CSV.", show_default=False)] = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Speed-up chart image, e.g. PNG (needs matplotlib: pip install '.[plot]').", show_default=False)] = None,
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


def tune(
    model: ModelOpt = None,
    draft: DraftOpt = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="JSON lines {id, category, prompt} to sample from; default: the built-in set.", show_default=False)] = None,
    ks: Annotated[str, typer.Option("--k", help="k values to sweep.")] = "1,2,3,4,6,8",
    p_mins: Annotated[str, typer.Option("--p-min", help="p_min values to sweep (draft method).")] = "0.5,0.75",
    max_tokens: Annotated[int, typer.Option("-n", "--max-tokens", help="Tokens per answer.")] = 96,
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


def check_out(path: Path | None) -> None:
    """Before a run: an output file must be writable where it is asked for, and is never overwritten silently."""
    if path is not None:
        parent = Path(path).expanduser().absolute().parent
        if not parent.is_dir():
            raise UsageError(f"cannot write {path}: folder {parent} does not exist")
        if Path(path).is_dir():
            raise UsageError(f"cannot write {path}: it is a folder")
    if path is not None and Path(path).exists() and not sys.stdin.isatty():
        raise UsageError(f"{path} exists; refusing to overwrite it (remove it or choose another name)")
    if path is not None and Path(path).exists():
        if not typer.confirm(f"{path} exists. Overwrite?", err=True):
            raise UsageError(f"{path} exists; not overwritten")


class _Progress:
    """A transient rich progress bar on stderr, started when the work's size is known."""

    def __init__(self, console, what: str) -> None:
        from rich.progress import Progress

        self.prog = Progress(console=console, transient=True)
        self.what = what
        self.task = None

    def start(self, total: int) -> None:
        self.prog.start()
        self.task = self.prog.add_task(self.what, total=total)

    def advance(self, _result=None) -> None:
        if self.task is not None:
            self.prog.advance(self.task)

    def stop(self) -> None:
        if self.task is not None:
            self.prog.stop()


def _bench(sess, *, prompts, methods, ks, max_tokens, repeat, temperature, categories, limit, json_out, csv_out, plot):
    from rich.console import Console

    from localspec.bench import runner as B
    from localspec.bench import tune as T
    from localspec.cli.bench_report import print_report
    from localspec.session import generation_slot

    T.check_outputs(json_out, csv_out, plot)  # everything the user gave is checked before any model loads
    for p in (json_out, csv_out, plot):
        check_out(p)
    if repeat < 1 or max_tokens < 1:
        raise UsageError("--repeat and --max-tokens must be >= 1")
    ps = B.load_prompts(prompts, categories.split(",") if categories else None, limit)
    B.parse_configs(methods, ks, has_draft=True)
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
        progress = _Progress(console, "benchmarking")
        try:
            return T.benchmark(
                engine, ps, configs, max_tokens=max_tokens, repeat=repeat, temperature=temperature,
                exactness=exactness, json_out=json_out, csv_out=csv_out, plot=plot,
                meta={"target": sess.target_path.name, "draft": sess.draft_path.name if sess.draft_path else None},
                slot=lambda: generation_slot(waiting=console.print), on_start=progress.start, on_run=progress.advance,
                on_report=lambda rows: (progress.stop(), print_report(rows, Console())))
        except T.Interrupted as stop:
            progress.stop()
            state.interrupt_reported = True
            if stop.rows:
                print_report(stop.rows, Console())
            console.print(f"interrupted after {stop.done} of {stop.total} runs"
                          + (" (the table above covers those)" if stop.rows else ""))
            raise typer.Exit(state.interrupt_exit) from None
        finally:
            progress.stop()
    finally:
        sess.close()


def _tune(sess, *, prompts, ks, p_mins, max_tokens, limit):
    from rich.console import Console

    from localspec.bench import runner as B
    from localspec.bench import tune as T
    from localspec.session import generation_slot, tuned_draft, tuned_key

    ps = B.load_prompts(prompts, None, limit)
    T.tune_configs(ks, p_mins, has_draft=True)  # bad values fail before any model loads
    console = Console(stderr=True)
    sess.announce = console.print
    engine = sess.load()
    try:
        progress = _Progress(console, "tuning")
        key = tuned_key(sess["model"], sess.pair)
        from localspec.printable import printable

        name = sess.pair.name if sess.pair is not None else sess.target_path.name
        if sess.draft_path is not None:
            name += f" + {sess.draft_path.name}"
        name = printable(name)  # file names reach the terminal without their control characters
        try:
            entry, best = T.tune(engine, ps, ks=ks, p_mins=p_mins, max_tokens=max_tokens, key=key,
                                 draft=tuned_draft(sess["draft"]),
                                 slot=lambda: generation_slot(waiting=console.print), on_start=progress.start,
                                 on_run=progress.advance)
        finally:
            progress.stop()
        if best["method"] == "none":
            console.print(f"speculation does not pay on this machine for {name}: plain decoding measured fastest "
                          f"({best['tps_median']:.1f} tok/s); stored method=none")
        else:
            console.print(f"chose {best['config']} for {name}: {best['tps_median']:.1f} tok/s, "
                          f"{entry['speedup']:.2f}x plain (median of per-prompt ratios); stored in {config.config_file()}")
        return entry
    finally:
        sess.close()
