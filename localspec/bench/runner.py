"""`localspec bench` and `localspec tune`: the same prompts with and without speculation, interleaved
(baseline, config, baseline, config, ...) so drift hits both; per-prompt speedup ratios; exactness check."""

from __future__ import annotations

import csv
import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from localspec.core.engine import Engine, GenConfig
from localspec.core.report import bench_figures
from localspec.errors import UsageError
from localspec.sample.sampling import SamplingParams

CATEGORIES = ("code", "code_edit", "extract", "json", "chat", "creative")
METHODS = ("none", "draft", "lookup", "ngram", "suffix", "auto")  # what --methods compares
FIXED = ("draft", "lookup", "ngram", "suffix")  # the methods with a fixed k (auto is compared with the best of them)


@dataclass(frozen=True)
class BenchConfig:
    method: str
    k: int = 0
    p_min: float | None = None

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none"
        s = f"{self.method} k={self.k}" if self.method != "auto" else f"auto k<={self.k}"
        return s + (f" p={self.p_min:g}" if self.p_min is not None else "")


BASELINE = BenchConfig("none", 0)


@dataclass
class RunResult:
    prompt_id: str
    category: str
    config: str
    method: str
    k: int
    repeat: int
    tokens_per_second: float
    latency_s: float
    ttft_s: float
    completion_tokens: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    draft_s: float
    verify_s: float
    target_passes: int
    k_effective: int = 0  # k after the exact-batch cap
    exactness: str = ""  # the level the run used: bit | lossless
    speedup: float | None = None  # vs the baseline run right before it
    exact: bool | None = None  # temperature 0: same tokens as the baseline
    mismatch_pos: int | None = None  # first divergent position
    mismatch_margin: float | None = None  # the target's top-2 logit margin there, one token at a time
    mismatch_deviation: float | None = None  # measured batch-vs-single |Δlogit| for the run's batch sizes
    mismatch_kind: str | None = None  # numeric (a near-tie flipped by float order) | bug
    draft_model_steps: int = 0  # drafting steps whose drafts came from the draft model (the rest: lookup)
    drafting_steps: int = 0
    rollback: str = "kv"  # how rejected drafts were undone (kv | rs | checkpoint | none)
    replayed_tokens: int = 0  # tokens decoded again after a checkpoint restore (recurrent/hybrid targets)
    # per drafting source (lookup, suffix, draft, a head): {"steps", "drafted", "accepted"}; drafted and accepted
    # are None where the run's steps do not say which source drafted them (Stats.by_source)
    sources: dict = field(default_factory=dict)
    tokens: list[int] = field(default_factory=list, repr=False)


# ------------------------------------------------------------------ prompts
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true/false", type(None): "null"}


def load_prompts(path: Path | None = None, categories: Sequence[str] | None = None, limit: int | None = None) -> list[dict]:
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be >= 1 (prompts per category), got {limit}")
    if path is None:
        text = (resources.files("localspec") / "data" / "bench_prompts.jsonl").read_text()
        where = "built-in prompts"
    else:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read prompts file {path}: {exc.strerror}") from None
        where = str(path)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise UsageError(f"{where} line {line}: not UTF-8 text (JSON lines {{\"prompt\": ...}} expected)") from None
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"{where} line {i}: {exc}") from None
        if not isinstance(d, dict):
            raise UsageError(f"{where} line {i}: expected a JSON object {{\"prompt\": ...}}, got {_JSON_KINDS.get(type(d), type(d).__name__)}")
        if not isinstance(d.get("prompt"), str) or not d["prompt"].strip():
            raise UsageError(f"{where} line {i}: missing 'prompt'")
        for key in ("id", "category"):
            v = d.get(key)
            if v is not None and (not isinstance(v, (str, int)) or isinstance(v, bool) or key == "category" and not isinstance(v, str)):
                raise UsageError(f"{where} line {i}: {key!r} must be {'a string' if key == 'category' else 'a string or a number'}, "
                                 f"got {json.dumps(v)}")
        d.setdefault("id", f"p{i}")
        d.setdefault("category", "default")
        out.append(d)
    if categories:
        out = [d for d in out if d["category"] in categories]
    if limit is not None:
        seen: dict[str, int] = {}
        kept = []
        for d in out:
            seen[d["category"]] = seen.get(d["category"], 0) + 1
            if seen[d["category"]] <= limit:
                kept.append(d)
        out = kept
    if not out:
        raise UsageError(f"no prompts selected from {where}")
    return out


