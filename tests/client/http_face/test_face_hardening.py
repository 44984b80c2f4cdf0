"""The face as the front door (issue 77): an HTTP caller never borrows the face's rights as
a gateway client, one caller cannot stall or starve the others, a refused request leaves
nothing running, hostile bodies are refused cheaply, and every wait is bounded. Gateways on
the fake engine (what each route asks of the gateway); the face's answers as vLLM shapes
them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import aiohttp
import pytest

from client.http_face.app import HttpFace, serving
from client.http_face.limits import FaceLimits
from client.pool import GatewayPool
from gateway.auth import ControlPolicy
from gateway.fake_engine import FakeEngine
from gateway.limits import GatewayLimits
from tests.client.http_face.conftest import AUTH, TOKEN, Http
from tests.conftest import running_gateway

LONG = {"max_tokens": 100_000, "ignore_eos": True}


@dataclasses.dataclass
class Recording(FakeEngine):
    """The fake engine, keeping each request's options as the gateway passed them."""

    seen: list = dataclasses.field(default_factory=list)

    def prepare(self, engine_request_id, request):  # noqa: ANN001, ANN201
        self.seen.append(request.options)
        return super().prepare(engine_request_id, request)


@dataclasses.dataclass
class LoraEngine(Recording):
    """The fake engine with LoRA names (load, unload)."""

    loras: list = dataclasses.field(default_factory=list)

    async def load_lora(self, name: str, path: str) -> None:
        self.loras.append(name)
        self.calls.append(f"load_lora {name}")

    async def unload_lora(self, name: str) -> None:
        self.loras.remove(name)
        self.calls.append(f"unload_lora {name}")


@contextlib.asynccontextmanager
async def face_on(
    *engines: Any,
    gateway_limits: GatewayLimits | None = None,
    control: ControlPolicy | None = None,
    **face_kwargs: Any,
):
    """A face over gateways on ``engines`` (control allowed to the face): ``(face, Http)``."""
    async with contextlib.AsyncExitStack() as stack:
        gateways = [
            await stack.enter_async_context(
                running_gateway(e, gateway_limits, control=control or ControlPolicy(open=True))
            )
            for e in engines
        ]
        pool = await stack.enter_async_context(
            GatewayPool([g.addresses[0] for g in gateways], name="http-face")
        )
        info = await pool.clients[0].model_info()
        face = HttpFace(pool, info.model, **face_kwargs)
        port = await stack.enter_async_context(serving(face, "127.0.0.1", 0))
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        )
        yield face, Http(session, f"http://127.0.0.1:{port}")


class _Operator:
    """What Access reads of a request that carries the operator's token."""

    headers = AUTH
    remote = "127.0.0.1"


def _generate(**extra: Any) -> dict[str, Any]:
    return {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}, **extra}


