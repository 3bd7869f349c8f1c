"""The engine thread: it owns MLX. A bounded queue of jobs feeding one :class:`engine.batch.BatchLoop`.

Ownership: the worker thread is the only thread that touches MLX. It *builds* the Engine (model
loading: mlx-lm models keep lazy arrays — e.g. Llama 3's RoPE frequencies — that can only be
evaluated on the thread that made them), runs the warm-start prefetch, runs the batch loop (every
prefill chunk and decode step of every request) and finally ``engine.close()`` (which flushes the
spill queue). It runs on a stream it creates itself, so an array made on any other thread fails at
once ("There is no Stream(...) in current thread") on the CPU exactly as it does on a GPU. Other
threads read only the engine's plain attributes (tokenizer, context length, stats). Request handlers (asyncio) :meth:`Worker.submit` a :class:`Job` and read its typed
events (``engine/events.py``) from an ``asyncio.Queue`` that the worker fills through
``loop.call_soon_threadsafe``. Up to ``max_batch`` jobs are in the loop at once; up to
``max_queue`` more wait (then :class:`QueueFull`). A handler whose client went away calls
``job.stop()``: a job still queued leaves the queue at once (its place is free), a running one is
seen by the loop at the next token boundary, which stops that request alone and stores what it
computed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.batch import BatchLoop
from engine.errors import ShuttingDown
from engine.events import END, Chunk, Event, Failed, SamplingParams, Usage
from tiered_kv import Config

log = logging.getLogger(__name__)
__all__ = ["END", "Job", "QueueFull", "Worker"]


#: how long an idle engine waits, after taking a job, for requests that are still being parsed and
#: tokenised (:meth:`Worker.arrive`); it waits only while some are
GATHER_SECONDS = 0.1


class QueueFull(Exception):
    """``max_queue`` jobs already wait for a place in the batch."""


@dataclass(eq=False)
class Job:
    """One generation request; created on the event loop by :meth:`Worker.submit`."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    label: str = ""
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    on_end: Callable[[], None] | None = field(default=None, repr=False)
    on_stop: Callable[[Job], None] | None = field(default=None, repr=False)
    #: hears the request's Usage when its generation ends (engine thread), whether or not
    #: anyone reads its events any more: a client that went away still cost its tokens
    on_usage: Callable[[Usage], None] | None = field(default=None, repr=False)
    ended: bool = False  # END was emitted: nothing after it is (an abort ends what a step ended)

    def emit(self, event: Event) -> None:
        """Worker side: hand an event to the request's loop (a closed loop means nobody listens)."""
        if self.ended:
            return
        usage = event.usage if isinstance(event, (Chunk, Failed)) else None
        if usage is not None and self.on_usage is not None:
            try:
                self.on_usage(usage)
            except Exception:  # counting never ends a request
                log.exception("usage not recorded")
        if event is END:
            self.ended = True
            if self.on_end is not None:
                self.on_end()
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            self.cancel.set()

    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def stop(self) -> None:
        """Request side: nobody listens any more (the client went away). A queued job leaves
        the queue now (it ends with END alone); a running one stops at its next token."""
        self.cancel.set()
        if self.on_stop is not None:
            self.on_stop(self)

    async def get(self, timeout: float) -> Event | None:
        """Request side: the next event, or None after ``timeout`` seconds without one."""
        try:
            return await asyncio.wait_for(self.events.get(), timeout)
        except asyncio.TimeoutError:
            return None


class Arrival:
    """A request between its body and :meth:`Worker.submit` (parse, render, tokenise): while any
    is open, an engine that was idle gathers the jobs arriving with its first one. ``leave()`` is
    idempotent; ``submit`` leaves it as it queues the job."""

    def __init__(self, worker: Worker) -> None:
        self._worker, self._open = worker, True
        with worker._lock:
            worker._arriving += 1

    def leave(self) -> None:
        with self._worker._lock:
            self._leave_locked()

    def _leave_locked(self) -> None:
        if self._open:
            self._open = False
            self._worker._arriving -= 1


