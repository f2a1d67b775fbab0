"""AsyncEngine: concurrent streams, abort (explicit, by leaving the loop, by cancelling), shutdown."""

import asyncio
import threading
import time

import pytest
from test_engine_llm import ByteTokenizer, ScriptedModel, naive_greedy, tiny_model

from tokenmind.engine.async_engine import AsyncEngine, EngineFailed
from tokenmind.engine.config import EngineConfig
from tokenmind.engine.llm import Engine
from tokenmind.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


async def collect(stream):
    outs = [out async for out in stream]
    return outs


async def wait_idle(engine, timeout=5.0):
    """Until the engine thread has nothing left to run."""
    for _ in range(int(timeout / 0.01)):
        stats = await engine.stats()
        if stats.num_running == stats.num_waiting == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not go idle")


def test_concurrent_streams_match_naive_decoding(model):
    prompts = [[1, 2, 3], list(range(10, 27)), [5, 9]]

    async def main():
        engine = AsyncEngine(Engine(model, config=EngineConfig(block_size=4)))
        results = await asyncio.gather(*(collect(engine.generate(p, GREEDY, f"r{i}")) for i, p in enumerate(prompts)))
        stats = await engine.stats()
        await engine.shutdown()
        return results, stats

    results, stats = asyncio.run(main())
    for prompt, outs in zip(prompts, results):
        ref = naive_greedy(model, prompt, GREEDY.max_tokens)
        assert [t for o in outs for t in o.new_token_ids] == ref  # the deltas add up
        assert outs[-1].token_ids == ref and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert stats.num_steps < 3 * GREEDY.max_tokens  # they ran in the same batches
    assert stats.kv_cache_usage == 0.0


def test_text_deltas_stream():
    text = "Grüße, 世界!"
    engine_ = Engine(ScriptedModel(text.encode()), ByteTokenizer(), EngineConfig(block_size=4))

    async def main():
        engine = AsyncEngine(engine_)
        outs = await collect(engine.generate([0], SamplingParams(max_tokens=64, temperature=0)))
        await engine.shutdown()
        return outs

    outs = asyncio.run(main())
    assert "".join(o.new_text for o in outs) == text and outs[-1].text == text
    assert outs[-1].finish_reason == "stop"


def test_abort_ends_the_stream_and_frees_blocks(model):
    async def main():
        engine = AsyncEngine(Engine(model, config=EngineConfig(block_size=4)))
        long = SamplingParams(max_tokens=40, temperature=0)
        seen = []
        async for out in engine.generate([1, 2, 3], long, "victim"):
            seen.append(out)
            if len(seen) == 2:
                await engine.abort("victim")
        stats = await wait_idle(engine)
        await engine.shutdown()
        return seen, stats

    seen, stats = asyncio.run(main())
    assert seen[-1].finish_reason == "abort" and len(seen[-1].token_ids) < 40
    assert stats.kv_cache_usage == 0.0


@pytest.mark.parametrize("how", ["break", "cancel"])
def test_a_consumer_that_goes_away_aborts_its_request(model, how):
    async def main():
        engine = AsyncEngine(Engine(model, config=EngineConfig(block_size=4)))
        long = SamplingParams(max_tokens=40, temperature=0)
        if how == "break":
            stream = engine.generate([1, 2, 3], long)
            async for _ in stream:
                break
            await stream.aclose()
        else:
            started = asyncio.Event()

            async def consume():
                async for _ in engine.generate([1, 2, 3], long):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        stats = await wait_idle(engine)
        await engine.shutdown()
        return stats

    stats = asyncio.run(main())
    assert stats.kv_cache_usage == 0.0 and stats.num_generated_tokens < 40


def test_shutdown_aborts_running_streams_and_refuses_new_ones(model):
    async def main():
        engine = AsyncEngine(Engine(model, config=EngineConfig(block_size=4)))
        stream = engine.generate([4, 5], SamplingParams(max_tokens=40, temperature=0))
        first = await stream.__anext__()
        await engine.shutdown()
        rest = [out async for out in stream]
        with pytest.raises(RuntimeError, match="shut down"):
            await engine.generate([1], GREEDY).__anext__()
        return first, rest, engine

    first, rest, engine = asyncio.run(main())
    assert not first.finished and rest[-1].finish_reason == "abort"
    assert not engine._thread.is_alive()
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bad_requests_raise_in_the_caller(model):
    async def main():
        engine = AsyncEngine(Engine(model, config=EngineConfig(block_size=4)))
        try:
            with pytest.raises(ValueError, match="prompt is empty"):
                await engine.generate([], GREEDY).__anext__()
            outs = await collect(engine.generate([1], SamplingParams(max_tokens=2, temperature=0)))
        finally:
            await engine.shutdown()
        return outs

    assert len(asyncio.run(main())[-1].token_ids) == 2


def test_a_failing_step_fails_every_stream(model):
    engine_ = Engine(model, config=EngineConfig(block_size=4))

    def broken():
        raise RuntimeError("boom")

    async def main():
        engine = AsyncEngine(engine_)
        engine_.runner.run = lambda batch: broken()
        with pytest.raises(RuntimeError, match="boom"):
            await collect(engine.generate([1, 2], GREEDY))
        with pytest.raises(RuntimeError, match="failed"):
            await engine.generate([1, 2], GREEDY).__anext__()
        await engine.shutdown()

    asyncio.run(main())  # no hang: the error reached the stream and the next caller