async def _until(condition, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- rights (item 1)


async def test_kv_transfer_params_need_the_operators_token_on_every_data_route():
    """The gateway takes kv_transfer_params only from clients allowed control calls, as
    the face is: a data caller (no token, a wrong token, or a face without --api-key)
    gets 401 and the engine receives nothing; the operator's token passes them on."""
    engine = Recording()
    kv = {"do_remote_prefill": True, "remote_host": "10.0.0.9"}
    completion = {"prompt": [1, 2], "max_tokens": 2, "kv_transfer_params": kv}
    async with face_on(engine, api_key=TOKEN, open_data_routes=True) as (_, http):
        for headers in (None, {"Authorization": "Bearer not-the-token"}):
            status, answer = await http.post(
                "/inference/v1/generate", _generate(kv_transfer_params=kv), headers=headers
            )
            assert status == 401 and "kv_transfer_params" in answer["error"]["message"], answer
            status, answer = await http.post("/v1/completions", completion, headers=headers)
            assert status == 401, answer
        assert engine.seen == []
        status, _ = await http.post("/inference/v1/generate", _generate(), headers=None)
        assert status == 200  # the route itself is open
        status, answer = await http.post("/inference/v1/generate", _generate(kv_transfer_params=kv))
        assert status == 200, answer
        assert engine.seen[-1].kv_transfer_params == kv
    async with face_on(Recording(), open_data_routes=True) as (_, http):  # no --api-key
        status, answer = await http.post(
            "/inference/v1/generate", _generate(kv_transfer_params=kv), headers=AUTH
        )
        assert status == 401 and "--api-key" in answer["error"]["message"], answer


async def test_routing_keys_and_request_ids_belong_to_their_caller():
    """Two callers naming the same session get two routing keys; each aborts only its
    own requests by id (a reused id aborts the caller's own, never another's); the count
    answered is what the gateway confirmed."""
    engine = Recording(step_interval_s=0.01)
    async with face_on(engine, api_key=TOKEN, open_data_routes=True) as (face, http):
        one, two = {"Authorization": "Bearer caller-one"}, {"Authorization": "Bearer caller-two"}
        for who in (one, two):
            headers = {**who, "X-Session-ID": "episode-1"}
            assert (await http.post("/inference/v1/generate", _generate(), headers=headers))[
                0
            ] == 200
        keys = [o.routing_key for o in engine.seen]
        assert len(set(keys)) == 2 and all(k.endswith(":episode-1") for k in keys)

        body = {"token_ids": [3], "sampling_params": LONG, "request_id": "same"}
        runs = [
            asyncio.ensure_future(http.post("/inference/v1/generate", body, headers=who))
            for who in (one, two)
        ]
        await _until(lambda: len(face.live) == 2 and all(
            s.started for ss in face.live.values() for s in ss))  # fmt: skip
        status, answer = await http.post(
            "/abort_requests", {"request_ids": ["generate-tokens-same"]}, headers=one
        )
        assert (status, answer["aborted"]) == (200, 1), answer
        status, answer = await http.post(
            "/abort_requests", {"request_ids": ["generate-tokens-nobody"]}, headers=one
        )
        assert answer["aborted"] == 0
        status, first = await runs[0]
        assert first["choices"][0]["finish_reason"] == "abort"
        assert not runs[1].done()
        await asyncio.sleep(0.2)
        assert not runs[1].done()  # the other caller's request of the same id runs on
        status, answer = await http.post("/abort_requests", headers=AUTH)  # no body: all
        assert (status, answer["aborted"]) == (200, 1), answer
        assert (await runs[1])[1]["choices"][0]["finish_reason"] == "abort"


# ---------------------------------------------------------------- fairness (item 3)


async def test_one_caller_cannot_take_the_faces_whole_budget():
    """The gateways allow the face 8 requests at once. A caller sending 40 long prompts in
    one body holds at most half of them, the rest wait in its queue, and another caller's
    request runs at once (it got 429 after 0.01 s before); the waiting prompts, aborted,
    end without ever reaching the engine."""
    engine = Recording(step_interval_s=0.01)
    limits = GatewayLimits(max_in_flight_per_client=8)
    async with face_on(engine, gateway_limits=limits, api_key=TOKEN, open_data_routes=True) as (
        face,
        http,
    ):
        assert (face.slots.capacity, face.slots.per_caller) == (8, 4)
        flood = {"prompt": [[i + 1] for i in range(40)], "request_id": "flood", **LONG}
        hog = asyncio.ensure_future(http.post("/v1/completions", flood, headers=None))
        anonymous = "peer-127.0.0.1"
        await _until(lambda: face.slots.holding(anonymous) == 4 and face.slots.waiting(anonymous))
        started = time.monotonic()
        status, answer = await http.post("/inference/v1/generate", _generate())
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer
        assert time.monotonic() - started < 5
        assert len(engine.added) == 5  # the hog's 4 and the operator's 1
        status, answer = await http.post(
            "/abort_requests", {"request_ids": ["cmpl-flood"]}, headers=None
        )
        assert (status, answer["aborted"]) == (200, 40), answer
        status, answer = await hog
        assert status == 200 and len(answer["choices"]) == 40
        assert {c["finish_reason"] for c in answer["choices"]} == {"abort"}
        assert len(engine.added) == 5 and face.slots.held == 0


async def test_per_request_bounds_and_a_full_queue_answer_clearly():
    engine = Recording(step_interval_s=0.01)
    limits = GatewayLimits(max_in_flight_per_client=2)
    bounds = FaceLimits(max_prompts=8, max_samples=12, max_queued_per_caller=1)
    async with face_on(engine, gateway_limits=limits, api_key=TOKEN, limits=bounds) as (face, http):
        status, answer = await http.post("/v1/completions", {"prompt": [[1]] * 9})
        assert status == 400 and "at most 8" in answer["error"]["message"], answer
        status, answer = await http.post("/v1/completions", {"prompt": [[1]] * 4, "n": 4})
        assert status == 400 and "16 samples" in answer["error"]["message"], answer
        status, answer = await http.post(
            "/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 13}}
        )
        assert status == 400, answer
        assert engine.seen == []
        # The operator holds its 1 slot (half of 2), one more waits: a third is refused.
        runs = [
            asyncio.ensure_future(http.post("/inference/v1/generate", _generate(
                sampling_params=LONG, request_id=f"r{i}")))
            for i in range(2)
        ]  # fmt: skip
        caller = face.access.caller(_Operator()).key
        await _until(lambda: face.slots.waiting(caller) == 1)
        status, answer = await http.post("/inference/v1/generate", _generate())
        assert status == 429 and "--max-queued-per-caller" in answer["error"]["message"]
        await http.post("/abort_requests", headers=AUTH)
        assert [(await run)[0] for run in runs] == [200, 200]


# ---------------------------------------------------------------- no leaks (item 4)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_prompt_in_a_batch_leaves_nothing_running(stream):
    engine = Recording(step_interval_s=0.01)
    async with face_on(engine, api_key=TOKEN) as (face, http):
        assert (await http.post("/v1/completions", {"prompt": [1], "max_tokens": 1}))[0] == 200
        before = asyncio.all_tasks()
        for _ in range(3):
            body = {"prompt": [[1, 2], [3], [engine.info.vocab_size + 5]], "stream": stream, **LONG}
            status, answer = await http.post("/v1/completions", body)
            if stream and status == 200:  # refused after the stream began: an error event
                assert "error" in answer[-2], answer
            else:
                assert status == 400, answer
        await _until(lambda: sorted(engine.aborted) == sorted(engine.added[1:]))
        assert len(engine.added) == 7  # 2 per batch ran, the third was refused

        def left() -> list[asyncio.Task]:  # the face's own tasks (not aiohttp's connections)
            new = asyncio.all_tasks() - before
            return [t for t in new if "aiohttp" not in t.get_coro().cr_code.co_filename]

        await _until(lambda: not left())
        assert face.live == {} and face.slots.held == 0


# ---------------------------------------------------------------- hostile bodies (item 7)


async def _raw(port: int, data: bytes, read_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), read_s)
    finally:
        writer.close()


