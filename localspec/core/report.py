"""Every rendering of one generation's `Stats`, in one module: the JSON of `run --json`, the server's `usage` and
`localspec` objects, the history record, bench's per-run figures, the end-of-run lines and the live rate text.

They all start from `figures()`, so a quantity has one name and one value wherever it appears. A few older names
stay beside the shared ones, because clients and stored chats already read them: the server's `k` and
`requested_k` (= `k_in_use`, `k_requested`), run's `draft_tokens` (= `k_requested`) and the history's `tokens`
(= `completion_tokens`).
"""

from __future__ import annotations

from localspec.core.stats import Stats

EXACTNESS_WORDS = {"bit": "bit-exact", "lossless": "lossless"}


def figures(stats: Stats) -> dict:
    """The measured figures of one generation under their one name each."""
    return {
        "method": stats.main_method,  # what produced the tokens: the most used drafter, none when nothing drafted
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "prompt_cache": stats.prompt_cache,  # memory | disk | "": where the cached prompt tokens came from
        "completion_tokens": stats.completion_tokens,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_pass": stats.tokens_per_pass,
        "target_passes": stats.target_passes,
        "drafting_steps": stats.drafting_steps,
        "mean_accepted_length": stats.mean_accepted_length,
        "acceptance_by_position": stats.acceptance_by_position,
        "ttft_s": stats.ttft_s,
        "tokens_per_second": stats.measured_rate(),  # None only for a one-token answer (the display's floor is apart)
        "elapsed_s": stats.elapsed_s,
        "draft_s": stats.draft_s,
        "verify_s": stats.verify_s,
        "steps_by_method": dict(stats.method_used),
        "sources": sources(stats),
        "steps_by_k": {str(k): v for k, v in sorted(stats.k_used.items())},
        "k_in_use": stats.k_cap,
        "exactness": stats.exactness,
        "exactness_reason": stats.exactness_reason,
        "controller": stats.reason or None,
        "rpc_workers": list(stats.rpc_workers),
        # how rejected drafts were undone: kv (cache rows dropped), rs (a recurrent-state plane picked), checkpoint
        # (recurrent state restored, accepted tokens decoded again) or none (plain decoding)
        "rollback": stats.rollback,
        "restores": stats.restores,
        "replayed_tokens": stats.replayed_tokens,
        "rs_rollbacks": stats.rs_rollbacks,
        "checkpoint_bytes": stats.checkpoint_bytes,
        "rollback_s": stats.rollback_s,
        "draft_rollback": stats.draft_rollback or None,
        "draft_restores": stats.draft_restores,
        "draft_replayed_tokens": stats.draft_replayed_tokens,
    }


def sources(stats: Stats) -> dict:
    """Per drafting source (lookup, suffix, draft, a head): its drafting steps, tokens drafted and accepted, and
    their acceptance."""
    return {m: {"steps": n, "drafted": d, "accepted": a, "acceptance": round(a / d, 4) if d else None}
            for m, (n, d, a) in stats.by_source().items()}


def rollback_text(stats: Stats) -> str | None:
    """How rejected drafts were undone, in words, for a recurrent or hybrid model (None for an ordinary one)."""
    if stats.rollback in ("kv", ""):
        return None
    if stats.rollback == "rs":
        return f"rollback: state planes ({stats.rs_rollbacks} rollbacks, {stats.restores} restores)"
    if stats.rollback == "checkpoint":
        return f"rollback: checkpoint ({stats.restores} restores, {stats.replayed_tokens} tokens replayed)"
    return f"rollback: {stats.rollback}"


def requested(cfg) -> dict:
    """What was asked for (a GenConfig), beside what ran."""
    return {"requested_method": cfg.method, "k_requested": cfg.k}


def run_json(fin, stats: Stats | None, engine, cfg, interrupted: bool = False, text: str = "") -> dict:
    """`localspec run --json`: the answer, how it ended, the figures and the models."""
    stats = stats if stats is not None else Stats()  # interrupted before the first step
    finish = "interrupted" if interrupted else (fin.finish_reason if fin is not None else "error")
    return {
        "text": fin.text if fin is not None else text,
        "finish_reason": finish,
        **figures(stats),
        **requested(cfg),
        "draft_tokens": cfg.k,
        "target": engine.target.name,
        "draft": engine.draft.name if engine.draft is not None else None,
        "draft_dropped": engine.dropped_draft,
        # how the draft drafts: same-vocab, cross-vocab (through text), head; None without a draft
        "draft_kind": getattr(engine, "draft_kind", None),
        # the draft head that drafted (EAGLE-3, MTP, DFlash, DSpark: a DSpark file runs as --method dflash)
        "draft_head": head_title(engine, stats),
    }


def head_title(engine, stats: Stats) -> str | None:
    """The name of the draft head this run drafted with, or None (no head drafted)."""
    heads = getattr(engine, "heads", None) or {}
    used = [m for m, n in stats.method_used.items() if n and m in heads]
    return ", ".join(getattr(heads[m], "title", m) for m in used) or None


