"""Replay the speculation controller on recorded answers, without a model and without timing noise.

At temperature 0 the target's answer to a prompt is fixed, so what a drafter proposes at each step and how much of
it the target accepts follow from the recorded tokens alone; a step's cost is T(b)/T(1) from a verify curve (the
calibration `localspec` measures per machine). Replaying `auto` and fixed settings over the same record compares
their choices exactly: the same figures every run, where timed runs on a 2-core machine spread by 5-10%.

    python -m localspec.bench.replay TRACES.json [--tokens N] [--curve avx2|avx512|epyc|epyc-steep|flat] [--draft-cost C] [--series]

Record traces with `record()` (a loaded Engine and prompts): each is {"id", "prompt": [...], "output": [...]}. A
draft model's proposals depend on the model, not on the recorded tokens alone: `record(..., drafter="draft")` also
keeps, for every position of the answer, what that drafter proposed there ("proposals": {"draft": [[...], ...]}), and
replay puts those proposals in fixed-k and `auto` policies beside prompt lookup, each drafted token costing C target
steps (--draft-cost; default: the trace's "draft_cost", the draft's size over the target's).

Native `llama-lookup` is replayed as NativeLookupModel drafts (llama.cpp's n-gram cache, checked against the binary's
own counts on benchmarks/data/native_lookup_traces.json): not prompt lookup at a fixed k, which drafts after matches
the native cache declines and misses the ones it takes after a single token.

--series replays the traces as one user's requests in order: each answer enters the suffix cache of the ones after it
(a script run again, an agent repeating itself), and `auto` drafts from that cache beside prompt lookup, as native
lookup with -lcd drafts from the counts of the runs before; an id of the form N-GROUP is also totalled per GROUP
(benchmarks/repeated_work.py records such a series).

best_possible() is the most any controller with the same drafters could reach on a trace, knowing the answer: the last
row of both tables, and what `auto` pays to learn a request is its distance under it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Callable, Sequence

from localspec.core.policy import AdaptivePolicy, FixedPolicy, Policy, repeat_k
from localspec.drafters.base import Drafter, Proposal
from localspec.drafters.chain import chained
from localspec.drafters.ngram_cache import NgramCacheDrafter, count_next, draft_next
from localspec.drafters.prompt_lookup import PromptLookupDrafter
from localspec.drafters.suffix import Doc, SuffixCorpus, SuffixDrafter
from localspec.seq import common_prefix
from localspec.defaults import SUFFIX_CACHE_TOKENS

# T(b)/T(1) for b = 1..9 rows, Qwen2.5-Coder-1.5B Q4_K_M with 2 threads (localspec's calibration on each machine)
CURVES = {
    "avx2": {1: 1.0, 2: 1.60, 3: 2.19, 4: 2.67, 5: 3.27, 6: 3.81, 7: 4.46, 8: 6.64, 9: 7.07},
    "avx512": {1: 1.0, 2: 1.5, 3: 1.9, 4: 1.65, 5: 2.2, 6: 2.5, 7: 2.8, 8: 3.0, 9: 3.2},
    "epyc": {1: 1.0, 2: 1.75, 3: 2.25, 4: 2.85, 5: 3.45, 6: 3.95, 7: 4.55, 8: 4.7, 9: 5.05},  # AMD EPYC, AVX-512
    # another AMD EPYC (AVX-512, BF16): the curve its controller priced by, the calibration's extra cost scaled x 1.54 by
    # the verify steps of a busy hour, the steepest any run priced by: a drafted token pays only inside long copies
    "epyc-steep": {1: 1.0, 2: 1.94, 3: 2.81, 4: 3.31, 5: 4.39, 6: 5.25, 7: 6.02, 8: 8.87, 9: 9.98},
    "flat": {b: 1.0 + 0.02 * (b - 1) for b in range(1, 10)},  # a GPU: a batch of 9 costs about one row
}
T1 = 0.065  # seconds per one-token step (only scales the figures)


def step_cost(curve: dict[int, float], rows: int) -> float:
    if rows in curve:
        return T1 * curve[rows]
    top = max(curve)
    return T1 * (curve[top] + (curve[top] - curve[top - 1]) * (rows - top))


class RecordedDrafter(Drafter):
    """A drafter that proposes what a recorded one proposed at the same position of the same answer (record()):
    `at[i]` followed prompt + output[:i + 1]. Each drafted token costs `draft_cost` target steps."""

    def __init__(self, name: str, n_prompt: int, at: Sequence[Sequence[int]], draft_cost: float) -> None:
        self.name, self.n_prompt, self.at, self.draft_cost = name, n_prompt, at, draft_cost

    def cost(self) -> float:
        return self.draft_cost

    def propose(self, context, k, sp, rng) -> Proposal:
        i = len(context) - self.n_prompt - 1
        return Proposal(list(self.at[i][:k]) if 0 <= i < len(self.at) else [])


def replay(trace: dict, make_policy: Callable[..., Policy], curve: dict[int, float], n: int | None = None) -> dict:
    """Decode `trace` again under the policy: returns tokens/s (simulated), steps and acceptance counts.
    `make_policy` takes no argument, or the trace (a policy with a recorded drafter reads its proposals)."""
    prompt = [int(t) for t in trace["prompt"]]
    out = [int(t) for t in trace["output"]][:n]
    policy = make_policy(trace) if getattr(make_policy, "wants_trace", False) else make_policy()
    for d in policy.drafters.values():
        d.begin(prompt)
    ctx = prompt + out[:1]  # the first token comes from the prompt's own pass
    i, t = 1, 0.0
    steps = spec = drafted = accepted = 0
    while i < len(out):
        drafter, k = policy.choose(ctx)
        k = max(0, min(k, len(out) - i - 1))
        tokens = drafter.propose(ctx, k, None, None).tokens if (drafter is not None and k > 0) else []
        n_acc = common_prefix(tokens, out[i:])
        cost = step_cost(curve, len(tokens) + 1)
        t_draft = _draft_cost(drafter, len(tokens)) * T1
        t += cost + t_draft
        policy.observe(drafter, k, len(tokens), n_acc, (t_draft or 1e-6) if tokens else None, cost)
        if drafter is not None and tokens:
            drafter.accept(len(tokens), n_acc)
            spec += 1
            drafted += len(tokens)
            accepted += n_acc
        new = out[i:i + n_acc + 1]
        ctx += new
        i += len(new)
        steps += 1
    return {"rate": (len(out) - 1) / t if t else 0.0, "steps": steps, "spec_steps": spec, "drafted": drafted,
            "accepted": accepted, "switched": getattr(policy, "switched", None)}


class NativeLookupModel(NgramCacheDrafter):
    """What native `llama-lookup` drafts (llama.cpp's common/ngram-cache.cpp; no static cache, -lcs): the n-gram cache
    drafter (drafters/ngram_cache.py, the context's own counts), and where those pass at no length, `dynamic` (-lcd:
    the counts of earlier runs' prompts and answers, merged) asked with stricter bounds (2, 2, 3, 4 occurrences; 66,
    66, 66, 75%). Checked against the native binary's own counts (benchmarks/data/native_lookup_traces.json)."""

    name = "native-lookup"
    STRICT = {4: (2, 66), 3: (2, 66), 2: (3, 66), 1: (4, 75)}  # n -> (occurrences, percent) for the dynamic cache's

    def __init__(self, dynamic: dict | None = None) -> None:
        super().__init__()
        self.dynamic = dynamic or {}

    def next_token(self, seq: Sequence[int]) -> tuple[int | None, int]:
        tok, n = super().next_token(seq)
        return (tok, n) if tok is not None else draft_next(self.dynamic, self.STRICT, seq)


def _draft_cost(drafter, n: int) -> float:
    """Target steps spent drafting the last proposal of n tokens: a chain pays for its model's tokens only."""
    model = getattr(drafter, "model", None)
    if model is not None:
        return drafter.n_model * getattr(model, "draft_cost", 0.0)
    return n * getattr(drafter, "draft_cost", 0.0)


def plain() -> Callable[[], Policy]:
    return lambda: FixedPolicy(None, 0)


def lookup(k: int) -> Callable[[], Policy]:
    return lambda: FixedPolicy(PromptLookupDrafter(), k)


def native_lookup(k: int, dynamic: dict | None = None) -> Callable[[], Policy]:
    """Native `llama-lookup` with --spec-draft-n-max k (NativeLookupModel), with `dynamic` its -lcd cache's counts."""
    return lambda: FixedPolicy(NativeLookupModel(dynamic), k)


def auto(curve: dict[int, float], k_max: int = 4, bit_cap: int | None = 2) -> Callable[[], Policy]:
    """`auto` with the model-free drafters of a first request as `localspec run` builds it: prompt lookup and the
    n-gram cache (the draft model left out: it never pays on a CPU)."""
    return lambda: AdaptivePolicy(model_free(), k_max, {}, None, dict(curve), bit_cap=bit_cap)


def model_free() -> dict[str, Drafter]:
    """The drafters `auto` has on the request's own text, whatever else is loaded."""
    return {"lookup": PromptLookupDrafter(), "ngram": NgramCacheDrafter()}


def auto_cached(curve: dict[int, float], docs: Sequence[Doc], k_max: int = 4,
                bit_cap: int | None = 2) -> Callable[[], Policy]:
    """`auto` as `localspec run` builds it with the suffix cache: prompt lookup and the suffix drafter over `docs`
    (earlier requests' prompts and answers)."""
    return lambda: AdaptivePolicy(cached_drafters(docs), k_max, {}, None, dict(curve), bit_cap=bit_cap)


def cached_drafters(docs: Sequence[Doc]) -> dict[str, Drafter]:
    """The model-free drafters and the suffix cache over `docs`, as `auto` has them with earlier requests cached."""
    return {**model_free(), "suffix": SuffixDrafter(SuffixCorpus(SUFFIX_CACHE_TOKENS, list(docs)), beside_lookup=True)}


def series(traces: Sequence[dict], curve: dict[int, float], n: int | None = None) -> dict[str, dict[str, list]]:
    """The traces sent in order by one user: each answer (prompt and output) is cached for the ones after it, by
    `auto`'s suffix cache and by native lookup's -lcd file. Per config ("plain", "lookup k=3", "native lookup k=3",
    "native lookup k=3 -lcd", "auto, no cache", "auto", and "best possible" with auto's drafters) and trace id: [tokens
    timed, seconds]."""
    dynamic: dict[tuple, dict[int, int]] = {}  # the -lcd file: every earlier run's counts, merged
    configs = {"plain": lambda docs: plain(), "lookup k=3": lambda docs: lookup(3),
               "native lookup k=3": lambda docs: native_lookup(3),
               "native lookup k=3 -lcd": lambda docs: native_lookup(3, dynamic),
               "auto, no cache": lambda docs: auto(curve, 4, 2), "auto": lambda docs: auto_cached(curve, docs)}
    out: dict[str, dict[str, list]] = {name: {} for name in configs}
    docs: list[Doc] = []
    for i, tr in enumerate(traces):
        timed = len(tr["output"][:n]) - 1
        for name, make in configs.items():
            r = replay(tr, make(docs), curve, n)
            out[name][tr["id"]] = [timed, timed / r["rate"] if r["rate"] else 0.0]
        best = best_possible(tr, cached_drafters(docs), curve, n=n)
        out.setdefault("best possible", {})[tr["id"]] = [timed, timed / best if best else 0.0]
        seen = [int(t) for t in tr["prompt"] + tr["output"][:n]]
        docs.append(Doc(f"series-{i}", float(i), seen))
        ran: list[int] = []
        for t in seen:
            count_next(dynamic, ran, t)
    return out


def best_possible(trace: dict, drafters: dict[str, Drafter], curve: dict[int, float], k_max: int = 4,
                  n: int | None = None, forced: dict[int, tuple[str | None, int]] | None = None) -> float:
    """Tokens/s no controller choosing among `drafters` can beat on `trace` (simulated, as replay()): every step it
    drafts exactly the part of some drafter's proposal the target then accepts (it knows the answer), up to k_max
    tokens (repeat_k(k_max) for an offer that repeats earlier text, as `auto` allows), or takes a plain step.
    `forced`: answer position -> (drafter name, k) for steps whose choice is fixed (None or k = 0: a plain step);
    such a step drafts that drafter's k-token proposal and keeps what the target accepts of it."""
    prompt = [int(t) for t in trace["prompt"]]
    out = [int(t) for t in trace["output"]][:n]
    forced = forced or {}
    for d in drafters.values():
        d.begin(prompt)
    reach: list[int] = [0] * len(out)  # the longest accepted draft any drafter offers at each position
    fixed: dict[int, tuple[int, int]] = {}  # forced position -> (k drafted, accepted)
    for i in range(1, len(out)):
        ctx, want, left = prompt + out[:i], forced.get(i), len(out) - i - 1
        for name, d in drafters.items():
            if want:  # only the forced drafter drafts here, its k whatever it offers
                k = want[1] if want[0] == name else 0
            else:
                offer = d.offer(ctx, repeat_k(k_max))
                k = 0 if offer is None else (offer.k if offer.repeat else min(offer.k, k_max))
            k = min(k, left)
            if k <= 0:
                continue
            tokens = d.propose(ctx, k, None, None).tokens
            a = common_prefix(tokens, out[i:])
            if want:
                fixed[i] = (len(tokens), a)
            else:
                reach[i] = max(reach[i], a)
    best = [0.0] * (len(out) + 1)  # seconds from each position to the end, at best
    for i in range(len(out) - 1, 0, -1):
        if i in forced:
            k, a = fixed.get(i, (0, 0))
            best[i] = step_cost(curve, k + 1) + best[i + a + 1]
            continue
        best[i] = min(step_cost(curve, a + 1) + best[i + a + 1] for a in range(reach[i] + 1))
    return (len(out) - 1) / best[1] if len(out) > 1 else 0.0


def _with_trace(make: Callable[[dict], Policy]) -> Callable[[dict], Policy]:
    make.wants_trace = True  # replay() hands it the trace whose recorded proposals it drafts from
    return make


def recorded(trace: dict, name: str, draft_cost: float | None = None) -> RecordedDrafter:
    cost = trace.get("draft_cost", 0.0) if draft_cost is None else draft_cost
    return RecordedDrafter(name, len(trace["prompt"]), trace["proposals"][name], float(cost))


def fixed_recorded(name: str, k: int, draft_cost: float | None = None) -> Callable[[dict], Policy]:
    return _with_trace(lambda tr: FixedPolicy(recorded(tr, name, draft_cost), k))


def auto_recorded(name: str, curve: dict[int, float], k_max: int = 4, bit_cap: int | None = 2,
                  draft_cost: float | None = None, chain: bool = True) -> Callable[[dict], Policy]:
    """`auto` choosing each step among prompt lookup, the recorded drafter `name` and, with `chain`, that drafter's
    proposals extended by the request's own text (drafters/chain.py; the suffix cache of a first request)."""
    def make(tr: dict) -> Policy:
        drafters = {**model_free(), name: recorded(tr, name, draft_cost)}
        if chain:
            drafters = chained({**drafters, "suffix": SuffixDrafter(None, beside_lookup=True)})
        return AdaptivePolicy(drafters, k_max, {}, None, dict(curve), bit_cap=bit_cap)

    return _with_trace(make)


def recorded_sources(traces: Sequence[dict]) -> list[str]:
    """The drafters whose proposals every trace holds."""
    names = [set(tr.get("proposals") or {}) for tr in traces]
    return sorted(set.intersection(*names)) if names else []


def alpha(traces: Sequence[dict], name: str, n: int | None = None) -> float:
    """The acceptance per drafted token of the recorded drafter `name` as Leviathan et al. model it (each token
    accepted with the same probability, given the ones before it were): accepted / (accepted + rejections) over its
    proposal at every position, where a proposal that is not accepted whole ends in one rejection."""
    acc = rej = 0
    for tr in traces:
        out = [int(t) for t in tr["output"]][:n]
        for i, prop in enumerate(tr["proposals"][name][:len(out) - 1], 1):
            prop = prop[:len(out) - i]
            a = common_prefix(prop, out[i:])
            acc, rej = acc + a, rej + (a < len(prop))
    return acc / (acc + rej) if acc + rej else 0.0


def leviathan(a: float, k: int, curve: dict[int, float], draft_cost: float) -> float:
    """Expected speedup over plain decoding with k drafted tokens of acceptance `a` each (Leviathan et al. 2023,
    Theorem 3.8, with the verify of k + 1 rows costing T(k + 1)/T(1) from the curve)."""
    tokens = float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * draft_cost + step_cost(curve, k + 1) / T1)


