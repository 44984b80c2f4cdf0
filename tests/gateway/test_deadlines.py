"""RequestOptions.deadline_s and stall_timeout_s on a real engine whose queue is built by
max_num_seqs=2: each live sample ends exactly once with TIMED_OUT and what it produced,
and the engine is told to stop."""

from __future__ import annotations

import asyncio

import pytest

from client import FinishReason, RequestFailed, RequestOptions, SamplingParams
from client.results import Accumulator
from codec import ErrorCode
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.helpers import RecordingClient

pytestmark = pytest.mark.engine
LONG = SamplingParams(temperature=0.0, max_tokens=TEST_MAX_MODEL_LEN - 16, ignore_eos=True)


async def collect(client, prompt, sampling, *, stream=True, request_id=None, options=None):
    acc = Accumulator()
    async for out in client.generate(
        prompt, sampling, stream=stream, request_id=request_id, options=options
    ):
        acc.add(out)
    return [acc.done[i] for i in sorted(acc.done)]


async def engine_idle(engine) -> None:
    async with asyncio.timeout(20):
        while await engine.has_unfinished_requests():
            await asyncio.sleep(0.02)


async def test_deadline_ends_running_samples_with_their_tokens(small_gateway):
    gw = small_gateway
    async with RecordingClient(gw.addresses[0], name="deadline") as client:
        for stream in (True, False):
            rid = f"dl-{stream}"
            (got,) = await collect(
                client,
                [5, 6, 7],
                LONG,
                stream=stream,
                request_id=rid,
                options=RequestOptions(deadline_s=0.4),
            )
            assert got.finish_reason is FinishReason.TIMED_OUT
            assert 0 < got.output_tokens == len(got.token_ids) < LONG.max_tokens
            assert len(client.terminals(rid)) == 1 and client.outputs_after_terminal(rid) == 0
            await engine_idle(gw.engine)
        # n > 1: every sample gets its own single TIMED_OUT terminal.
        samples = await collect(
            client,
            [8, 9],
            SamplingParams(
                n=2, temperature=1.0, seed=3, max_tokens=LONG.max_tokens, ignore_eos=True
            ),
            request_id="dl-n",
            options=RequestOptions(deadline_s=0.4),
        )
        assert [s.finish_reason for s in samples] == [FinishReason.TIMED_OUT] * 2
        outputs = [o for f in client.frames for o in f.outputs if o.request_id == "dl-n"]
        for index in (0, 1):
            mine = [o.finished is not None for o in outputs if o.index == index]
            assert mine.count(True) == 1 and mine[-1]  # one terminal, nothing after it
        await engine_idle(gw.engine)
    assert gw.table.stats.timed_out >= 3


async def test_stall_timeout_ends_a_request_stuck_in_the_engine_queue(small_gateway):
    gw = small_gateway
    async with RecordingClient(gw.addresses[0], name="stall") as client:
        # Two long requests fill max_num_seqs=2; a third waits in the engine's queue.
        blockers = [
            asyncio.ensure_future(collect(client, [10 + i], LONG, request_id=f"b{i}"))
            for i in range(2)
        ]
        while sum(1 for f in client.frames for o in f.outputs if o.request_id == "b1") < 2:
            await asyncio.sleep(0.01)
        (stuck,) = await collect(
            client,
            [20, 21],
            LONG,
            request_id="stuck",
            options=RequestOptions(stall_timeout_s=0.3),
        )
        assert stuck.finish_reason is FinishReason.TIMED_OUT
        assert stuck.output_tokens == 0 and stuck.token_ids == []
        assert len(client.terminals("stuck")) == 1
        # A stall timeout counts from the last output: a streaming request that keeps
        # producing is not ended by it.
        assert not any(b.done() for b in blockers)
        await client.abort(["b0", "b1"])
        for blocker in blockers:
            (ended,) = await blocker
            assert ended.finish_reason is FinishReason.ABORT  # told apart from TIMED_OUT
        await engine_idle(gw.engine)


async def test_bad_timeouts_are_refused(small_gateway):
    gw = small_gateway
    async with RecordingClient(gw.addresses[0]) as client:
        for options in (
            RequestOptions(deadline_s=0.0),
            RequestOptions(deadline_s=-1.0),
            RequestOptions(stall_timeout_s=float("nan")),
            RequestOptions(stall_timeout_s=float("inf")),
        ):
            with pytest.raises(RequestFailed) as info:
                await client.complete([1], SamplingParams(max_tokens=2), options=options)
            assert info.value.code is ErrorCode.INVALID_REQUEST
            assert "seconds above 0" in info.value.message
