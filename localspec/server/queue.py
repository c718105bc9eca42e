"""One generation at a time: the engine is not thread-safe, so one worker thread runs every generation in turn and
requests wait in a bounded queue (full: 503 with Retry-After). A client that goes away cancels its generation
within one decoding step."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from localspec import session as S
from localspec.core.engine import Finished, GenConfig, Piece
from localspec.errors import ContextOverflowError, LocalspecError, UsageError
from localspec.server.config import POLL_S
from localspec.server.openai import APIError, setting_error

SHUTTING_DOWN = "server shutting down"


@dataclass
class Job:
    build: Callable[[Any], list[int]]  # engine -> prompt tokens (run in the worker: the engine is not thread-safe)
    cfg: GenConfig
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    checked: float = field(default_factory=time.monotonic)  # when the client's connection was last checked

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


def shutting_down() -> APIError:
    return APIError(503, SHUTTING_DOWN, code="shutting_down")


class Worker:
    """Runs generations one at a time on the session's engine, in the order they came."""

    def __init__(self, session, queue_size: int, log: Callable[[str], None], metrics=None) -> None:
        if queue_size < 1:
            raise UsageError(f"queue size must be >= 1, got {queue_size}")
        self.session = session
        self.queue_size = queue_size
        self.log = log
        self.metrics = metrics  # server/metrics.py's Metrics, or None (no /metrics)
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0  # queued, not started
        self.current: Job | None = None
        self.closing = False  # shutting down: no new work, open requests answered "shutting down"
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.recent_s: deque = deque(maxlen=16)  # durations of recent generations (for Retry-After)
        self._thread = threading.Thread(target=self._run, name="localspec-serve", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.closing:
                raise shutting_down()
            if self.waiting >= self.queue_size:
                self._count("rejected")
                raise APIError(503, f"server busy: {self.waiting} requests are waiting already; retry later",
                               type_="server_error", code="queue_full", headers={"Retry-After": str(self.retry_after())})
            self.waiting += 1
        self._q.put(job)

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.metrics is not None:
            self.metrics.requests.labels(outcome=outcome).inc()

    def retry_after(self) -> int:
        mean = sum(self.recent_s) / len(self.recent_s) if self.recent_s else 1.0
        return max(1, min(60, math.ceil(mean * (self.waiting + 1))))

    def _drain(self) -> None:
        while True:
            try:
                job = self._q.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancel.set()
                job.post(shutting_down())

    def shutdown(self) -> None:
        """The server is stopping (SIGTERM, Ctrl-C): every open request, running or queued, is answered
        "server shutting down" (a stream gets it as its last event, then [DONE]) and its generation cancelled; new
        requests get a 503. Called on the event loop's thread."""
        with self._lock:
            self.closing = True
            job = self.current
        if job is not None and not job.cancel.is_set():
            job.post(shutting_down())  # queued on the loop before the generation's own "cancelled" end
            job.cancel.set()
        self._drain()

    def stop(self, timeout: float = 30.0) -> bool:
        """Cancel the running and queued generations and end the thread; True when it ended."""
        with self._lock:
            if self.current is not None:
                self.current.cancel.set()
        self._drain()
        self._q.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.current = job
            try:
                self._one(job)
            finally:
                with self._lock:
                    self.current = None

    def _one(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while queued
            self._count("cancelled")
            return
        t0 = time.perf_counter()
        engine = self.session.engine
        try:
            tokens = job.build(engine)
            with S.generation_slot(waiting=self.log):
                last = None  # when the previous token came (inter-token latency)
                m = self.metrics
                for ev in engine.generate(tokens, job.cfg, cancel=job.cancel):
                    job.post(ev)
                    if isinstance(ev, Piece) and m is not None:
                        now = time.perf_counter()
                        m.token(None if last is None else now - last)
                        last = now
                    elif isinstance(ev, Finished):
                        self.counts["cancelled" if ev.finish_reason == "cancelled" else "completed"] += 1
                        if m is not None:
                            m.request_done(ev)
        except UsageError as exc:
            self._count("failed")
            job.post(setting_error(exc))
        except ContextOverflowError as exc:
            self._count("failed")
            job.post(setting_error(exc, code="context_length_exceeded"))
        except LocalspecError as exc:
            self._count("failed")
            job.post(setting_error(exc, 500))
        except Exception as exc:  # a bug must not kill the worker: log it here, answer one line
            self._count("failed")
            self.log("localspec serve: generation failed:\n" + traceback.format_exc().rstrip())
            job.post(APIError(500, f"internal error: {type(exc).__name__}"))
        finally:
            self.recent_s.append(time.perf_counter() - t0)


class ClientGone(Exception):
    pass


async def next_event(request, job: Job):
    """The job's next event. Checks at least every POLL_S that the client is still connected, whether events keep
    coming (a fast model) or not; when it is gone, cancels the job (the engine stops within one step) and raises
    ClientGone."""

    async def check() -> None:
        job.checked = time.monotonic()
        if await request.is_disconnected():
            job.cancel.set()
            raise ClientGone

    if time.monotonic() - job.checked >= POLL_S:
        await check()
    getter = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=POLL_S)
            if done:
                return getter.result()
            await check()
    finally:
        if not getter.done():
            getter.cancel()
