"""`localspec replay`: the speculation controller replayed on recorded answers (bench/replay.py), as tables of
speedups over plain decoding."""

from __future__ import annotations

import math
from typing import Annotated, Optional

import typer

from localspec.errors import UsageError

EPILOG = ("Traces: a JSON list of {id, prompt, output} (token ids), recorded with "
          "localspec.bench.replay.record(engine, prompts); benchmarks/data holds recorded ones. "
          "docs/bench.md, \"The replay\", says what each row is.")


def replay(
    traces: Annotated[str, typer.Argument(help="The trace file (JSON).", metavar="TRACES", show_default=False)],
    tokens: Annotated[Optional[int], typer.Option("--tokens", help="Replay at most N tokens of each answer (N >= 2).", show_default=False)] = None,
    curve: Annotated[str, typer.Option("--curve", help="The verify curve: avx2, avx512, epyc, epyc-steep or flat.")] = "avx2",
    draft_cost: Annotated[Optional[float], typer.Option("--draft-cost", help="Target steps per token a recorded draft model drafts (default: the trace's draft_cost).", show_default=False)] = None,
    series: Annotated[bool, typer.Option("--series", help="The traces as one user's requests in order, each answer cached for the ones after it.")] = False,
):
    """Replay the speculation controller on recorded answers, without a model and without timing noise."""
    from localspec.bench import compare as C
    from localspec.bench.configs import recorded_sources
    from localspec.bench.simulate import CURVES
    from localspec.bench.traces import load

    if curve not in CURVES:
        raise UsageError(f"--curve must be one of {', '.join(sorted(CURVES))}, got {curve!r}")
    if tokens is not None and tokens < 2:
        raise UsageError(f"--tokens must be at least 2 (the first token is not timed), got {tokens}")
    if draft_cost is not None and not 0 <= draft_cost < math.inf:
        raise UsageError(f"--draft-cost must be a number >= 0, got {draft_cost}")
    found = load(traces)
    steps = CURVES[curve]
    ids = [tr["id"] for tr in found]
    if series:
        print_series(C.series(found, steps, tokens), ids)
        return
    rows = C.table(found, steps, tokens, draft_cost)
    width = max(18, *(len(name) + 1 for name in rows))
    print(f"{'':{width}}" + "".join(f"{i[:10]:>11}" for i in ids) + "    geomean")
    for name, r in rows.items():
        g = math.exp(sum(math.log(r[i]) for i in ids) / len(ids))
        print(f"{name:{width}}" + "".join(f"{r[i]:11.3f}" for i in ids) + f"{g:11.3f}")
    for name in recorded_sources(found):
        al = C.alpha(found, name, tokens)
        c = draft_cost if draft_cost is not None else found[0].get("draft_cost", 0.0)
        bound = {k: C.leviathan(al, k, steps, c) for k in (1, 2, 3, 4, 8)}
        best = max(bound, key=bound.get)
        print(f"{name}: acceptance per drafted token {al:.3f}; Leviathan bound at draft cost {c:.3f}: "
              + ", ".join(f"k={k} {v:.3f}" for k, v in bound.items()) + f" (best k={best})")


def print_series(runs: dict[str, dict[str, list]], ids: list[str]) -> None:
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
    print(f"{'':{width}}" + "".join(f"{i[:10]:>11}" for i in ids))
    for name in runs:
        print(f"{name:{width}}" + "".join(f"{rate(name, [i]) / rate('plain', [i]):11.3f}" for i in ids))
    print()
    print(f"{'':{width}}" + "".join(f"{g[:10]:>11}" for g in groups))
    for name in runs:
        print(f"{name:{width}}" + "".join(f"{rate(name, m) / rate('plain', m):11.3f}" for m in groups.values()))