def test_an_engine_factory_runs_on_the_engine_thread_and_its_errors_reach_the_caller(model):
    import threading

    built_on = []

    def build():
        built_on.append(threading.current_thread().name)
        return Engine(model, ByteTokenizer(), EngineConfig(kv_cache_bytes=1 << 20))

    engine = AsyncEngine(build)
    assert built_on == ["tokenmind-engine"] and isinstance(engine.engine, Engine)
    asyncio.run(engine.shutdown())

    def broken():
        raise ValueError("kv_cache_bytes is too small for one block")

    with pytest.raises(ValueError, match="too small"):
        AsyncEngine(broken)


def slow_engine(model, delay: float, **config) -> Engine:
    """An engine whose every step sleeps `delay` s first: a window to act while a step runs."""
    engine = Engine(model, config=EngineConfig(block_size=4, **config))
    run = engine.runner.run

    def slow_run(batch):
        time.sleep(delay)
        return run(batch)

    engine.runner.run = slow_run
    return engine


def test_cancelling_a_caller_before_its_first_token_leaves_the_engine_alive(model):
    """The reproduction of the server-killing bug: a request's task is cancelled while its `add`
    command still waits behind a running step. The engine must skip or abort it and live on."""

    async def main():
        engine = AsyncEngine(slow_engine(model, 0.3))
        long = asyncio.create_task(collect(engine.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))))
        await asyncio.sleep(0.1)  # the long request's first step is running now
        for _ in range(3):  # callers that give up while their add command is queued
            abandoned = asyncio.create_task(collect(engine.generate([4, 5], SamplingParams(max_tokens=30))))
            await asyncio.sleep(0.02)
            abandoned.cancel()
        outs = await asyncio.wait_for(long, 10)
        stats = await wait_idle(engine)
        health = engine.health()
        after = await collect(engine.generate([7], SamplingParams(max_tokens=2, temperature=0)))
        await engine.shutdown()
        return outs, stats, health, after

    outs, stats, health, after = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].token_ids) == 3
    assert health.alive and health.error is None
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0
    assert after[-1].finish_reason == "length"


def test_a_caller_cancelled_after_its_request_was_added_aborts_it(model):
    """The add command ran, but the caller was cancelled before it saw the result: no orphan request."""

    async def main():
        engine = AsyncEngine(slow_engine(model, 0.05))
        added = threading.Event()
        real_add = engine.engine.add_request

        def add_then_signal(*args):
            rid = real_add(*args)
            added.set()
            time.sleep(0.2)  # the caller is cancelled while the command still "runs"
            return rid

        engine.engine.add_request = add_then_signal
        task = asyncio.create_task(collect(engine.generate([1, 2], SamplingParams(max_tokens=50, temperature=0))))
        await asyncio.to_thread(added.wait, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await wait_idle(engine)
        await engine.shutdown()
        return stats

    stats = asyncio.run(main())
    assert stats.kv_cache_usage == 0.0 and stats.num_generated_tokens < 50


def test_an_engine_failure_is_reported_by_health_and_to_every_caller(model):
    engine_ = Engine(model, config=EngineConfig(block_size=4))
    failures = []

    async def main():
        engine = AsyncEngine(engine_)
        engine.on_failure.append(failures.append)
        engine_.runner.run = lambda batch: 1 / 0
        with pytest.raises(EngineFailed, match="ZeroDivisionError"):
            await collect(engine.generate([1, 2], GREEDY))
        with pytest.raises(EngineFailed):
            await engine.stats()
        with pytest.raises(EngineFailed):
            await engine.generate([1], GREEDY).__anext__()
        await engine.abort("whatever")  # nothing to abort on a dead engine: no error, no hang
        await asyncio.wait_for(engine.shutdown(), 5)
        return engine.health()

    health = asyncio.run(main())
    assert not health.alive and "ZeroDivisionError" in health.error
    assert len(failures) == 1 and isinstance(failures[0], ZeroDivisionError)


def test_health_shows_a_running_step_and_its_age(model):
    async def main():
        engine = AsyncEngine(slow_engine(model, 0.5))
        idle = engine.health()
        task = asyncio.create_task(collect(engine.generate([1], SamplingParams(max_tokens=1, temperature=0))))
        await asyncio.sleep(0.25)
        busy = engine.health()  # answered at once although the step holds the engine thread
        await task
        await engine.shutdown()
        return idle, busy

    idle, busy = asyncio.run(main())
    assert idle.alive and idle.step_running_s is None and idle.last_step_age_s is None
    assert busy.alive and 0.1 < busy.step_running_s < 0.5


def test_a_request_that_waits_too_long_in_the_queue_ends_with_timeout(model):
    async def main():
        engine = AsyncEngine(slow_engine(model, 0.1, max_num_seqs=1, max_queue_wait=0.25))
        first = asyncio.create_task(collect(engine.generate([1, 2], SamplingParams(max_tokens=6, temperature=0))))
        await asyncio.sleep(0.05)
        second = await collect(engine.generate([3, 4], SamplingParams(max_tokens=6, temperature=0)))
        stats = await wait_idle(engine)
        await engine.shutdown()
        return await first, second, stats

    first, second, stats = asyncio.run(main())
    assert first[-1].finish_reason == "length"
    assert second[-1].finish_reason == "timeout" and second[-1].token_ids == []
    assert stats.num_queue_timeouts == 1 and stats.kv_cache_usage == 0.0
