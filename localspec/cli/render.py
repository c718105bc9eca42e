"""How an answer's figures are shown: the live status line, the end-of-run summaries and the `--json` object."""

from __future__ import annotations

import sys
import threading
import time


class Status:
    """Live status on a terminal's stderr, plus the final summary. When the answer streams to the same terminal,
    a status line would overwrite it: the figures then go to the terminal's title instead. A ticker refreshes the
    figures twice a second even while no token arrives."""

    INTERVAL = 0.5

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.live = not quiet and sys.stderr.isatty()
        self.in_title = self.live and sys.stdout.isatty()
        self._last = 0.0
        self._shown = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def info(self, msg: str) -> None:
        if not self.quiet:
            self.clear()
            sys.stderr.write(msg + "\n")
            sys.stderr.flush()

    def start(self, get_stats) -> None:
        if not self.live or self._ticker is not None:
            return
        self._stop.clear()

        def tick() -> None:
            while not self._stop.wait(self.INTERVAL):
                st = get_stats()
                if st is not None:
                    self.update(st, force=True)

        self._ticker = threading.Thread(target=tick, name="localspec-status", daemon=True)
        self._ticker.start()

    def stop(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=1.0)
            self._ticker = None
        self.clear()

    def update(self, stats, force: bool = False) -> None:
        if not self.live or stats is None:
            return
        with self._lock:
            now = time.perf_counter()
            if not force and now - self._last < 0.2:
                return
            self._last = now
            line = live_line(stats)
            if self.in_title:
                sys.stderr.write(f"\x1b]0;localspec {line}\x07")
            else:
                sys.stderr.write("\r\x1b[2K\x1b[2m" + line + "\x1b[0m")
            sys.stderr.flush()
            self._shown = True

    def clear(self) -> None:
        with self._lock:
            if self._shown:
                sys.stderr.write("\x1b]0;localspec\x07" if self.in_title else "\r\x1b[2K")
                sys.stderr.flush()
                self._shown = False


def rate_text(rate: float | None) -> str:
    return "—" if rate is None else f"{rate:.1f}"


def live_line(stats) -> str:
    """The figures shown while an answer streams: live tokens/s over the answer so far."""
    return (f"{rate_text(stats.rate()):>6} tok/s  accept {stats.acceptance_rate:4.0%}  "
            f"{stats.tokens_per_pass:4.2f} tok/pass  {stats.completion_tokens} tok")


def short_summary(stats, finish: str) -> str:
    """The default end-of-run line, e.g. `128 tokens · 27.9 tok/s · 1.3x vs plain est. · 64% accepted`."""
    parts = [f"{stats.completion_tokens} tokens", f"{rate_text(stats.rate())} tok/s"]
    est = stats.speedup_estimate()
    if est is not None:
        parts.append(f"{est:.1f}x vs plain est.")
    if stats.drafted:
        parts.append(f"{stats.acceptance_rate:.0%} accepted")
    else:
        parts.append("no drafts")
    if finish not in ("stop", "length"):
        parts.append(finish)
    if stats.rpc_workers:
        parts.append(f"rpc workers: {', '.join(stats.rpc_workers)}")
    if stats.drafted and stats.exactness:
        parts.append({"bit": "bit-exact", "lossless": "lossless"}.get(stats.exactness, stats.exactness))
    return " · ".join(parts)


def summary_line(stats, finish: str) -> str:
    used = ", ".join(f"{m} {n}" for m, n in stats.method_used.most_common()) or "-"
    mal = f"{stats.mean_accepted_length:.2f}" if stats.drafting_steps else "—"
    return (
        f"{stats.completion_tokens} tokens in {stats.elapsed_s:.2f}s | {rate_text(stats.rate())} tok/s | "
        f"ttft {stats.ttft_s:.2f}s | accepted {stats.accepted}/{stats.drafted} ({stats.acceptance_rate:.0%}) | "
        f"{stats.tokens_per_pass:.2f} tokens per target pass | mean accepted length {mal} | steps: {used} | {finish}"
        + (f" | {stats.reason}" if stats.reason else "")
        + (f" | rpc workers: {', '.join(stats.rpc_workers)}" if stats.rpc_workers else "")
        + f" | {stats.exactness_reason or stats.exactness}"
    )


def result_json(fin, stats, engine, gen_cfg, interrupted=False, text: str = "") -> dict:
    if stats is None:  # interrupted before the first step
        from localspec.core.stats import Stats

        stats = Stats()
    return {
        "text": fin.text if fin else text,
        "finish_reason": "interrupted" if interrupted else fin.finish_reason,
        "method": stats.main_method,
        "requested_method": gen_cfg.method,
        "draft_tokens": gen_cfg.k,
        "k_requested": gen_cfg.k,
        "k_in_use": stats.k_cap if stats is not None else None,
        "target": engine.target.name,
        "draft": engine.draft.name if engine.draft is not None else None,
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_pass": stats.tokens_per_pass,
        "drafting_steps": stats.drafting_steps,
        "mean_accepted_length": stats.mean_accepted_length,
        "acceptance_by_position": stats.acceptance_by_position,
        "ttft_s": stats.ttft_s,
        "tokens_per_second": stats.measured_rate(),  # the display also hides samples under 50 ms
        "elapsed_s": stats.elapsed_s,
        "draft_s": stats.draft_s,
        "verify_s": stats.verify_s,
        "steps_by_method": dict(stats.method_used),
        "steps_by_k": {str(k): v for k, v in sorted(stats.k_used.items())},
        "controller": stats.reason or None,
        "exactness": stats.exactness,
        "exactness_reason": stats.exactness_reason,
        "draft_dropped": engine.dropped_draft,
        "rpc_workers": list(stats.rpc_workers) if stats is not None else [],
    }

