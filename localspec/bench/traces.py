"""Trace files: the recorded answers the replay decodes again. A trace is {"id", "prompt": [...], "output": [...]}
(token ids: the chat-rendered prompt and the target's greedy answer); recorded with a drafter, it also keeps what that
drafter proposed at every position of the answer ("proposals": {name: [[...], ...]}), its "draft_kind" and its
"draft_cost" (the draft's size over the target's). A file holds a JSON list of traces, or {"traces": [...]}."""

from __future__ import annotations

import json
import math
from typing import Sequence

from localspec.errors import UsageError

MAX_BYTES = 64 << 20  # a trace file is read up to this: a device or an endless stream is refused, not exhausted


class TraceError(UsageError):
    """A trace file or argument that cannot be replayed: one line for the user."""


def record(engine, prompts: Sequence[dict], max_tokens: int = 160, drafter: str | None = None, k: int = 8,
           p_min: float | None = None) -> list[dict]:
    """Greedy answers of the engine's target to each {"id", "prompt"} (chat-rendered), for the replay. `drafter`: the
    name of one of the engine's drafters (e.g. "draft", the draft model, through text when its vocabulary differs):
    each trace also holds its proposal of up to k tokens after prompt + output[:i + 1] for every i, made with the
    drafter's p_min (None: the default), its draft_kind and its draft_cost (the draft's size over the target's)."""
    import numpy as np

    from localspec.core.config import GenConfig
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


def load(path) -> list[dict]:
    """The traces in `path`, each checked: a string or number "id" (unique), a "prompt" and an "output" of token ids,
    the output at least 2 tokens (the first comes from the prompt's own pass; the replay times the rest)."""
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


def _tokens(v, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise TraceError(f"{what} must be a list of token ids (whole numbers >= 0)")
    return v


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
