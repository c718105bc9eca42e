"""What the replay reports: fixed settings and `auto` side by side on recorded answers (`table`), the answers as one
user's requests in order (`series`), the most any controller could reach (`best_possible`), and a recorded draft
model's acceptance with Leviathan's bound per k (`alpha`, `leviathan`).

--series replays the traces as one user's requests in order: each answer enters the suffix cache of the ones after it
(a script run again, an agent repeating itself), and `auto` drafts from that cache beside prompt lookup, as native
lookup with -lcd drafts from the counts of the runs before; an id of the form N-GROUP is also totalled per GROUP
(benchmarks/repeated_work.py records such a series).

best_possible() is the most any controller with the same drafters could reach on a trace, knowing the answer: the last
row of both tables, and what `auto` pays to learn a request is its distance under it.
"""

from __future__ import annotations

from typing import Sequence

from localspec.bench.configs import (auto, auto_cached, auto_recorded, cached_drafters, fixed_recorded, lookup,
                                     model_free, native_lookup, plain, recorded_sources)
from localspec.bench.simulate import T1, replay, step_cost
from localspec.core.policy import repeat_k
from localspec.drafters.base import Drafter
from localspec.drafters.ngram_cache import count_next
from localspec.drafters.suffix_corpus import Doc
from localspec.seq import common_prefix


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
    rows = {name: {tr["id"]: replay(tr, setup, curve, n)["rate"] / base[tr["id"]] for tr in traces}
            for name, setup in configs.items()}
    rows["best possible (model-free)"] = {tr["id"]: best_possible(tr, model_free(), curve, n=n) / base[tr["id"]]
                                          for tr in traces}
    return rows


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
