"""The client library on another Python than the gateway's (issue 37 item 14).

    PYTHON -m tests.client_compat ADDRESS

Runs with pyzmq and msgspec only (no pytest, no gateway imports) against a fake-engine
gateway at ADDRESS (``python -m bench.fake_server``, control calls closed): the async and
blocking clients' calls, streaming, n > 1, aborts, a refused control call, a frame over
the limit refused locally, a lost session and its re-Hello. Exits 0 when every check
held; prints what failed otherwise. Run by scripts/client_pythons.sh (``make test``) on
the oldest and newest Python that vLLM supports and the machine has.
"""

from __future__ import annotations

import asyncio
import sys

from client import (
    AsyncClient,
    Client,
    ErrorCode,
    FinishReason,
    RequestFailed,
    SamplingParams,
    SessionLost,
)

SHORT = SamplingParams(max_tokens=4, ignore_eos=True)
LONG = SamplingParams(max_tokens=10**6, ignore_eos=True)


async def check_async(address: str) -> None:
    async with AsyncClient(address, heartbeat_interval_s=0.2) as client:
        assert client.hello_ack.session_id != 0
        assert (await client.complete([5, 6], SHORT)).output_tokens == 4
        tokens = []
        async for out in client.generate([7], SamplingParams(max_tokens=6, ignore_eos=True)):
            tokens += out.new_token_ids
        assert len(tokens) == 6
        samples = await client.complete_samples([8], SamplingParams(n=3, max_tokens=2))
        assert len(samples) == 3
        stream = client.generate([9], LONG, request_id="long")
        await stream.__anext__()
        ack = await client.abort(["long"])
        assert ack.aborted == ["long"]
        last = None
        async for out in stream:
            last = out
        assert last.finished.finish_reason is FinishReason.ABORT
        assert await client.ping() > 0
        assert (await client.health()).state == "serving"
        assert (await client.model_info()).model.vocab_size > 0
        try:
            await client.pause("keep")
            raise AssertionError("pause was allowed")
        except RequestFailed as exc:
            assert exc.code is ErrorCode.UNAUTHORIZED, exc
        limit = client.hello_ack.limits.max_frame_bytes
        try:
            await client.abort(["x" * 200] * (limit // 200 + 10))
            raise AssertionError("an over-limit Abort was sent")
        except RequestFailed as exc:
            assert exc.code is ErrorCode.FRAME_TOO_LARGE, exc
        # A lost session: in-flight work fails retryably, then a new session serves.
        stream = client.generate([9], LONG)
        await stream.__anext__()
        client._on_session_lost("compat check")
        try:
            async for _ in stream:
                pass
            raise AssertionError("the stream outlived its session")
        except SessionLost as exc:
            assert exc.retryable
        done = await asyncio.wait_for(client.complete([5], SHORT), 10)
        assert done.output_tokens == 4 and client.sessions_opened == 2


def check_blocking(address: str) -> None:
    with Client(address, timeout_s=10) as client:
        assert client.complete([5], SHORT).output_tokens == 4
        outputs = client.generate([6], LONG)
        next(outputs)
        outputs.close()
        assert client.ping() > 0


def main(address: str) -> int:
    asyncio.run(check_async(address))
    check_blocking(address)
    print(f"client checks passed on Python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
