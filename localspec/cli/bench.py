"""`localspec bench` and `localspec tune`."""

from __future__ import annotations

import time
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
            state.interrupt_reported = True
            if done:
                B.print_report(B.summarize(done, calib), Console())
            console.print(f"interrupted after {len(done)} of {total} runs" + (" (the table above covers those)" if done else ""))
            raise typer.Exit(state.interrupt_exit) from None
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

