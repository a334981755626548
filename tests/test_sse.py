"""app.sse: streamed chunks gathered per interval (Ray Serve LLM's stream_batching_interval_ms),
the same events whatever the interval, and the setting from the YAML to the ingress.

The streaming through Serve's proxy itself (with the default interval) is tested in
test_app_serve_run, test_anthropic_messages and test_responses_api.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from app.sse import batches, named_events, sse_events


class Stream:
    """An async stream of `plan`'s items (a float: sleep that long first; an exception: raised),
    with a DeploymentResponseGenerator's `cancel`."""

    def __init__(self, plan: list):
        self.plan, self.cancelled, self.closed = plan, False, False

    def __aiter__(self):
        return self._items()

    async def _items(self):
        try:
            for step in self.plan:
                if isinstance(step, float):
                    await asyncio.sleep(step)
                elif isinstance(step, Exception):
                    raise step
                else:
                    yield step
        finally:
            self.closed = True

    def cancel(self) -> None:
        self.cancelled = True


async def _collect(gen) -> list:
    return [x async for x in gen]


def test_each_item_alone_without_an_interval():
    assert asyncio.run(_collect(batches(Stream([0, 1, 0.01, 2]), 0))) == [[0], [1], [2]]


def test_what_arrives_within_the_interval_is_one_batch():
    plan = [0, 1, 2, 0.6, 3, 4, 0.6, 5]
    assert asyncio.run(_collect(batches(Stream(plan), 0.2))) == [[0, 1, 2], [3, 4], [5]]


def test_the_end_of_the_stream_does_not_wait_out_the_interval():
    start = time.perf_counter()
    assert asyncio.run(_collect(batches(Stream([0, 1, 0.05, 2]), 5.0))) == [[0, 1, 2]]
    assert time.perf_counter() - start < 2.5


def test_an_error_comes_after_the_items_before_it():
    async def go():
        got = []
        with pytest.raises(ValueError, match="engine died"):
            async for items in batches(Stream([0, 1, ValueError("engine died")]), 0.1):
                got.append(items)
        return got

    assert asyncio.run(go()) == [[0, 1]]


def test_closing_the_batches_stops_reading_the_stream():
    async def go():
        stream = Stream([0, 0.05, 1, 30.0, 2])
        gen = batches(stream, 0.1)
        first = await gen.__anext__()
        await gen.aclose()
        await asyncio.sleep(0.05)  # the reader task's cancellation runs
        return first, stream.closed

    assert asyncio.run(go()) == ([0, 1], True)


def test_a_client_gone_mid_stream_closes_the_colocated_stream_being_read():
    """The replica's own stream (app.colocated.LocalStream) is closed when the body generator is
    closed at a write (a client gone), though the batches' reader was waiting on it then."""
    from app.colocated import LocalStream

    async def go():
        state = {"closed": False}

        async def engine_stream():
            try:
                yield {"n": 1}
                await asyncio.sleep(30)
                yield {"n": 2}
            finally:
                state["closed"] = True

        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        body = sse_events({"n": 0}, LocalStream(engine_stream()), 0.05)
        assert await body.__anext__() == 'data: {"n": 0}\n\n'
        assert await body.__anext__() == 'data: {"n": 1}\n\n'
        await body.aclose()  # the reader is inside engine_stream's sleep now
        await asyncio.sleep(0.05)
        return state["closed"], errors

    assert asyncio.run(go()) == (True, [])


@pytest.mark.parametrize("interval", [0.0, 0.05])
def test_the_same_events_whatever_the_interval(interval):
    chunks = [{"id": "c", "choices": [{"index": 0, "text": t}]} for t in ("Hel", "lo", ",", " world")]

    def sse():
        return "".join(asyncio.run(_collect(sse_events(chunks[0], Stream([chunks[1], 0.01, *chunks[2:]]),
                                                       interval))))

    def named():
        events = [{"type": "message_start"}, {"type": "content_block_delta", "i": 1}, {"type": "message_stop"}]
        return "".join(asyncio.run(_collect(named_events(events[0], Stream(events[1:]), lambda e, last: {},
                                                         interval))))

    assert sse() == "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    body = named()
    assert body.count("event: ") == 3 and body.startswith("event: message_start\n")


def test_a_failure_mid_stream_is_an_error_chunk_and_cancels_the_call():
    stream = Stream([{"n": 1}, RuntimeError("boom")])
    body = "".join(asyncio.run(_collect(sse_events({"n": 0}, stream, 0.05))))
    events = [e for e in body.split("\n\n") if e]
    assert events[:2] == ['data: {"n": 0}', 'data: {"n": 1}'] and events[-1] == "data: [DONE]"
    assert '"error"' in events[2] and "boom" in events[2] and stream.cancelled


def test_the_interval_comes_from_the_yaml_as_ray_serve_llm_reads_it():
    from app.builder import build_app
    from app.config import load_app_config

    def interval(**experimental):
        block = {"model_loading_config": {"model_id": "servax-tiny/llama"}, "experimental_configs": experimental}
        return load_app_config({"llm_configs": [block]}).llm_configs[0].stream_batching_s()

    assert interval() == pytest.approx(0.05)  # Ray Serve LLM's default
    assert interval(stream_batching_interval_ms=0) == 0 and interval(stream_batching_interval_ms=20) == 0.02
    for bad in (-1, "fast", True, float("inf")):
        with pytest.raises(ValueError, match="stream_batching_interval_ms"):
            interval(stream_batching_interval_ms=bad)
    app = build_app({"llm_configs": [{"model_loading_config": {"model_id": "servax-tiny/llama"},
                                      "experimental_configs": {"stream_batching_interval_ms": 20}}],
                     "ingress_config": {"colocate": False}})
    assert app._bound_deployment.init_args[3] == {"servax-tiny/llama": 0.02}  # OpenAIIngress' stream_batching
