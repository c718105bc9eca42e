"""How an answer's figures are shown: the live status line, the end-of-run summaries and the `--json` object."""

from __future__ import annotations

import sys
import threading
import time

# the figures themselves are rendered by the one report of a generation (core/report.py)
from localspec.core.report import live_line, rate_text, short_summary, summary_line  # noqa: F401
from localspec.core.report import run_json as result_json  # noqa: F401


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
            from localspec.printable import printable

            self.clear()
            sys.stderr.write(printable(msg) + "\n")  # notices quote file names and model files' strings
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
