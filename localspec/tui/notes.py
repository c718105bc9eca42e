"""What the chat says about an answer's speed: the line under an answer and the record the history keeps come
from the shared report of a generation (core/report.py); /compare's verdict is the chat's own."""

from __future__ import annotations

from localspec.core.report import answer_note, rate_text  # noqa: F401 - the line under an answer
from localspec.core.report import history_record as stats_record  # noqa: F401 - what the history keeps


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
