"""Generations on one worker thread (the engine is not thread-safe); requests wait in a bounded queue (full: 503 with
Retry-After). A client that goes away cancels its generation within one decoding step.

One loop steps one scheduler (core/batch.py's BatchEngine): at parallel 1 the target's own context, one generation
at a time in turn; at parallel N > 1 N slots decoded together (one llama_decode a step over every active slot).
Requests join between steps, in the order they came; a draft head's request (method eagle3, dflash, mtp) drafts in
its slot like any other. A request the batch cannot take (BatchEngine.single_reason: a draft model whose state
llama.cpp cannot roll back) waits until the running ones are done, then runs alone on the target's own context (the
same scheduler with one slot); requests behind it wait behind it (first come, first served). A cancelled request
(its client went away) leaves its slot at the next step; the others go on unchanged."""

from __future__ import annotations

import asyncio
import contextlib
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
from localspec.knobs import knobs
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
    started: float = 0.0  # perf_counter() when it joined a batch
    done: bool = False  # its Finished (or error) was posted (batched jobs)
    n_prompt: int = 0  # its prompt's tokens (a stream that opens before the first event says it)

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()


def shutting_down() -> APIError:
    return APIError(503, SHUTTING_DOWN, code="shutting_down")


class Worker:
    """Runs generations one at a time on the session's engine, in the order they came."""

    def __init__(self, session, queue_size: int, log: Callable[[str], None], metrics=None, parallel: int = 1,
                 kv_layout: str = "auto", speculative: bool = True) -> None:
        """kv_layout and speculative (the server's default method drafts): BatchEngine's layout and its choice."""
        if queue_size < 1:
            raise UsageError(f"queue size must be >= 1, got {queue_size}")
        if parallel < 1:
            raise UsageError(f"--parallel must be >= 1, got {parallel}")
        from localspec.core.batch import BatchEngine

        # the target's own context: every request at parallel 1, and one the batch cannot take (single_reason)
        self.alone = BatchEngine(session.engine, 1, own_context=True)
        self.batch = self.alone  # the scheduler requests share
        self.parallel = 1
        if parallel > 1:
            try:
                self.batch = BatchEngine(session.engine, parallel, layout=kv_layout, speculative=speculative)
                self.parallel = parallel
            except UsageError as exc:  # a recurrent target whose state cannot be rolled back: one at a time
                log(f"warning: --parallel {parallel} ignored: {exc}")
        try:
            self._prepare(session, log)
        except BaseException:  # Ctrl-C while it probes: the batch's context goes before the session frees the model
            self.batch.close()
            raise
        self.running: list[Job] = []  # jobs in the scheduler's slots
        self._joining: list[Job] = []  # jobs taken from the queue, started once the generation slot is held
        self.session = session
        self.queue_size = queue_size
        self.log = log
        self.metrics = metrics  # server/metrics.py's Metrics, or None (no /metrics)
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0  # queued, not started
        self.closing = False  # shutting down: no new work, open requests answered "shutting down"
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0, "client_error": 0}
        self.recent_s: deque = deque(maxlen=16)  # durations of recent generations (for Retry-After)
        self._held: Job | None = None  # a job that runs alone, waiting for the batch to empty
        self._thread = threading.Thread(target=self._run, name="localspec-serve", daemon=True)
        self._thread.start()

    def _prepare(self, session, log: Callable[[str], None]) -> None:
        """The one-time measurements a first request would otherwise wait for, done before the server says it is
        ready: the batch exactness probe (--parallel N > 1; it clears the caches and --kv-layout auto chooses
        there) and the verify-cost curve the speculation is priced on. Both are cached per model file and llama.cpp
        build, so only a first start measures, and says so."""
        from localspec.core import verify_cost

        engine = session.engine
        batch = None if self.batch.alone else self.batch
        if batch is not None:
            try:
                if not batch.probe_cached():
                    log(f"localspec serve: --parallel {batch.n_slots}: checking whether requests decoded together "
                        "stay bit-exact here (once per model and llama.cpp build)")
                batch.probe(cache=True)
                if batch.layout_why:
                    log(f"localspec serve: --parallel {batch.n_slots}: {batch.layout_why}")
            except Exception:  # pragma: no cover - the first add() probes again and reports the error to its client
                log("localspec serve: the batch exactness probe failed:\n" + traceback.format_exc().rstrip())
        # what a verify of b rows costs: every batched step prices its rows on it; one request at a time, the
        # adaptive controller (method auto) starts from it
        try:
            cfg = session.gen_config()
            method = engine.resolve_method(cfg)
        except LocalspecError:
            return
        adaptive = cfg.adaptive if cfg.adaptive is not None else method == "auto"
        upto = 2 if batch is not None else cfg.k + 1
        if (batch is None and (method == "none" or cfg.k <= 0 or not adaptive)) or \
                knobs().no_cost_calibration:
            return
        if not verify_cost.verify_costs_cached(engine.target, upto):
            log("localspec serve: measuring what a verify batch costs here (once per model and llama.cpp build)")
        try:
            if batch is not None:
                batch.calibrate()
            else:
                engine.verify_costs(upto)
        except LocalspecError as exc:  # a request measures again and reports it
            log(f"warning: the verify-cost measurement failed: {exc}")

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
            jobs = [j for j in (self._held, *self._joining, *self.running) if j is not None]
        for job in jobs:
            if not job.cancel.is_set():
                job.post(shutting_down())  # queued on the loop before the generation's own "cancelled" end
                job.cancel.set()
        self._drain()

    def stop(self, timeout: float = 30.0) -> bool:
        """Cancel the running and queued generations and end the thread; True when it ended."""
        with self._lock:
            for job in (self._held, *self._joining, *self.running):
                if job is not None:
                    job.cancel.set()
        self._drain()
        self._q.put(None)
        self._thread.join(timeout)
        ended = not self._thread.is_alive()
        if ended:
            self.batch.close()  # before the session frees the model it lives on
            self.alone.close()
        return ended

    @property
    def kv_layout(self) -> str:
        """Where the batch's slots keep their KV: "split", "unified", "auto" (not chosen yet: before the probe), or
        "single" (the target's own context: one generation at a time)."""
        return self.batch.layout

    @property
    def active(self) -> int:
        """Generations running now (slots in use)."""
        return len(self.running)

    def _run(self) -> None:
        stopping = False
        with contextlib.ExitStack() as slot:
            holding = False  # the machine-wide generation slot (session.generation_slot), while anything runs
            while True:
                if not stopping and not self._admit(block=not (self.running or self._joining)):
                    stopping = True  # stop(): the running jobs are cancelled; end them, then return
                if stopping and not self.running:
                    for job in [*self._joining, *([self._held] if self._held is not None else [])]:
                        self._count("cancelled")
                    self._joining, self._held = [], None
                    return
                if not holding and (self.running or self._joining or self._held is not None):
                    slot.enter_context(S.generation_slot(waiting=self.log))
                    holding = True
                while self._joining:
                    self._start(self._joining.pop(0), self.batch)
                if self._held is not None and not self.running:
                    job, self._held = self._held, None
                    self._start(job, self.alone)
                if self.running:
                    sched = self._stepping()
                    try:
                        sched.step()
                    except Exception as exc:  # a failed decode fails the requests in the step, not the worker
                        self._fail_all(sched, exc)
                    with self._lock:
                        self.running = [j for j in self.running if not j.done]
                if holding and not self.running and self._held is None and self._q.empty():
                    slot.close()
                    holding = False

    def _stepping(self):
        """The scheduler whose requests run now: the batch's, or the one running alone."""
        return self.alone if self.alone.active else self.batch

    def _admit(self, block: bool) -> bool:
        """Move queued jobs into the free slots (blocking for the first one when nothing runs); they start once the
        generation slot is held. False: stop."""
        batch = self.batch
        while self._held is None and self._stepping() is batch and len(self._joining) < batch.free:
            try:
                job = self._q.get(timeout=None) if block else self._q.get_nowait()
            except queue.Empty:
                return True
            block = False
            if job is None:
                return False
            with self._lock:
                self.waiting -= 1
            if job.cancel.is_set():  # the client left while queued
                self._count("cancelled")
                continue
            try:
                single = batch.single_reason(job.cfg)
            except Exception as exc:
                self._failed(job, exc)
                self.recent_s.append(0.0)
                continue
            if single:
                self._held = job  # runs alone once the batch is empty
                return True
            self._joining.append(job)
        return True

    def _start(self, job: Job, sched) -> None:
        """The job's request joins `sched`: its prompt built, its events passed on to its client."""
        if job.cancel.is_set():  # the client left while it waited
            self._count("cancelled")
            return
        try:
            tokens = job.build(self.session.engine)
            job.started = time.perf_counter()
            on_event = self._events(job)
            with self._lock:
                self.running.append(job)
            sched.submit(tokens, job.cfg, cancel=job.cancel).listen(
                lambda ev, job=job, on_event=on_event: self._batched_event(job, ev, on_event))
        except Exception as exc:
            with self._lock:
                if job in self.running:
                    self.running.remove(job)
            self._failed(job, exc)
            self.recent_s.append(0.0)

    def _events(self, job: Job) -> Callable:
        """What happens with each event of a job's Response, batched or alone: posted to its client's stream, timed
        for /metrics, counted once it ends (the request's own error: failed, the others in a batch go on)."""
        m = self.metrics
        last = [None]  # when the previous token came (inter-token latency)

        def on_event(ev) -> None:
            if isinstance(ev, Exception):
                job.done = True
                self._failed(job, ev)
                return
            if isinstance(ev, Finished):  # counted before its client hears of it (and reads /metrics)
                job.done = True
                self.counts["cancelled" if ev.finish_reason == "cancelled" else "completed"] += 1
                if m is not None:
                    m.request_done(ev)
            job.post(ev)
            if isinstance(ev, Piece) and m is not None:
                now = time.perf_counter()
                m.token(None if last[0] is None else now - last[0])
                last[0] = now
        return on_event

    def _batched_event(self, job: Job, ev, on_event: Callable) -> None:
        on_event(ev)
        if job.done:
            self.recent_s.append(time.perf_counter() - job.started)

    def _fail_all(self, sched, exc: Exception) -> None:
        sched.fail_all()
        for job in self.running:
            if not job.done:
                job.done = True
                self._failed(job, exc)

    def _failed(self, job: Job, exc: Exception) -> None:
        # a request refused for what it asked (a logit_bias that leaves no token, a prompt the context cannot hold)
        # is the client's error, found only once its generation starts: counted as such, not as a failed generation
        # (which is what alerts watch)
        client = isinstance(exc, (UsageError, ContextOverflowError)) or (isinstance(exc, APIError) and exc.status < 500)
        self._count("client_error" if client else "failed")
        if isinstance(exc, UsageError):
            job.post(setting_error(exc))
        elif isinstance(exc, ContextOverflowError):
            job.post(setting_error(exc, code="context_length_exceeded"))
        elif isinstance(exc, LocalspecError):
            job.post(setting_error(exc, 500))
        elif isinstance(exc, APIError):
            job.post(exc)
        else:  # a bug must not kill the worker: log it here, answer one line
            self.log("localspec serve: generation failed:\n" + "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
            job.post(APIError(500, f"internal error: {type(exc).__name__}"))


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