def openai_usage(stats: Stats) -> dict:
    """The OpenAI `usage` object."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


SERVER_FIELDS = ("tokens_per_second", "acceptance_rate", "tokens_per_pass", "mean_accepted_length", "method",
                 "drafted", "accepted", "target_passes", "ttft_s", "elapsed_s", "steps_by_method", "k_in_use",
                 "acceptance_by_position", "exactness", "exactness_reason", "rollback", "restores", "replayed_tokens",
                 "sources", "prompt_cache")


def server_object(stats: Stats, cfg) -> dict:
    """The `localspec` object the server adds to a response: the speculation figures of that request."""
    f = figures(stats)
    d = {key: f[key] for key in SERVER_FIELDS}
    d.update(requested(cfg), k=stats.k_cap, requested_k=cfg.k)
    if f["controller"]:
        d["controller"] = f["controller"]
    return d


HISTORY_FIELDS = ("completion_tokens", "tokens_per_second", "method", "drafted", "accepted", "cached_prompt_tokens",
                  "acceptance_rate", "exactness")


def history_record(stats: Stats) -> dict:
    """What the chat history keeps about an answer's speed."""
    f = figures(stats)
    d = {key: f[key] for key in HISTORY_FIELDS}
    d["tokens"] = stats.completion_tokens
    return d


BENCH_FIELDS = ("tokens_per_second", "ttft_s", "completion_tokens", "drafted", "accepted", "acceptance_rate",
                "mean_accepted_length", "draft_s", "verify_s", "target_passes", "exactness", "drafting_steps",
                "elapsed_s", "k_in_use", "rollback", "replayed_tokens")


def bench_figures(stats: Stats) -> dict:
    """One bench run's figures (bench adds its configuration, the baseline comparison and the audit)."""
    f = figures(stats)
    d = {key: f[key] for key in BENCH_FIELDS}
    d["tokens_per_second"] = stats.tokens_per_second  # bench divides by it: 0.0, never None
    d["draft_model_steps"] = stats.method_used.get("draft", 0)
    return d


# ------------------------------------------------------------------ text
def rate_text(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.1f}"


def live_line(stats: Stats) -> str:
    """The figures shown while an answer streams: live tokens/s over the answer so far."""
    return (f"{rate_text(stats.rate()):>6} tok/s  accept {stats.acceptance_rate:4.0%}  "
            f"{stats.tokens_per_pass:4.2f} tok/pass  {stats.completion_tokens} tok")


def short_summary(stats: Stats, finish: str) -> str:
    """The default end-of-run line, e.g. `128 tokens · 27.9 tok/s · 1.3x vs plain est. · 64% accepted`."""
    parts = [f"{stats.completion_tokens} tokens", f"{rate_text(stats.rate())} tok/s"]
    est = stats.speedup_estimate()
    if est is not None:
        parts.append(f"{est:.1f}x vs plain est.")
    parts.append(f"{stats.acceptance_rate:.0%} accepted" if stats.drafted else "no drafts")
    if finish not in ("stop", "length"):
        parts.append(finish)
    if stats.rpc_workers:
        parts.append(f"rpc workers: {', '.join(stats.rpc_workers)}")
    if stats.drafted and stats.exactness:
        parts.append(EXACTNESS_WORDS.get(stats.exactness, stats.exactness))
    rb = rollback_text(stats)
    if rb and stats.drafted:
        parts.append(rb)
    return " · ".join(parts)


def summary_line(stats: Stats, finish: str) -> str:
    """The long end-of-run line (`run -v`)."""
    used = ", ".join(f"{m} {n}" for m, n in stats.method_used.most_common()) or "-"
    mal = f"{stats.mean_accepted_length:.2f}" if stats.drafting_steps else "—"
    return (
        f"{stats.completion_tokens} tokens in {stats.elapsed_s:.2f}s | {rate_text(stats.rate())} tok/s | "
        f"ttft {stats.ttft_s:.2f}s | accepted {stats.accepted}/{stats.drafted} ({stats.acceptance_rate:.0%}) | "
        f"{stats.tokens_per_pass:.2f} tokens per target pass | mean accepted length {mal} | steps: {used} | {finish}"
        + (f" | {stats.reason}" if stats.reason else "")
        + (f" | rpc workers: {', '.join(stats.rpc_workers)}" if stats.rpc_workers else "")
        + (f" | {rollback_text(stats)}" if rollback_text(stats) else "")
        + f" | {stats.exactness_reason or stats.exactness}"
    )


def answer_note(stats: Stats, show_timings: bool = True) -> str:
    """The line under an answer in the chat, in plain words; a rate over too small a sample is a dash."""
    parts = [f"{stats.completion_tokens} tokens"]
    if show_timings:
        parts.append(f"{rate_text(stats.rate())} tokens/s")
    parts.append(f"{stats.acceptance_rate:.0%} of drafts accepted" if stats.drafted else "nothing drafted")
    return " · ".join(parts)