def table(traces: Sequence[dict], curve: dict[int, float], n: int | None = None,
          draft_cost: float | None = None) -> dict[str, dict[str, float]]:
    """Speedup over plain per config and trace id, and the most any controller with the model-free drafters could reach
    (best_possible)."""
    configs = {"plain": plain(), **{f"lookup k={k}": lookup(k) for k in (1, 2, 3, 4, 8)},
               "native lookup k=3": native_lookup(3),
               "auto (bit cap 2)": auto(curve, 4, 2), "auto (lossless)": auto(curve, 4, None)}
    for name in recorded_sources(traces):
        longest = max((len(p) for tr in traces for p in tr["proposals"][name]), default=0)
        configs.update({f"{name} k={k}": fixed_recorded(name, k, draft_cost) for k in (1, 2, 3, 4, 8) if k <= longest})
        configs[f"auto+{name} (lossless)"] = auto_recorded(name, curve, min(max(longest, 1), 8), None, draft_cost)
    base = {tr["id"]: replay(tr, plain(), curve, n)["rate"] for tr in traces}
    rows = {name: {tr["id"]: replay(tr, mk, curve, n)["rate"] / base[tr["id"]] for tr in traces}
            for name, mk in configs.items()}
    rows["best possible (model-free)"] = {tr["id"]: best_possible(tr, model_free(), curve, n=n) / base[tr["id"]]
                                          for tr in traces}
    return rows


