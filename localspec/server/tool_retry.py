"""An answer under tool_choice auto that is nothing but echoes of calls answered in this turn (tool_calls.echoed)
says nothing the client can use: the turn is generated once more as under tool_choice none, and that answer is the
request's (`Retry`), with the figures of both generations (`retried`).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from itertools import zip_longest

from localspec.core.generation import Finished
from localspec.server.tool_calls import echoed

RETRIED = "the answer repeated a call already answered in this turn; answered again without tool calls"
# the figures of a generation that add up over two (usage, the speculation counts, the times)
_SUMMED = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens", "drafted", "accepted", "target_passes",
           "drafting_steps", "plain_s", "prompt_s", "draft_s", "verify_s", "elapsed_s", "restores", "replayed_tokens",
           "rs_rollbacks", "rollback_s", "draft_restores", "draft_replayed_tokens")


class Again:
    """The event between the two generations of a retried answer (`Retry`): a ToolStream drops what it held."""


def retried(first: Finished, second: Finished) -> Finished:
    """The answer of a retried request: the second generation's, with the figures of both (usage counts both
    prompts and both answers; the first token came after the whole first generation) and `retried`, the note
    the `localspec` object carries."""
    a, b = first.stats, second.stats
    stats = dataclasses.replace(
        b, **{k: getattr(a, k) + getattr(b, k) for k in _SUMMED}, ttft_s=a.elapsed_s + b.ttft_s,
        **{k: Counter(getattr(a, k)) + Counter(getattr(b, k))
           for k in ("k_used", "method_used", "drafted_by", "accepted_by")},
        **{k: [x + y for x, y in zip_longest(getattr(a, k), getattr(b, k), fillvalue=0)]
           for k in ("drafted_at", "accepted_at")})
    stats.retried = RETRIED
    return Finished(second.text, second.tokens, second.finish_reason, stats)


class Retry:
    """A generation's events, read as a server/queue.py Job's (`events.get()`, `cancel`, `n_prompt`, `checked`),
    for an answer under tool_choice auto: when it is nothing but echoes of calls answered in this turn (`echoed`),
    `again()` (a coroutine: the turn as under tool_choice none, its job submitted; None when it cannot start, and
    the echo stands as content) starts a second generation, whose events follow an `Again`, its Finished
    `retried`. Nothing of the echo was sent: a ToolStream holds a call from its start to the end."""

    def __init__(self, job, names, again) -> None:
        self.job, self.names, self.again, self.first = job, names, again, None
        self.events, self.n_prompt, self.checked = self, job.n_prompt, job.checked

    @property
    def cancel(self):
        return self.job.cancel

    async def get(self):
        ev = await self.job.events.get()
        if isinstance(ev, Finished):
            if self.first is not None:
                return retried(self.first, ev)
            if ev.finish_reason != "cancelled" and echoed(ev.text, self.names):
                job = await self.again()
                if job is not None:
                    self.first, self.job = ev, job
                    return Again()
        return ev
