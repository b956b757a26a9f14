"""`Engine.async_generate` (SGLang's Engine has it): the results of `generate`, awaited
without blocking the event loop; a stream of chunks; a cancelled task or a stream left
early aborts its requests. Reference: `Engine.generate` on the same inputs."""

from __future__ import annotations

import asyncio

import pytest

GREEDY = {"max_new_tokens": 12, "temperature": 0}


def test_the_results_are_generates(engine):
    async def main():
        one = await engine.async_generate("Once upon a time", GREEDY)
        many = await engine.async_generate(["a", "b c"], GREEDY)
        ids = await engine.async_generate(input_ids=[[5, 6, 7], [8]], sampling_params=GREEDY)
        return one, many, ids

    one, many, ids = asyncio.run(main())
    assert one["output_ids"] == engine.generate("Once upon a time", GREEDY)["output_ids"]
    assert [o["text"] for o in many] == [o["text"] for o in engine.generate(["a", "b c"], GREEDY)]
    expected = engine.generate(input_ids=[[5, 6, 7], [8]], sampling_params=GREEDY)
    assert [o["output_ids"] for o in ids] == [o["output_ids"] for o in expected]


def test_the_event_loop_runs_while_a_generation_is_awaited(engine):
    """A plain `generate` in a coroutine holds the loop for the whole generation."""
    ticks = []

    async def tick():
        while True:
            ticks.append(1)
            await asyncio.sleep(0)

    async def main():
        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        ticks.clear()
        out = await engine.async_generate("x", {"max_new_tokens": 64, "ignore_eos": True})
        ticker.cancel()
        return out

    assert len(asyncio.run(main())["output_ids"]) == 64
    assert ticks  # (the ticker ran meanwhile)


def test_a_stream_adds_up_to_the_result_and_leaving_it_aborts(engine):
    async def main():
        chunks = await engine.async_generate("Once upon a time", GREEDY, stream=True)
        text = "".join([chunk["text"] async for chunk in chunks])
        engine.reset_stats()
        long = await engine.async_generate(
            "x", {"max_new_tokens": 3000, "ignore_eos": True}, stream=True
        )
        async for _ in long:
            break
        await long.aclose()
        return text

    text = asyncio.run(main())
    assert text == engine.generate("Once upon a time", GREEDY)["text"]
    assert engine.stats()["decode_tokens"] < 3000
    with pytest.raises(ValueError, match="single prompt"):
        asyncio.run(engine.async_generate(["a", "b"], GREEDY, stream=True))


def test_a_cancelled_task_aborts_its_requests(engine):
    async def main():
        engine.reset_stats()
        task = asyncio.create_task(
            engine.async_generate(["x", "y"], {"max_new_tokens": 3000, "ignore_eos": True})
        )
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert engine.stats()["decode_tokens"] < 2 * 3000  # (the rest was never computed)