def parse_configs(methods: str, ks: str, p_mins: str | None = None, has_draft: bool = True) -> list[BenchConfig]:
    try:
        k_list = [int(x) for x in ks.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--k must be comma-separated integers, got {ks!r}") from None
    if not k_list:
        raise UsageError(f"--k must name at least one integer, got {ks!r}")
    try:
        p_list = [float(x) for x in p_mins.split(",")] if p_mins else [None]
    except ValueError:
        raise UsageError(f"--p-min must be comma-separated numbers, got {p_mins!r}") from None
    out = []
    for m in [x.strip() for x in methods.split(",") if x.strip()]:
        if m not in METHODS:
            raise UsageError(f"unknown method {m!r} in --methods")
        if m == "none":
            continue  # the baseline always runs
        if m == "draft" and not has_draft:
            continue
        if any(k < 1 or k > 64 for k in k_list):
            raise UsageError(f"k must be between 1 and 64, got {ks}")
        if m == "auto":  # auto picks k itself, up to the largest k given
            out.append(BenchConfig("auto", max(k_list)))
            continue
        for k in k_list:
            out.extend(BenchConfig(m, k, p) for p in (p_list if m == "draft" else [None]))
    return out


# ------------------------------------------------------------------ arithmetic
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), numpy's default."""
    if not values:
        return float("nan")
    return float(np.percentile(np.asarray(values, dtype=float), q))