class _Progress:
    """Logs long prefills: tokens done / total and tok/s, at most every ``interval`` seconds."""

    def __init__(self, label: str, interval: float) -> None:
        self.label, self.interval = label, interval
        self.t0 = self.last = time.perf_counter()
        self.start_done: int | None = None

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.start_done is None:
            self.start_done = done
            self.t0 = self.last = now
            return
        if now - self.last < self.interval and done < total:
            return
        if done >= total and now - self.t0 < self.interval:
            return  # short prefill: not worth a line
        self.last = now
        rate = (done - self.start_done) / max(now - self.t0, 1e-9)
        log.info("%s prefill %d/%d tokens (%.0f tok/s)", self.label, done, total, rate)


class Worker:
    """Owns the engine thread and the Engine it builds; ``start`` (waits until the model is loaded),
    ``submit`` from the event loop, ``close`` at shutdown. ``batch_size`` / ``in_flight`` /
    ``pending`` are plain ints for /health and /metrics."""

    def __init__(
        self,
        make_engine: Callable[[], Any],
        progress_interval: float = 2.0,
        max_batch: int = Config.max_batch,
        max_queue: int = Config.max_queue,
        gather_seconds: float = GATHER_SECONDS,
    ) -> None:
        self._make_engine = make_engine
        self.gather_seconds = gather_seconds
        self._arriving = 0  # Arrival objects open: requests being parsed and tokenised
        self.engine: Any = None  # set on the engine thread before ``start`` returns
        self.max_batch, self.max_queue = max_batch, max_queue
        self._progress_interval = progress_interval
        self._lock = threading.Lock()
        self._queue: deque[Job] = deque()  # submitted, not yet taken by the engine thread
        self._queued = threading.Condition(self._lock)  # notified on a job queued, and on close
        self._closed = False  # no job is taken any more
        self._closing = False  # close() ran (once)
        self._accepted = 0  # submitted and not ended: at most max_batch + max_queue
        self.batch_size = 0  # requests decoding together (written by the worker thread only)
        self.in_flight = 0  # requests in the loop: waiting to prefill, prefilling or decoding
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tiered-kv-engine", daemon=True)

    def start(self, timeout: float | None = None) -> None:
        """Start the engine thread and wait until it has built the engine; re-raises a load
        failure (e.g. ``CacheDirError``) here, on the caller's thread. Idempotent."""
        with self._lock:
            if not self._thread.is_alive() and not self._ready.is_set():
                self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not finish loading in time")
        if self._load_error is not None:
            raise self._load_error

    def arrive(self) -> Arrival:
        """Say a request is on its way (call before parsing and tokenising it; ``leave()`` it on
        every path, or pass it to :meth:`submit`). An idle engine that takes a job waits up to
        ``gather_seconds`` for the jobs still arriving, so the batch loop orders their prefills
        (the fewest prompt tokens left first) instead of starting whichever was tokenised first:
        a title request's short prompt is ready sooner than the main request sent with it."""
        return Arrival(self)

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        label: str = "",
        arrival: Arrival | None = None,
        on_usage: Callable[[Usage], None] | None = None,
    ) -> Job:
        """Queue a job (``arrival``, if given, has arrived; ``on_usage``: :attr:`Job.on_usage`).
        Must be called on the event loop that will read the job's events. Raises QueueFull past
        ``max_queue`` waiting jobs, RuntimeError after close()."""
        job = Job(prompt_ids, params, asyncio.get_running_loop(), label, on_end=self._ended,
                  on_stop=self._withdraw, on_usage=on_usage)  # fmt: skip
        with self._lock:
            if arrival is not None:
                arrival._leave_locked()
            if self._closed:
                raise ShuttingDown()
            if self._accepted >= self.max_batch + self.max_queue:
                raise QueueFull(
                    f"{self.max_batch} requests are generating and {self.max_queue} waiting"
                )
            self._accepted += 1
            self._queue.append(job)
            self._queued.notify()
        return job

    def _ended(self) -> None:
        with self._lock:
            self._accepted -= 1

    def _withdraw(self, job: Job) -> None:
        """A stopped job still queued leaves the queue, and its place is free at once (it held
        it until the engine took it, while later requests got QueueFull)."""
        with self._lock:
            if job not in self._queue:
                return  # the engine has it: it stops at its next token
            self._queue.remove(job)
        job.emit(END)  # gone before it started: nothing computed (as the loop ends such a job)

    def pending(self) -> int:
        """Jobs waiting for a place in the batch."""
        return len(self._queue)

    def busy(self) -> bool:
        return self.in_flight > 0

    def begin_close(self) -> None:
        """Stop taking jobs and end the running and queued ones (each gets a 503, what it computed
        is stored); returns at once. The server calls it on SIGTERM, before the HTTP side waits
        for its open responses: they end now, whole (streams too), not cut by that wait."""
        with self._lock:
            self._closed = True
            self._queued.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """:meth:`begin_close`, then wait for the thread to close the engine and exit.

        The default wait covers the cold tier's shutdown writes (``shutdown_seconds``) plus a
        minute for the job in flight to stop."""
        if timeout is None:
            config = getattr(self.engine, "config", None)  # None: no engine was made
            timeout = getattr(config, "shutdown_seconds", Config.shutdown_seconds) + 60.0
        with self._lock:
            if self._closing:
                return
            self._closing = self._closed = True
            self._queued.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("worker did not stop within %ss; cache may not be flushed", timeout)

    # -- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        # This thread's own stream: nothing made on another thread can be evaluated here.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        try:
            self.engine = self._make_engine()
            self._warm_up()
        except BaseException as e:  # handed to start()'s caller: the CLI prints it in one line
            self._load_error = e
            return
        finally:
            self._ready.set()
        try:
            self._prefetch()
            loop = BatchLoop(self.engine, self.max_batch)
            while self._admit(loop):
                try:
                    loop.step()
                except Exception as e:  # a defect: its requests fail, the next ones are served
                    log.exception("batch step failed: the requests in flight fail")
                    loop.abort(e)
                    loop = BatchLoop(self.engine, self.max_batch)
                self.batch_size, self.in_flight = loop.decoding, loop.active
            loop.close()
            self.batch_size = self.in_flight = 0
            self._drain()
        finally:
            log.info("worker stopping: closing the engine (flushing the spill queue)")
            self.engine.close()

    def _admit(self, loop: BatchLoop) -> bool:
        """Move queued jobs into the loop while it has room (blocking while it is idle; after
        taking a job from idle, waiting up to ``gather_seconds`` while others are arriving).
        False once close() was called."""
        from_idle, first = loop.active == 0, 0.0
        while loop.has_room():
            block, timeout = loop.active == 0, None
            if not block and from_idle and self._arriving > 0:
                timeout = first + self.gather_seconds - time.perf_counter()
                block = timeout > 0
            job = self._take(block, timeout)
            if job is None:
                return not self._closed
            first = first or time.perf_counter()
            progress = _Progress(job.label, self._progress_interval)
            loop.add(job, job.prompt_ids, job.params, progress, job.enqueued)
            self.in_flight = loop.active
        return not self._closed

    def _take(self, block: bool, timeout: float | None) -> Job | None:
        """The oldest queued job, waiting for one while ``block`` (at most ``timeout`` seconds;
        None: until one comes); None when none came, or after close()."""
        with self._queued:
            if block:
                self._queued.wait_for(lambda: self._queue or self._closed, timeout)
            if self._closed or not self._queue:
                return None
            return self._queue.popleft()

    def _warm_up(self) -> None:
        """TIERED_KV_WARMUP: the first request's kernels loaded before ``start`` returns. A warm-up
        that fails (e.g. no memory for a whole prefill step) is logged and the server serves: it
        only moves a cost that the first request would otherwise pay."""
        if not getattr(self.engine, "warmup", False):
            return
        try:
            seconds = self.engine.warm_up()
        except Exception as e:
            mx.clear_cache()
            log.warning("warm-up failed, serving without it: %s: %s", type(e).__name__, e)
            return
        log.info("warm-up: kernels of the first request loaded in %.2fs", seconds)

    def _prefetch(self) -> None:
        """Warm start (TIERED_KV_PREFETCH): load recent disk entries into memory before serving;
        requests that arrive meanwhile queue behind it."""
        t0 = time.perf_counter()
        n = self.engine.cache.prefetch()
        if n:
            log.info("prefetched %d cold entries into memory in %.2fs", n, time.perf_counter() - t0)

    def _drain(self) -> None:
        """After close(): jobs still queued end without running."""
        with self._lock:
            jobs, self._queue = list(self._queue), deque()
        for job in jobs:
            job.emit(Failed(ShuttingDown()))
            job.emit(END)
