"""`bench` and `tune` on a loaded engine: the checks before any work, calibration, the interleaved runs, the
report's files, the algorithm-bug verdict, and tune's result stored in the config file. Nothing here prints: a
front end hears of progress through callbacks (`on_start(total)`, `on_run(result)`, `on_report(rows)`)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, ContextManager

from localspec.bench import runner as B
from localspec.errors import AlgorithmBugError, UsageError
from localspec.store.tomlfile import config_file, update_file

Slot = Callable[[], ContextManager]

# the formats matplotlib's Agg backend writes (FigureCanvasBase.get_supported_filetypes), checked before a
# benchmark: matplotlib itself refuses another only when the chart is saved, after the whole run
PLOT_FORMATS = frozenset({"eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz", "tif", "tiff",
                          "webp"})


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a benchmark: what was measured so far (`rows`, None when nothing), of how many runs."""

    def __init__(self, rows: list[dict] | None, done: int, total: int) -> None:
        super().__init__()
        self.rows, self.done, self.total = rows, done, total


def check_outputs(json_out: Path | None = None, csv_out: Path | None = None, plot: Path | None = None) -> None:
    """Before a benchmark: the report files are different files, and --plot has matplotlib to draw with."""
    seen: dict[Path, str] = {}
    for flag, path in (("--json", json_out), ("--csv", csv_out), ("--plot", plot)):
        if path is None:
            continue
        where = Path(path).expanduser().absolute()
        try:
            where = where.resolve()
        except OSError:
            pass
        if where in seen:
            raise UsageError(f"{seen[where]} and {flag} both write {path}: give each its own file")
        seen[where] = flag
    if plot is not None:
        kind = Path(plot).suffix.lower().lstrip(".")
        if kind and kind not in PLOT_FORMATS:  # no suffix: matplotlib writes a PNG
            raise UsageError(f"--plot {plot}: matplotlib cannot write .{kind} files; name a .png (or .svg, .pdf) file")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'localspec[plot]'") from None


def benchmark(engine, prompts: list[dict], configs: list[B.BenchConfig], *, max_tokens: int, repeat: int,
              temperature: float, exactness: str, meta: dict | None = None, json_out: Path | None = None,
              csv_out: Path | None = None, plot: Path | None = None, slot: Slot = contextlib.nullcontext,
              on_start: Callable[[int], None] | None = None, on_run: Callable[[B.RunResult], None] | None = None,
              on_report: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Calibrate, run every config against the interleaved baseline (inside `slot()`), summarize, hand the rows to
    `on_report`, write the requested files; raise AlgorithmBugError when a divergence cannot be numeric and
    Interrupted (with the rows so far) on Ctrl-C. Returns the summary rows."""
    done: list[B.RunResult] = []
    calib = None
    total = len(prompts) * repeat * len(configs) * 2

    def record(r: B.RunResult) -> None:
        done.append(r)
        if on_run:
            on_run(r)

    try:
        with slot():
            calib = B.calibrate(engine, max(c.k for c in configs) + 1)
            if on_start:
                on_start(total)
            results = B.run_bench(engine, prompts, configs, max_tokens=max_tokens, repeat=repeat,
                                  temperature=temperature, exactness=exactness, on_run=record)
    except KeyboardInterrupt:
        raise Interrupted(B.summarize(done, calib) if done else None, len(done), total) from None
    rows = B.summarize(results, calib)
    if on_report:
        on_report(rows)
    meta = dict(meta or {}) | {
        "max_tokens": max_tokens, "repeat": repeat, "temperature": temperature, "threads": engine.target.n_threads,
        "exactness": exactness, "configs": [c.label for c in configs], "prompts": len(prompts),
        "rpc_workers": list(getattr(engine.target, "rpc_servers", None) or [])}
    if json_out:
        B.write_json(json_out, rows, results, calib, meta)
    if csv_out:
        B.write_csv(csv_out, results)
    if plot:
        B.plot_png(plot, rows)
    bugs = sum(r.mismatch_kind == "bug" for r in results)
    if bugs:
        raise AlgorithmBugError(f"{bugs} divergence{'s exceed' if bugs != 1 else ' exceeds'} the measured numeric "
                                "deviation (algorithm bug)")
    return rows


def tune_configs(ks: str, p_mins: str, has_draft: bool) -> list[B.BenchConfig]:
    return B.parse_configs("draft,lookup" if has_draft else "lookup", ks, p_mins, has_draft=has_draft)


def tune(engine, prompts: list[dict], *, ks: str, p_mins: str, max_tokens: int, key: str, draft: str | None = None,
         slot: Slot = contextlib.nullcontext, on_start: Callable[[int], None] | None = None,
         on_run: Callable[[B.RunResult], None] | None = None) -> tuple[dict, dict]:
    """Sweep the configs on the sample, store the fastest under `tuned.KEY` in the config file, with `draft` (the
    identity of the draft the user named, session.tuned_draft) beside it: the result applies only with that draft.
    Returns (the stored entry, the winning summary row)."""
    configs = tune_configs(ks, p_mins, engine.draft is not None)
    with slot():
        if on_start:
            on_start(len(prompts) * len(configs) * 2)
        results = B.run_bench(engine, prompts, configs, max_tokens=max_tokens, on_run=on_run)
    best = B.choose_best(B.summarize(results))
    entry = {"method": best["method"], "k": best["k"], "tokens_per_second": round(best["tps_median"], 2),
             "speedup": round(best["speedup_median"], 3) if best["speedup_median"] else 1.0,
             "tuned_at": time.strftime("%Y-%m-%d %H:%M")}
    if draft is not None:
        entry["draft"] = draft
    label = best["config"]
    if label.startswith("draft") and " p=" in label:
        entry["p_min"] = float(label.split(" p=")[1])
    update_file(config_file(), lambda d: d.setdefault("tuned", {}).__setitem__(key, entry))
    return entry, best