def ideal_speedup(alpha: float, k: int, c: float, t_ratio: float) -> float:
    """Leviathan et al. (2023): expected speedup for acceptance alpha, k drafts, draft cost c (per draft
    token, relative to one target token) and verify cost t_ratio = T(k+1)/T(1)."""
    if k == 0:
        return 1.0
    e = (k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return e / (k * c + t_ratio)


def calibrate(engine: Engine, max_batch: int, reps: int = 3) -> dict:
    """Measured verify-cost curve T(b)/T(1) of the target and the draft's per-token cost c."""
    from localspec.core.verify_cost import time_batches

    curve = time_batches(engine.target, max_batch, reps)
    c = 0.0
    if engine.draft is not None:
        d = engine.draft
        d.clear()
        ctx = d.tokenize("def main():\n    print('hello world')\n" * 8)
        d.decode(ctx)
        dbase = len(d.tokens)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            d.decode(ctx[:1], "last")
            ts.append(time.perf_counter() - t)
            d.truncate(dbase)
        c = statistics.median(ts) / curve[1]
        d.clear()
    return {"t": curve, "ratio": {b: v / curve[1] for b, v in curve.items()}, "c": c}


# ------------------------------------------------------------------ running
def _margin_at(engine: Engine, prompt: list[int], prefix: list[int]) -> float:
    """The target's top-2 logit margin after prompt + prefix, computed as plain decoding does: the prompt in one
    batch, then every generated token on its own (so no verify batch's rounding leaks in through the KV cache)."""
    tgt = engine.target
    logits = tgt.sync(prompt)
    for t in prefix:
        logits = tgt.decode([t], "last")[0]
    top2 = np.partition(logits, -2)[-2:]
    return float(top2[1] - top2[0])


# A verify row's logits differ from the one-token decode by at most the measured deviation d each, so the gap
# between the top two can move by up to 2d: a flip at a margin above that cannot come from float order.
FLIP_FACTOR = 2.0


def classify(margin: float, deviation: float) -> str:
    """'numeric' when float reduction order can explain a divergence at this margin, else 'bug'."""
    return "bug" if margin > FLIP_FACTOR * deviation else "numeric"


def batch_deviation(engine: Engine, k_requested: int, k_effective: int) -> float:
    """The largest measured |Δlogit| for the verify batches a run can use (2..k_effective + 1 rows), from the
    probe the engine ran (or runs now) for k_requested."""
    from localspec.core.exactness import deviation

    if k_effective < 1:
        return 0.0
    dev = deviation(engine.target, max(k_requested, k_effective) + 1)
    return max((v for b, v in dev.items() if b <= k_effective + 1), default=0.0)


@contextmanager
def lone_request(engine: Engine):
    """The engine's suffix drafter drafts from this request alone: a private scope, never read from or saved to the
    cache dir. Each bench run is measured as a first request would be, not drafted from an earlier session's, an
    earlier configuration's or an earlier repeat's answer to the same prompt."""
    from localspec.drafters.suffix_corpus import private_scope, release_scope

    saved, scope = engine.suffix_scope, private_scope()
    engine.suffix_scope = scope
    try:
        yield
    finally:
        engine.suffix_scope = saved
        release_scope(scope)


def _one(engine, tokens, cfg: BenchConfig, max_tokens, temperature, seed, exactness="auto") -> tuple:
    gc = GenConfig(method=cfg.method, k=cfg.k, max_tokens=max_tokens, exactness=exactness,
                   sampling=SamplingParams(temperature=temperature, seed=seed),
                   **({"p_min": cfg.p_min} if cfg.p_min is not None else {}))
    with lone_request(engine):
        fin = engine.complete(tokens, gc)
    return fin.tokens, fin.stats


def run_bench(
    engine: Engine,
    prompts: list[dict],
    configs: list[BenchConfig],
    *,
    max_tokens: int = 128,
    repeat: int = 1,
    temperature: float = 0.0,
    exactness: str = "auto",
    on_run: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    results: list[RunResult] = []

    def record(p, cfg, r, toks, st, base=None):
        f = bench_figures(st)  # the one report of a generation (core/report.py): same names and values as run --json
        latency, k_eff = f.pop("elapsed_s"), f.pop("k_in_use")
        rr = RunResult(prompt_id=p["id"], category=p["category"], config=cfg.label, method=cfg.method, k=cfg.k,
                       repeat=r, latency_s=latency, k_effective=k_eff, tokens=toks, **f,
                       sources={m: {"steps": n, "drafted": d, "accepted": a}
                                for m, (n, d, a) in st.by_source().items()})
        if base is not None:
            rr.speedup = rr.tokens_per_second / base.tokens_per_second if base.tokens_per_second else None
            if temperature == 0.0:
                rr.exact = toks == base.tokens
        results.append(rr)
        if on_run:
            on_run(rr)
        return rr

    for p in prompts:
        tokens = engine.chat_prompt([{"role": "user", "content": p["prompt"]}])
        if len(tokens) + max_tokens + 1 > engine.target.n_ctx:
            raise UsageError(f"prompt {p['id']} ({len(tokens)} tokens) + {max_tokens} does not fit the context; use -c")
        engine.complete(tokens, GenConfig(method="none", max_tokens=1))  # warm the prompt cache: all runs start equal
        for r in range(repeat):
            seed = 1000 + r
            for cfg in configs:
                btoks, bst = _one(engine, tokens, BASELINE, max_tokens, temperature, seed)
                base = record(p, BASELINE, r, btoks, bst)
                toks, st = _one(engine, tokens, cfg, max_tokens, temperature, seed, exactness)
                rr = record(p, cfg, r, toks, st, base)
                if rr.exact is False:
                    audit(engine, rr, tokens, toks, btoks)
    return results


def audit(engine: Engine, rr: RunResult, prompt: list[int], toks: list[int], btoks: list[int]) -> None:
    """Re-score an output that differs from plain decoding: where, at what margin, and whether the measured
    numeric deviation of the verify batches can explain it."""
    pos = next((i for i, (a, b) in enumerate(zip(toks, btoks)) if a != b), min(len(toks), len(btoks)))
    rr.mismatch_pos = pos
    rr.mismatch_margin = _margin_at(engine, prompt, btoks[:pos])
    rr.mismatch_deviation = batch_deviation(engine, rr.k, rr.k_effective)
    rr.mismatch_kind = classify(rr.mismatch_margin, rr.mismatch_deviation)


# ------------------------------------------------------------------ report
def summarize(results: list[RunResult], calib: dict | None = None) -> list[dict]:
    """One row per (config, category), plus category 'all'."""
    rows = []
    keys = []
    for r in results:
        for cat in (r.category, "all"):
            if (r.config, cat) not in keys:
                keys.append((r.config, cat))
    for config, cat in keys:
        rs = [r for r in results if r.config == config and (cat == "all" or r.category == cat)]
        tps = [r.tokens_per_second for r in rs]
        lat = [r.latency_s for r in rs]
        sp = [r.speedup for r in rs if r.speedup is not None]
        drafted = sum(r.drafted for r in rs)
        accepted = sum(r.accepted for r in rs)
        passes = sum(r.target_passes for r in rs)
        alpha = accepted / drafted if drafted else 0.0
        exact = [r.exact for r in rs if r.exact is not None]
        diverged = [r for r in rs if r.exact is False]
        row = {
            "config": config, "category": cat, "runs": len(rs), "method": rs[0].method, "k": rs[0].k,
            "k_effective": max(r.k_effective for r in rs),
            "tps_median": statistics.median(tps), "tps_p95": percentile(tps, 95),
            "latency_p50": percentile(lat, 50), "latency_p95": percentile(lat, 95),
            "ttft_median": statistics.median(r.ttft_s for r in rs),
            "acceptance_rate": alpha,
            "mean_accepted_length": (accepted + passes) / passes if passes else 0.0,
            "speedup_median": statistics.median(sp) if sp else None,
            "exact": all(exact) if exact else None,
            "exactness": ",".join(sorted({r.exactness for r in rs if r.exactness})) or None,
            "identical_share": sum(exact) / len(exact) if exact else None,
            "median_divergence": statistics.median(r.mismatch_pos for r in diverged) if diverged else None,
            "bugs": sum(r.mismatch_kind == "bug" for r in diverged),
            "mismatches": [{"prompt": r.prompt_id, "repeat": r.repeat, "position": r.mismatch_pos, "margin": r.mismatch_margin,
                            "deviation": r.mismatch_deviation, "kind": r.mismatch_kind} for r in diverged],
            "ideal_speedup": None, "measured_over_ideal": None,
            "rollback": ",".join(sorted({r.rollback for r in rs})),
            "replayed_per_100": 100 * sum(r.replayed_tokens for r in rs) / max(sum(r.completion_tokens for r in rs), 1),
            "oracle": None, "oracle_speedup": None, "auto_over_oracle": None,
        }
        row["sources"] = sources_of(rs)
        if calib and row["method"] in (*FIXED, "auto") and drafted:
            k = row["k_effective"] or row["k"]
            if row["method"] == "auto":  # the draft cost weighted by how often auto drafted with the draft model
                steps = sum(r.drafting_steps for r in rs)
                c = calib["c"] * sum(r.draft_model_steps for r in rs) / steps if steps else 0.0
            else:
                c = calib["c"] if row["method"] == "draft" else 0.0
            ratio = calib["ratio"].get(k + 1)
            if ratio and row["method"] == "auto":
                # auto picks k per step and may stay plain: the bound is the best k <= its cap, and never below 1
                ideal = max([1.0] + [ideal_speedup(alpha, j, c, calib["ratio"][j + 1]) for j in range(1, k + 1)
                                     if calib["ratio"].get(j + 1)])
                row["ideal_speedup"] = ideal
                if row["speedup_median"]:
                    row["measured_over_ideal"] = row["speedup_median"] / ideal
            elif ratio:
                ideal = ideal_speedup(alpha, k, c, ratio)
                row["ideal_speedup"] = ideal
                if row["speedup_median"]:
                    row["measured_over_ideal"] = row["speedup_median"] / ideal
        rows.append(row)
    for row in rows:  # auto against the best fixed configuration measured in the same run (plain counts: 1.0x)
        if row["method"] != "auto":
            continue
        fixed = [r for r in rows if r["category"] == row["category"] and r["method"] in FIXED
                 and r["speedup_median"] is not None]
        best = max(fixed, key=lambda r: r["speedup_median"], default=None)
        if best is not None and best["speedup_median"] > 1.0:
            row["oracle"], row["oracle_speedup"] = best["config"], best["speedup_median"]
        else:
            row["oracle"], row["oracle_speedup"] = "none", 1.0
        if row["speedup_median"] is not None:
            row["auto_over_oracle"] = row["speedup_median"] / row["oracle_speedup"]
    return rows


def sources_of(results: list[RunResult]) -> dict:
    """Steps, drafted and accepted tokens and acceptance per drafting source over `results` (drafted and accepted
    None where a run did not record its split among sources)."""
    out: dict[str, dict] = {}
    for r in results:
        for m, c in r.sources.items():
            s = out.setdefault(m, {"steps": 0, "drafted": 0, "accepted": 0})
            s["steps"] += c["steps"]
            for key in ("drafted", "accepted"):
                s[key] = None if s[key] is None or c[key] is None else s[key] + c[key]
    for s in out.values():
        s["acceptance_rate"] = s["accepted"] / s["drafted"] if s["drafted"] else None
    return out


def write_json(path: Path, rows, results, calib, meta) -> None:
    data = {"meta": meta, "calibration": calib, "summary": rows,
            "runs": [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in results]}
    Path(path).write_text(json.dumps(data, indent=1, default=str))


def write_csv(path: Path, results) -> None:
    fields = [k for k in asdict(results[0]) if k != "tokens"]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        for r in results:
            w.writerow({k: json.dumps(v) if isinstance(v, dict) else v for k, v in asdict(r).items()
                        if k != "tokens"})


def plot_png(path: Path, rows) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'localspec[plot]'") from None
    cats = [c for c in dict.fromkeys(r["category"] for r in rows if r["category"] != "all")]
    configs = [c for c in dict.fromkeys(r["config"] for r in rows if r["method"] != "none")]
    fig, ax = plt.subplots(figsize=(max(6, len(cats) * 1.5), 4))
    w = 0.8 / max(1, len(configs))
    for i, cfg in enumerate(configs):
        vals = [next((r["speedup_median"] or 0 for r in rows if r["config"] == cfg and r["category"] == c), 0) for c in cats]
        ax.bar([j + i * w for j in range(len(cats))], vals, w, label=cfg)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cats))], cats)
    ax.set_ylabel("speedup vs plain")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def choose_best(rows: list[dict]) -> dict:
    """The config with the best median tokens/s over the sample ('all' rows)."""
    alls = [r for r in rows if r["category"] == "all"]
    return max(alls, key=lambda r: r["tps_median"])
