"""What the chat says about an answer's speed: the line under an answer, /compare's verdict and the record the
history keeps. Separate functions in one module, so that a shared report module can take them over."""

from __future__ import annotations

from localspec.tui.widgets.stats_panel import rate_text


def answer_note(st, show_timings: bool = True) -> str:
    """The line under an answer, in plain words; a rate over too small a sample is a dash."""
    parts = [f"{st.completion_tokens} tokens"]
    if show_timings:
        parts.append(f"{rate_text(st.rate())} tokens/s")
    parts.append(f"{st.acceptance_rate:.0%} of drafts accepted" if st.drafted else "nothing drafted")
    return " · ".join(parts)


def compare_note(plain, base, temperature: float, show_timings: bool = True) -> str:
    """/compare's verdict: `plain` is the rerun with plain decoding, `base` the answer it is compared with. A
    speed-up is reported only when `base` speculated; above temperature 0 the outputs are not compared."""
    p, b = plain.stats.rate(), base.stats.rate()
    if base.stats.drafted == 0:
        return ("compare: the earlier answer did not speculate (nothing was drafted), so there is no speed-up to "
                "measure" + (f" · plain decoding: {rate_text(p)} tokens/s" if show_timings else ""))
    speeds = f"plain {rate_text(p)} tokens/s vs {base.stats.main_method} {rate_text(b)} tokens/s"
    ratio = f" → {b / p:.2f}x" if (p and b) else " → speed-up — (too short to measure)"
    if temperature > 0:
        head = f"compare: at temperature {temperature:g} the outputs differ by sampling, so only the speed is compared"
        return head + (f" · {speeds}{ratio}" if show_timings else "")
    same = "identical" if plain.tokens == base.tokens else "different"
    if not show_timings:
        return f"compare: output {same}"
    return f"compare: {speeds}{ratio} · output {same}"


def stats_record(st) -> dict:
    """What the history keeps about an answer's speed."""
    return {"tokens": st.completion_tokens, "tokens_per_second": st.rate(), "method": st.method,
            "drafted": st.drafted, "accepted": st.accepted, "cached_prompt_tokens": st.cached_prompt_tokens}
