"""engine/worker.py: the hit event before chunks, requests that share a prompt share its cache,
cancellation of queued and running jobs, prefill progress lines, the bounded queue, close()."""

from __future__ import annotations

import asyncio
import logging

import pytest

from engine.errors import ShuttingDown
from engine.events import END, Chunk, Hit
from engine.generate import Engine, SamplingParams
from engine.inflight import SHORT_PREFILL
from engine.worker import QueueFull, Worker
from tests.engine.batching import drain
from tiered_kv.config import Config


@pytest.fixture()
def make_engine(tiny_model_dir, tmp_path):
    return lambda: Engine(
        tiny_model_dir, Config(cache_dir=tmp_path, tiers=("hot",), prefill_chunk=16)
    )


def test_hit_first_shared_prompt_and_progress(make_engine, caplog):
    worker = Worker(make_engine, progress_interval=0.0)
    worker.start()
    engine = worker.engine
    ids = engine.encode_text("the cache holds the prompt and the disk holds the rest " * 8)

    async def main():
        jobs = [worker.submit(ids, SamplingParams(max_tokens=3), label=f"job{i}") for i in range(3)]
        return [await drain(j) for j in jobs], jobs

    with caplog.at_level(logging.INFO, logger="engine.worker"):
        results, jobs = asyncio.run(main())
    worker.close()
    for events in results:
        assert isinstance(events[0], Hit) and all(isinstance(e, Chunk) for e in events[1:])
        assert events[-1].finish_reason == "length"
    assert results[0][0].tier == "none" and results[1][0].tier == "hot"
    assert any("job0 prefill" in r.message and "tok/s" in r.message for r in caplog.records)


def test_cancel_queued_and_running(make_engine):
    worker = Worker(make_engine)
    worker.start()
    engine = worker.engine
    ids = engine.encode_text("a long answer please " * 4)

    async def main():
        running = worker.submit(ids, SamplingParams(max_tokens=100000))
        queued = worker.submit(ids, SamplingParams(max_tokens=5))
        queued.cancel.set()
        first = await running.get(30)
        assert isinstance(first, Hit)
        assert isinstance(await running.get(30), Chunk)
        running.cancel.set()
        return await drain(running), await drain(queued)

    ran, skipped = asyncio.run(main())
    worker.close()
    assert ran[-1].finish_reason == "cancelled" and ran[-1].usage.completion_tokens < 100000
    assert skipped == []


def test_close_rejects_new_jobs(make_engine):
    worker = Worker(make_engine)
    worker.start()
    worker.close()
    assert not worker.busy()

    async def main():
        with pytest.raises(ShuttingDown):  # a 503 at the HTTP edge
            worker.submit([1, 2, 3], SamplingParams())

    asyncio.run(main())


def test_batch_bound_and_queue_full(make_engine):
    """TIERED_KV_MAX_BATCH requests run at once, TIERED_KV_MAX_QUEUE more wait; past that, QueueFull."""
    worker = Worker(make_engine, max_batch=2, max_queue=1)
    worker.start()
    ids = worker.engine.encode_text("a long answer please " * 4)

    async def main():
        running = []
        for _ in range(2):
            running.append(worker.submit(ids, SamplingParams(max_tokens=100000)))
            while not isinstance(await running[-1].get(30), Chunk):
                pass
        waiting = worker.submit(ids, SamplingParams(max_tokens=2))
        with pytest.raises(QueueFull):
            worker.submit(ids, SamplingParams(max_tokens=2))
        assert worker.in_flight == 2 and worker.pending() == 1
        for job in running:
            job.cancel.set()
        return await drain(waiting)

    events = asyncio.run(main())
    worker.close()
    assert events[-1].finish_reason == "length"


def test_a_stopped_queued_job_frees_its_place_at_once(make_engine):
    """A queued job whose client went away (``stop()``) leaves the queue at once: its place is
    free while the running job goes on, and it ends with END alone (nothing computed)."""
    worker = Worker(make_engine, max_batch=1, max_queue=1)
    worker.start()
    ids = worker.engine.encode_text("a long answer please " * 4)

    async def main():
        running = worker.submit(ids, SamplingParams(max_tokens=100000))
        while not isinstance(await running.get(30), Chunk):
            pass
        queued = worker.submit(ids, SamplingParams(max_tokens=2))
        queued.stop()
        assert worker.pending() == 0 and worker.in_flight == 1
        after = worker.submit(ids, SamplingParams(max_tokens=2))  # no QueueFull
        stopped = await drain(queued)
        running.stop()
        return stopped, await drain(after)

    stopped, events = asyncio.run(main())
    worker.close()
    assert stopped == [] and events[-1].finish_reason == "length"