def _port(http: Http) -> int:
    return int(http.base.rsplit(":", 1)[1])


async def test_hostile_bodies_are_refused_before_they_cost_anything():
    async with face_on(Recording(), api_key=TOKEN) as (face, http):
        # A body declared larger than a prompt of max_model_len ids can be: 413, unread.
        head = (
            "POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {60 << 20}\r\n\r\n"
        )
        started = time.monotonic()
        answer = await _raw(_port(http), head.encode() + b'{"token_ids": [1')
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert time.monotonic() - started < 2
        # Ids past the bound sent chunked: refused as soon as the bound is passed.
        ids = b"[" + b"1," * (face.limits.body_bytes(face.model, 1) // 2) + b"1]"
        status, answer = await http.post("/inference/v1/generate", raw=b'{"token_ids": ' + ids)
        assert status == 413, answer
        deep = b"[" * 200_000 + b"]" * 200_000
        bodies = {
            "/inference/v1/generate": b'{"token_ids": [1], "sampling_params": {"x": %s}}',
            "/v1/completions": b'{"prompt": %s}',
            "/abort_requests": b'{"request_ids": %s}',
            "/update_weights": b'{"update_info": %s}',
        }
        for path, body in bodies.items():
            status, answer = await http.post(path, raw=body % deep)
            assert status == 400 and "nested" in answer["error"]["message"], (path, answer)
        # Access is checked before a body is read: no token, a 401 whatever the body.
        status, _ = await http.post("/abort_requests", raw=deep, headers=None)
        assert status == 401


async def test_request_ids_and_session_ids_are_bounded():
    async with face_on(Recording(), api_key=TOKEN) as (_, http):
        status, answer = await http.post(
            "/v1/completions", {"prompt": [1], "max_tokens": 1, "request_id": "x" * 300}
        )
        assert status == 400 and "request_id" in answer["error"]["message"], answer
        for headers in ({**AUTH, "X-Request-Id": "y" * 300}, {**AUTH, "X-Session-ID": "z" * 300}):
            status, answer = await http.post("/v1/completions", {"prompt": [1]}, headers=headers)
            assert status == 400, answer


# ---------------------------------------------------------------- authorization (item 9)


async def test_authorization_is_read_as_vllm_reads_it():
    async with face_on(Recording(), api_key=TOKEN) as (_, http):
        status, _ = await http.post(
            "/inference/v1/generate", _generate(), headers={"Authorization": f"bearer {TOKEN}"}
        )
        assert status == 200  # the scheme in any case
        head = (
            b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
            b"Authorization: Bearer \xff\xfe\r\n\r\n{}"
        )
        answer = await _raw(_port(http), head)
        assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    async with face_on(Recording(), api_key="") as (_, http):  # empty: no key, as vLLM
        status, _ = await http.post("/inference/v1/generate", _generate(), headers=None)
        assert status == 200
        status, answer = await http.post("/pause", headers=None)
        assert status == 401 and "--api-key" in answer["error"]["message"]


# ---------------------------------------------------------------- bounded waits (item 14)


async def test_a_half_sent_request_is_closed_after_the_read_timeout():
    bounds = FaceLimits(read_timeout_s=0.5)
    async with face_on(Recording(), api_key=TOKEN, limits=bounds) as (_, http):
        started = time.monotonic()
        answer = await _raw(_port(http), b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert answer == b"" and time.monotonic() - started < 3  # closed, nothing answered
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
            f"Authorization: Bearer {TOKEN}\r\n\r\n"
        )
        answer = await _raw(_port(http), head.encode() + b'{"prompt": [1')
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


async def test_a_lora_load_refused_by_one_gateway_is_undone_on_the_others():
    """One gateway loads the adapter, the other refuses it: the answer names the one that
    refused, the first unloads it again, and once both can, the same load succeeds."""
    able, unable = LoraEngine(), Recording()
    async with face_on(able, unable, api_key=TOKEN) as (face, http):
        load = {"lora_name": "policy", "lora_path": "/adapters/one"}
        status, answer = await http.post("/v1/load_lora_adapter", load)
        assert status == 400 and "failed on 1 of 2 gateways" in answer["error"]["message"]
        assert able.calls == ["load_lora policy", "unload_lora policy"] and able.loras == []
        assert "policy" not in face.loras
        unable.load_lora = able.load_lora.__func__.__get__(unable)  # it can now
        unable.unload_lora = able.unload_lora.__func__.__get__(unable)
        unable.loras = []
        status, answer = await http.post("/v1/load_lora_adapter", load)
        assert status == 200, answer
        assert able.loras == unable.loras == ["policy"]


# ---------------------------------------------------------------- text (items 2 and 15)


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Any:
    from client.text import load_tokenizer
    from gateway.tiny_model import ensure_tiny_tokenizer

    return load_tokenizer(ensure_tiny_tokenizer())


async def test_text_prompts_are_bounded_and_encoded_off_the_loop(tiny_tokenizer, monkeypatch):
    async with face_on(Recording(), api_key=TOKEN, tokenizer=tiny_tokenizer) as (face, http):
        too_long = "a" * (face.text.max_chars + 1)
        encoded, encoding_ended = [], []
        real = tiny_tokenizer.hf.encode

        def slow_encode(text: str, **kwargs: Any) -> list[int]:
            encoded.append(len(text))
            time.sleep(1.5)  # a long prompt's encoding, as it holds its thread
            encoding_ended.append(time.monotonic())
            return real(text, **kwargs)

        monkeypatch.setattr(tiny_tokenizer.hf, "encode", slow_encode)
        status, answer = await http.post("/v1/completions", {"prompt": ["hi", too_long]})
        assert status == 400 and "max_model_len" in answer["error"]["message"], answer
        assert encoded == []  # refused before any encoding
        slow = asyncio.ensure_future(
            http.post("/v1/completions", {"prompt": "hello there", "max_tokens": 2})
        )
        await _until(lambda: encoded)
        assert (await http.get("/health"))[0] == 200
        answered = time.monotonic()
        assert (await slow)[0] == 200
        # The loop served /health while the prompt was being encoded (an encoding on the
        # loop would hold both this test and the face until it ended).
        assert answered < encoding_ended[0]


async def test_generate_answers_text_with_a_tokenizer(tiny_tokenizer):
    """output_mode "text" with --tokenizer: each choice's text is its ids' text, stop
    strings end it (the ids keep every token). (The chat-shaped logprobs against vllm
    serve's: tests/client/text/test_text_vs_vllm_server.py.)"""
    async with face_on(Recording(), api_key=TOKEN, tokenizer=tiny_tokenizer) as (_, http):
        body = {
            "token_ids": [5, 6, 7],
            "sampling_params": {"max_tokens": 6},
            "output_mode": "text",
        }
        status, answer = await http.post("/inference/v1/generate", body)
        assert status == 200 and answer["output_mode"] == "text", answer
        (choice,) = answer["choices"]
        assert choice["text"] == tiny_tokenizer.decode(
            choice["token_ids"], skip_special_tokens=True
        )
        stop = choice["text"][2:4]
        status, cut = await http.post(
            "/inference/v1/generate",
            {**body, "sampling_params": {"max_tokens": 6, "stop": [stop]}, "stream": True},
        )
        assert status == 200 and cut[-1] == "[DONE]"
        text = "".join(c["choices"][0]["text"] for c in cut[:-1])
        assert text == choice["text"][: choice["text"].index(stop)]
        assert cut[-2]["choices"][0]["stop_reason"] == stop
    async with face_on(Recording(), api_key=TOKEN) as (_, http):  # no tokenizer
        status, answer = await http.post("/inference/v1/generate", body)
        assert status == 400 and "--tokenizer" in answer["error"]["message"]


def test_the_face_says_what_it_waits_for_and_why_a_gateway_may_be_silent():
    """Issue 81 item 7: a --gateway where nothing answers: the face logs what it waits for
    and for how long, then exits 3 naming the address and the likely causes (CURVE);
    an address without its scheme is a usage error; the help shows each default."""
    import subprocess
    import sys

    from client import AsyncClient

    argv = [sys.executable, "-m", "client.http_face", "--port", "0", "--connect-timeout", "1"]
    done = subprocess.run([*argv, "--gateway", "tcp://127.0.0.1:9"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert (
        "waiting up to 1s (--connect-timeout) for a session with tcp://127.0.0.1:9" in done.stderr
    )
    assert "is a gateway serving there?" in done.stderr and "CURVE" in done.stderr
    done = subprocess.run([*argv, "--gateway", "127.0.0.1:9"], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 2 and "tcp://HOST:PORT" in done.stderr
    helped = subprocess.run([*argv[:3], "--help"], capture_output=True, text=True, timeout=60)
    assert "(default: 60.0)" in helped.stdout and "(default: 1024)" in helped.stdout
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        AsyncClient("127.0.0.1:5557")


async def test_a_stop_string_in_one_of_n_samples_ends_that_sample(tiny_tokenizer):
    """With n = 2 and a stop string, client.text ends the first sample that meets it in
    the engine (AbortSamples through the admitted stream) while the other goes on (the
    fake engine's samples are equal: each meets it in turn)."""
    engine = Recording(step_interval_s=0.001)
    async with face_on(engine, api_key=TOKEN, tokenizer=tiny_tokenizer) as (_, http):
        free = {"prompt": [5], "max_tokens": 6}
        status, answer = await http.post("/v1/completions", free)
        stop = answer["choices"][0]["text"][1]
        for stream in (False, True):
            body = {"prompt": [5], "n": 2, "max_tokens": 6, "stop": [stop], "stream": stream}
            status, answer = await http.post("/v1/completions", body)
            assert status == 200, answer
            events = answer[:-1] if stream else [answer]
            assert all("choices" in e for e in events), events
            ends = {c["index"]: (c["finish_reason"], c["stop_reason"]) for e in events
                    for c in e["choices"] if c["finish_reason"]}  # fmt: skip
            assert ends == {0: ("stop", stop), 1: ("stop", stop)}, ends


async def test_control_refusals_say_who_refused_and_what_to_change():
    """Issue 81 item 5: the operator's token on a face whose gateway does not allow the
    face control calls is a 403 naming both fixes (--control-key, --control-open); a wrong
    token and no token are 401s that say which."""
    async with face_on(Recording(), control=ControlPolicy(), api_key=TOKEN) as (_, http):
        status, answer = await http.post("/pause")
        assert status == 403, answer
        assert "--control-key" in answer["error"]["message"]
        assert "--control-open" in answer["error"]["message"]
        status, answer = await http.post("/pause", headers={"Authorization": "Bearer nope"})
        assert status == 401 and "is not the face's --api-key" in answer["error"]["message"]
        status, answer = await http.post("/pause", headers=None)
        assert status == 401 and "none was sent" in answer["error"]["message"]


async def test_a_served_model_name_replaces_the_models_path_as_vllm_serve_does():
    async with face_on(Recording(), api_key=TOKEN, served_model_name="policy") as (face, http):
        assert (await http.post("/inference/v1/generate", _generate(model="policy")))[0] == 200
        status, answer = await http.post("/inference/v1/generate", _generate(model=face.model.name))
        assert status == 404 and "this face serves `policy`" in answer["error"]["message"]


async def test_an_eos_stop_reads_as_vllm_serve_gives_it_with_and_without_a_tokenizer(
    tiny_tokenizer,
):
    """The gateway's engines (no tokenizer) stop on EOS as a stop token id and name it, as
    vllm serve --skip-tokenizer-init does; a face with a tokenizer answers as vllm serve
    with one: an EOS stop has no stop reason. The fake engine's sample from [510] reaches
    EOS (2) at its fifth token."""
    assert tiny_tokenizer.hf.eos_token_id == 2
    body = {"token_ids": [510], "sampling_params": {"max_tokens": 10}}
    for kwargs, expected in (({}, 2), ({"tokenizer": tiny_tokenizer}, None)):
        async with face_on(Recording(), api_key=TOKEN, **kwargs) as (_, http):
            for mode in ("tokens", "text") if kwargs else ("tokens",):
                status, answer = await http.post(
                    "/inference/v1/generate", {**body, "output_mode": mode}
                )
                (choice,) = answer["choices"]
                assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", expected)
                assert choice["token_ids"] == [510, 511, 0, 1, 2]
