"""The engine thread: it owns MLX. A FIFO of jobs, one Engine, cancellation by flag.

Ownership: the worker thread is the only thread that touches MLX. It *builds* the Engine (model loading:
mlx-lm models keep lazy arrays — e.g. Llama 3's RoPE frequencies — that can only be evaluated on the thread
that made them), runs the warm-start prefetch, runs ``engine.generate`` for one job at a time and finally
``engine.close()`` (which flushes the spill queue). It runs on a stream it creates itself, so an array made on
any other thread fails at once ("There is no Stream(...) in current thread") on the CPU exactly as it does on
a GPU. Other threads read only the engine's plain attributes (tokenizer, context length, stats). Request
handlers (asyncio) submit a
:class:`Job` and read its events (``Chunk``, an exception, or the end) from an ``asyncio.Queue`` that the
worker fills through ``loop.call_soon_threadsafe``. A handler whose client went away sets ``job.cancel``;
the engine sees it through ``should_stop()`` between prefill chunks and decode steps, stops, and stores
what it computed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.generate import SamplingParams

log = logging.getLogger(__name__)
END = object()  # marks the end of a job's events


@dataclass
class Job:
    """One generation request; created on the event loop by :meth:`Worker.submit`."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    label: str = ""
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)
    started: float = 0.0

    def put(self, item: Any) -> None:
        """Worker side: hand an event (HitInfo, Chunk, exception, END) to the request's loop (a closed loop means nobody listens)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:
            self.cancel.set()

    async def get(self, timeout: float) -> Any:
        """Request side: the next event, or None after ``timeout`` seconds without one."""
        try:
            return await asyncio.wait_for(self.events.get(), timeout)
        except asyncio.TimeoutError:
            return None


class _Progress:
    """Logs long prefills: tokens done / total and tok/s, at most every ``interval`` seconds."""

    def __init__(self, label: str, interval: float) -> None:
        self.label, self.interval = label, interval
        self.t0 = self.last = time.perf_counter()
        self.first_done: int | None = None

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self.first_done is None:
            self.first_done = done
            self.start_done = done
        if now - self.last < self.interval and done < total:
            return
        if done >= total and now - self.t0 < self.interval:
            return  # short prefill: not worth a line
        self.last = now
        rate = (done - self.start_done) / max(now - self.t0, 1e-9)
        log.info("%s prefill %d/%d tokens (%.0f tok/s)", self.label, done, total, rate)


class Worker:
    """Owns the engine thread and the Engine it builds; ``start`` (waits until the model is loaded),
    ``submit`` from the event loop, ``close`` at shutdown."""

    def __init__(
        self,
        make_engine: Callable[[], Any],
        on_wait: Callable[[float], None] | None = None,
        progress_interval: float = 2.0,
    ) -> None:
        self._make_engine = make_engine
        self.engine: Any = None  # set on the engine thread before ``start`` returns
        self._on_wait = on_wait
        self._progress_interval = progress_interval
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._current: Job | None = None
        self._closed = False
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

    def set_on_wait(self, on_wait: Callable[[float], None]) -> None:
        """Hear each job's queue wait (seconds) when it starts (the server's metrics)."""
        self._on_wait = on_wait

    def submit(self, prompt_ids: list[int], params: SamplingParams, label: str = "") -> Job:
        """Queue a job (FIFO). Must be called on the event loop that will read the job's events."""
        job = Job(prompt_ids, params, asyncio.get_running_loop(), label)
        with self._lock:
            if self._closed:
                raise RuntimeError("server is shutting down")
            self._queue.put(job)
        return job

    def pending(self) -> int:
        """Jobs waiting for the worker (the running one excluded)."""
        return self._queue.qsize()

    def busy(self) -> bool:
        """Whether a job is running now."""
        return self._current is not None

    def close(self, timeout: float | None = None) -> None:
        """Cancel the running and queued jobs, then let the thread close the engine and exit.

        The default wait covers the cold tier's shutdown writes (``shutdown_seconds``) plus a
        minute for the job in flight to stop."""
        if timeout is None:
            config = getattr(self.engine, "config", None)
            timeout = getattr(config, "shutdown_seconds", 240.0) + 60.0
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._current is not None:
                self._current.cancel.set()
            self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("worker did not stop within %ss; cache may not be flushed", timeout)

    def _run(self) -> None:
        # This thread's own stream: nothing made on another thread can be evaluated here.
        mx.set_default_stream(mx.new_stream(mx.default_device()))
        try:
            self.engine = self._make_engine()
        except BaseException as e:  # handed to start()'s caller: the CLI prints it in one line
            self._load_error = e
            return
        finally:
            self._ready.set()
        try:
            self._prefetch()
            while (job := self._queue.get()) is not None:
                with self._lock:
                    if self._closed:
                        job.cancel.set()
                    self._current = job
                try:
                    self._generate(job)
                finally:
                    with self._lock:
                        self._current = None
            self._drain()
        finally:
            log.info("worker stopping: closing the engine (flushing the spill queue)")
            self.engine.close()

    def _prefetch(self) -> None:
        """Warm start (TIERED_KV_PREFETCH): load recent disk entries into memory before serving;
        requests that arrive meanwhile queue behind it."""
        t0 = time.perf_counter()
        n = self.engine.cache.prefetch()
        if n:
            log.info("prefetched %d cold entries into memory in %.2fs", n, time.perf_counter() - t0)

    def _drain(self) -> None:
        """After close(): jobs still queued end as cancelled without running."""
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.put(RuntimeError("server is shutting down"))
                job.put(END)

    def _generate(self, job: Job) -> None:
        job.started = time.perf_counter()
        if self._on_wait is not None:
            self._on_wait(job.started - job.enqueued)
        if job.cancel.is_set():
            job.put(END)
            return
        progress = _Progress(job.label, self._progress_interval)
        try:
            it = self.engine.generate(
                job.prompt_ids, job.params, progress, job.cancel.is_set, on_hit=job.put
            )
            try:
                for chunk in it:  # a set cancel flag ends the iterator with "cancelled"
                    job.put(chunk)
            finally:
                it.close()
        except Exception as e:  # the request's handler (the HTTP edge) turns it into an error body
            log.exception("%s generation failed", job.label)
            job.put(e)
        job.put(END)