def test_an_idle_engine_gathers_the_requests_still_arriving(make_engine):
    """Issue 14, title + main: the title's short prompt is tokenised first; an idle engine that
    takes it waits for the main request still being tokenised (an open Arrival), so both are in
    the loop together and the one with the fewest prompt tokens left (main, its long prompt
    cached) is looked up and prefilled first, instead of whichever was tokenised first."""
    worker = Worker(make_engine, gather_seconds=30.0)
    worker.start()
    engine = worker.engine
    system = engine.encode_text("you are a coding agent with many tools to call " * 8)
    title = engine.encode_text("write a short title for this conversation please " * 12)
    assert len(title) > SHORT_PREFILL  # short prompts are leased together with main
    order: list[str] = []

    async def main():
        await drain(worker.submit(system + [7], SamplingParams(max_tokens=1)))  # cached
        arrival = worker.arrive()  # main is being tokenised
        jobs = [worker.submit(title, SamplingParams(max_tokens=2), label="title")]
        await asyncio.sleep(0.05)
        jobs.append(worker.submit(system + [9, 11], SamplingParams(max_tokens=2), "main", arrival))

        async def watch(job):
            async for item in events_of(job):
                if isinstance(item, Hit):
                    order.append(job.label)

        await asyncio.gather(*(watch(j) for j in jobs))

    asyncio.run(main())
    worker.close()
    assert order == ["main", "title"]


def test_an_arrival_that_never_submits_stops_no_one(make_engine):
    """An Arrival left (a request that failed to parse) holds nothing: a job taken from idle
    runs without waiting for it."""
    worker = Worker(make_engine, gather_seconds=30.0)
    worker.start()
    ids = worker.engine.encode_text("hello there")
    worker.arrive().leave()

    async def main():
        job = worker.submit(ids, SamplingParams(max_tokens=2))
        return await asyncio.wait_for(drain(job), 10)

    events = asyncio.run(main())
    worker.close()
    assert events[-1].finish_reason == "length"


async def events_of(job):
    while (item := await job.get(30)) is not END:
        assert item is not None, "worker stalled"
        yield item


def test_a_step_that_raises_fails_its_requests_and_the_worker_goes_on(make_engine, monkeypatch):
    """An error out of a batch step itself (a restore-costs row made ``log2`` fail there) ended
    the worker thread: the request in flight and every later one waited for ever."""
    from engine.batch import BatchLoop
    from engine.events import Failed

    real, calls = BatchLoop.step, []

    def fails_once(self: BatchLoop) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("math domain error")
        real(self)

    monkeypatch.setattr(BatchLoop, "step", fails_once)
    worker = Worker(make_engine)
    worker.start()
    ids = worker.engine.encode_text("the cache holds the prompt " * 4)

    async def main():
        first = await drain(worker.submit(ids, SamplingParams(max_tokens=3)))
        return first, await drain(worker.submit(ids, SamplingParams(max_tokens=3)))

    first, second = asyncio.run(main())
    worker.close()
    assert [type(e) for e in first][-1] is Failed and str(first[-1].error) == "math domain error"
    assert second[-1].finish_reason == "length"


def test_an_abort_after_a_request_ended_ends_it_once_and_fails_the_rest(make_engine, monkeypatch):
    """A step that raised after it had ended a request: the abort sent that request Failed and a
    second END (the worker counted it out twice: its queue bound loosened by one each time); a
    request still decoding fails, and the next one is served."""
    from engine.events import Failed
    from engine.inflight import Ends

    real, calls = Ends.finish, []

    def finish_then_raise(self: Ends, seq, reason, caches) -> None:
        calls.append(1)
        real(self, seq, reason, caches)
        if len(calls) == 1:
            raise RuntimeError("the rest of the step failed")

    monkeypatch.setattr(Ends, "finish", finish_then_raise)
    worker = Worker(make_engine)
    worker.start()
    ids = worker.engine.encode_text("the cache holds the prompt " * 4)

    async def main():
        short = worker.submit(ids, SamplingParams(max_tokens=2))
        long = worker.submit(ids, SamplingParams(max_tokens=50))
        got = [await drain(short), await drain(long)]
        assert short.events.empty() and long.events.empty()  # nothing after END
        return got, await drain(worker.submit(ids, SamplingParams(max_tokens=3)))

    (short, long), after = asyncio.run(main())
    assert short[-1].finish_reason == "length"  # ended by the step, before it raised
    assert isinstance(long[-1], Failed) and "rest of the step" in str(long[-1].error)
    assert after[-1].finish_reason == "length"
    assert worker._accepted == 0
    worker.close()


def test_usage_is_heard_from_the_last_chunk_and_from_a_failure(make_engine):
    """Job.on_usage hears what every generation that ran computed: a finished one's last chunk,
    and a failed or stopped one's Failed (a request that failed mid-way was not counted)."""
    from engine.events import Failed, Usage
    from engine.worker import Job

    heard: list[Usage] = []
    usage = Usage(prompt_tokens=30, completion_tokens=1, cached_tokens=0, cache_tier="none",
                  ttft_seconds=0.1)  # fmt: skip
    loop = asyncio.new_event_loop()
    try:
        job = Job([1, 2, 3], SamplingParams(max_tokens=1), loop, on_usage=heard.append)
        job.emit(Chunk("", None))  # no usage: nothing heard
        job.emit(Failed(RuntimeError("boom"), usage))
        job.emit(Chunk("x", None, "stop", usage))
    finally:
        loop.close()
    assert heard == [usage, usage]