def record(engine, prompts: Sequence[dict], max_tokens: int = 160, drafter: str | None = None, k: int = 8,
           p_min: float | None = None) -> list[dict]:
    """Greedy answers of the engine's target to each {"id", "prompt"} (chat-rendered), for replay(). `drafter`: the
    name of one of the engine's drafters (e.g. "draft", the draft model, through text when its vocabulary differs):
    each trace also holds its proposal of up to k tokens after prompt + output[:i + 1] for every i, made with the
    drafter's p_min (None: the default), its draft_kind and its draft_cost (the draft's size over the target's)."""
    import numpy as np

    from localspec.core.engine import GenConfig
    from localspec.sample.sampling import SamplingParams

    out = []
    for p in prompts:
        toks = engine.chat_prompt([{"role": "user", "content": p["prompt"]}])
        fin = engine.complete(toks, GenConfig(method="none", max_tokens=max_tokens))
        trace = {"id": p["id"], "prompt": toks, "output": fin.tokens}
        if drafter is not None:
            cfg = GenConfig(method=drafter, k=k, **({} if p_min is None else {"p_min": p_min}))
            d = engine.drafters_for(cfg, drafter)[drafter]
            d.begin(toks)
            sp, rng = SamplingParams(), np.random.default_rng(0)
            trace["proposals"] = {drafter: [d.propose(toks + fin.tokens[:i], k, sp, rng).tokens
                                            for i in range(1, len(fin.tokens))]}
            trace["draft_kind"] = engine.draft_kind if drafter == "draft" else None
            if drafter == "draft":
                trace["draft_cost"] = engine.draft.size_bytes() / max(engine.target.size_bytes(), 1)
        out.append(trace)
    return out


MAX_BYTES = 64 << 20  # a trace file is read up to this: a device or an endless stream is refused, not exhausted


class TraceError(Exception):
    """A trace file or argument that cannot be replayed: one line for the user."""


def _tokens(v, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise TraceError(f"{what} must be a list of token ids (whole numbers >= 0)")
    return v


def load(path) -> list[dict]:
    """The traces in `path` (a JSON list of traces, or {"traces": [...]}), each checked: a string or number "id"
    (unique), a "prompt" and an "output" of token ids, the output at least 2 tokens (the first comes from the
    prompt's own pass; replay times the rest)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except IsADirectoryError:
        raise TraceError(f"{path} is a folder, not a trace file") from None
    except FileNotFoundError:
        raise TraceError(f"no such file: {path}") from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_BYTES:
        raise TraceError(f"{path} is too large for a trace file (more than {MAX_BYTES >> 20} MiB)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise TraceError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path} is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise TraceError(f"{path} is not valid JSON here: it is nested too deep") from None
    traces = data.get("traces") if isinstance(data, dict) else data
    if not isinstance(traces, list):
        raise TraceError(f"{path} must hold a list of traces (or {{\"traces\": [...]}})")
    if not traces:
        raise TraceError(f"{path} holds no traces")
    seen = set()
    for i, tr in enumerate(traces, 1):
        where = f"{path}: trace {i}"
        if not isinstance(tr, dict):
            raise TraceError(f"{where} must be an object with id, prompt and output")
        if not isinstance(tr.get("id"), (str, int)) or isinstance(tr.get("id"), bool):
            raise TraceError(f"{where}: id must be a string or a number")
        if str(tr["id"]) in seen:
            raise TraceError(f"{where}: id {tr['id']!r} is used twice")
        seen.add(str(tr["id"]))
        _tokens(tr.get("prompt"), f"{where}: prompt")
        if len(_tokens(tr.get("output"), f"{where}: output")) < 2:
            raise TraceError(f"{where}: output needs at least 2 tokens")
        _proposals(tr, where)
    return [{**tr, "id": str(tr["id"])} for tr in traces]


def _proposals(tr: dict, where: str) -> None:
    """A trace's recorded proposals, if any: {name: one list of token ids per position after the first token}."""
    props = tr.get("proposals")
    if props is None:
        return
    if not isinstance(props, dict):
        raise TraceError(f"{where}: proposals must be an object of drafter name -> proposals")
    for name, at in props.items():
        if not isinstance(at, list) or len(at) != len(tr["output"]) - 1:
            raise TraceError(f"{where}: proposals[{name!r}] must hold one proposal per output token after the first "
                             f"({len(tr['output']) - 1})")
        for i, prop in enumerate(at):
            _tokens(prop, f"{where}: proposals[{name!r}][{i}]")
    cost = tr.get("draft_cost", 0.0)
    if not isinstance(cost, (int, float)) or isinstance(cost, bool) or not 0 <= cost < math.inf:
        raise TraceError(f"{where}: draft_cost must be a number >= 0")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage block becomes the one error line every front end prints
        raise TraceError(f"{message} (see --help)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = _Parser(prog="python -m localspec.bench.replay", description=__doc__.splitlines()[0])
    ap.add_argument("traces")
    ap.add_argument("--tokens", type=int, default=None, help="replay at most N tokens of each answer (N >= 2)")
    ap.add_argument("--curve", choices=sorted(CURVES), default="avx2")
    ap.add_argument("--draft-cost", type=float, default=None,
                    help="target steps per token a recorded draft model drafts (default: the trace's draft_cost)")
    ap.add_argument("--series", action="store_true",
                    help="the traces as one user's requests in order, each answer cached for the ones after it")
    try:
        a = ap.parse_args(argv)
        if a.tokens is not None and a.tokens < 2:
            raise TraceError(f"--tokens must be at least 2 (the first token is not timed), got {a.tokens}")
        if a.draft_cost is not None and not 0 <= a.draft_cost < math.inf:
            raise TraceError(f"--draft-cost must be a number >= 0, got {a.draft_cost}")
        traces = load(a.traces)
    except TraceError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    curve = CURVES[a.curve]
    ids = [tr["id"] for tr in traces]
    if a.series:
        return _print_series(series(traces, curve, a.tokens), ids)
    rows = table(traces, curve, a.tokens, a.draft_cost)
    width = max(18, *(len(name) + 1 for name in rows))
    try:
        print(f"{'':{width}}" + "".join(f"{i[:10]:>11}" for i in ids) + "    geomean")
        for name, r in rows.items():
            g = math.exp(sum(math.log(r[i]) for i in ids) / len(ids))
            print(f"{name:{width}}" + "".join(f"{r[i]:11.3f}" for i in ids) + f"{g:11.3f}")
        for name in recorded_sources(traces):
            al = alpha(traces, name, a.tokens)
            c = a.draft_cost if a.draft_cost is not None else traces[0].get("draft_cost", 0.0)
            bound = {k: leviathan(al, k, curve, c) for k in (1, 2, 3, 4, 8)}
            best = max(bound, key=bound.get)
            print(f"{name}: acceptance per drafted token {al:.3f}; Leviathan bound at draft cost {c:.3f}: "
                  + ", ".join(f"k={k} {v:.3f}" for k, v in bound.items()) + f" (best k={best})")
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader stopped reading, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _print_series(runs: dict[str, dict[str, list]], ids: list[str]) -> int:
    """Speedup over plain per trace, per group (ids N-GROUP) and over the whole series: tokens over seconds."""
    groups: dict[str, list[str]] = {}
    for i in ids:
        head, _, group = i.partition("-")
        if head.isdigit() and group:
            groups.setdefault(group, []).append(i)
    groups["all"] = ids

    def rate(name: str, members: list[str]) -> float:
        tokens = sum(runs[name][i][0] for i in members)
        secs = sum(runs[name][i][1] for i in members)
        return tokens / secs if secs else 0.0

    width = max(16, *(len(name) + 1 for name in runs))
    try:
        print(f"{'':{width}}" + "".join(f"{i[:10]:>11}" for i in ids))
        for name in runs:
            print(f"{name:{width}}" + "".join(f"{rate(name, [i]) / rate('plain', [i]):11.3f}" for i in ids))
        print()
        print(f"{'':{width}}" + "".join(f"{g[:10]:>11}" for g in groups))
        for name in runs:
            print(f"{name:{width}}" + "".join(f"{rate(name, m) / rate('plain', m):11.3f}" for m in groups.values()))
        sys.stdout.flush()
    except BrokenPipeError:  # `| head`: the reader stopped reading, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
