"""Text and stop strings through the gateway and the client equal vLLM's OpenAI-compatible
server, for the same model, tokenizer and prompt ids: a byte-level BPE (fast) and a
SentencePiece (slow, Python) tokenizer; greedy and seeded, n = 1 and 2, streaming and not,
stop strings cut from the text (inside one token, across tokens, multi-byte characters),
``include_stop_str_in_output``, ``skip_special_tokens``, ``min_tokens``. Every case checks
text, token ids, finish reason and stop reason; over 50 cases in all."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from client import AsyncClient, Client, GatewayPool
from client.text import (
    AsyncTextClient,
    Conversation,
    TextClient,
    TextError,
    TextParams,
    load_tokenizer,
)
from codec import FinishReason, SamplingParams
from gateway.auth import ControlPolicy
from tests.client.text.openai_server import Choice, OpenAIServer
from tests.conftest import TEST_MAX_MODEL_LEN, cpu_engine_args, engine_gateway
from tests.text_models import ensure_text_model

pytestmark = pytest.mark.engine
CASES_PER_MODEL = 30
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


@dataclass
class Served:
    kind: str
    server: OpenAIServer
    gateway: Any
    tokenizer: Any


@pytest.fixture(scope="module", params=["bpe", "sp-slow"])
async def served(request: pytest.FixtureRequest):  # noqa: ANN201
    """vLLM's server and a gateway on one model, started side by side."""
    model = str(ensure_text_model(request.param))
    server = OpenAIServer(
        model, TEST_MAX_MODEL_LEN, "--enable-scale-out"
    )  # + /inference/v1/generate
    try:
        open_control = ControlPolicy(open=True)  # GetStats
        async with engine_gateway(cpu_engine_args(model), control=open_control) as gateway:
            await asyncio.to_thread(server.wait_ready)
            yield Served(request.param, server, gateway, load_tokenizer(model))
    finally:
        await asyncio.to_thread(server.stop)


def _case(seed: int, tokenizer: Any, free_text: str) -> dict[str, Any]:
    """Request fields for case ``seed``: stops cut from ``free_text`` (the case's text with
    no stop strings), so that most of them match."""
    rng = random.Random(seed)
    case: dict[str, Any] = {
        "max_tokens": 40,
        "include_stop_str_in_output": rng.random() < 0.3,
        "skip_special_tokens": rng.random() < 0.7,
        "min_tokens": rng.choice([0, 0, 0, 3]),
        "stream": rng.random() < 0.5,
    }
    stops = []
    for _ in range(rng.randint(1, 3)):
        if not free_text:
            break
        start = rng.randrange(len(free_text))
        stops.append(free_text[start : start + rng.randint(1, 5)])
    multibyte = [ch for ch in free_text if len(ch.encode()) > 1 and ch != "\ufffd"]
    if multibyte and rng.random() < 0.5:
        stops.append(rng.choice(multibyte))  # one character of several bytes
    case["stop"] = stops or ["\n"]
    return case


def _prompt(seed: int, tokenizer: Any) -> list[int]:
    rng = random.Random(seed)
    if seed % 4 == 0:
        messages = [{"role": "user", "content": f"question {seed}: café 日本語 😀?"}]
        return tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    return [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(4, 24))]


def _sampling(seed: int, n: int, case: dict[str, Any]) -> dict[str, Any]:
    if seed % 3 == 0:
        return {"temperature": 0.9, "seed": 1000 + seed, "n": n}
    return {"temperature": 0.0, "n": n}


async def _gateway_choices(
    text_client: AsyncTextClient, prompt: list[int], sampling: dict, case: dict
) -> list[Choice]:
    params = TextParams(
        stop=case["stop"],
        include_stop_str_in_output=case["include_stop_str_in_output"],
        skip_special_tokens=case["skip_special_tokens"],
    )
    wire = SamplingParams(max_tokens=case["max_tokens"], min_tokens=case["min_tokens"], **sampling)
    choices = [Choice() for _ in range(sampling["n"])]
    async for out in text_client.generate(prompt, wire, params, stream=case["stream"]):
        choice = choices[out.index]
        choice.text += out.text
        choice.token_ids += out.token_ids
        if out.done:
            choice.finish_reason = _FINISH[out.finish_reason]
            choice.stop_reason = out.stop_reason
    return choices


async def test_text_and_stops_equal_vllm_server(served: Served) -> None:
    tokenizer = served.tokenizer
    counts = {"stop string": 0, "across tokens": 0, "streamed": 0, "n=2": 0}
    async with AsyncClient(served.gateway.addresses[0]) as client:
        text_client = AsyncTextClient(client, tokenizer)
        for seed in range(CASES_PER_MODEL):
            prompt = _prompt(seed, tokenizer)
            n = 2 if seed % 6 == 3 else 1  # seeded (greedy refuses n > 1)
            sampling = _sampling(seed, n, {})
            free = await text_client.complete_samples(
                prompt, SamplingParams(max_tokens=40, **sampling)
            )
            case = _case(seed, tokenizer, free[0].text)
            expected = await asyncio.to_thread(served.server.complete, prompt, **sampling, **case)
            got = await _gateway_choices(text_client, prompt, sampling, case)
            assert got == expected, (served.kind, seed, case)
            for choice in got:
                if isinstance(choice.stop_reason, str):
                    counts["stop string"] += 1
                    pieces = [tokenizer.decode([i]) for i in choice.token_ids]
                    if not any(choice.stop_reason in piece for piece in pieces):
                        counts["across tokens"] += 1
            counts["streamed"] += case["stream"]
            counts["n=2"] += n == 2
    print(served.kind, counts)
    # The cases exercise what they claim to (a plant of a broken stop rule fails above).
    assert counts["stop string"] >= CASES_PER_MODEL // 2, counts
    assert counts["across tokens"] >= 3, counts
    assert counts["streamed"] >= 5 and counts["n=2"] >= 3, counts


async def test_pool_and_blocking_client_give_the_same_text(served: Served) -> None:
    """GatewayPool and the blocking Client through the same text layer, against the server."""
    tokenizer = served.tokenizer
    prompt = _prompt(1, tokenizer)
    async with GatewayPool(served.gateway.addresses) as pool:
        free = await AsyncTextClient(pool, tokenizer).complete(
            prompt, SamplingParams(max_tokens=40, temperature=0.0)
        )
    case = _case(1, tokenizer, free.text)
    sampling = {"temperature": 0.0, "n": 1}
    expected = await asyncio.to_thread(served.server.complete, prompt, **sampling, **case)
    async with GatewayPool(served.gateway.addresses) as pool:
        via_pool = await _gateway_choices(AsyncTextClient(pool, tokenizer), prompt, sampling, case)
    assert via_pool == expected

    def blocking() -> list[Choice]:
        with Client(served.gateway.addresses[0]) as client:
            text_client = TextClient(client, tokenizer)
            params = TextParams(
                stop=case["stop"],
                include_stop_str_in_output=case["include_stop_str_in_output"],
                skip_special_tokens=case["skip_special_tokens"],
            )
            wire = SamplingParams(
                max_tokens=case["max_tokens"], min_tokens=case["min_tokens"], temperature=0.0
            )
            choice = Choice()
            for out in text_client.generate(prompt, wire, params):
                choice.text += out.text
                choice.token_ids += out.token_ids
                if out.done:
                    choice.finish_reason = _FINISH[out.finish_reason]
                    choice.stop_reason = out.stop_reason
            done = text_client.complete(prompt, wire, params)
            assert (done.text, done.token_ids) == (choice.text, choice.token_ids)
            return [choice]

    assert await asyncio.to_thread(blocking) == expected


async def test_a_stop_string_aborts_the_request_in_the_engine(served: Served) -> None:
    """The sample ends at the stop string and the gateway is told at once: the request is
    aborted there (not run on to max_tokens), and its id is free again."""
    tokenizer = served.tokenizer
    prompt = _prompt(2, tokenizer)
    sampling = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    async with AsyncClient(served.gateway.addresses[0]) as client:
        text_client = AsyncTextClient(client, tokenizer)
        free = await text_client.complete(prompt, sampling)
        # A stop completed by the free text's third-to-fifth token.
        stop = tokenizer.decode(free.token_ids[:5], skip_special_tokens=True)[-3:]
        assert stop.strip() and len(free.token_ids) == 300
        before = (await client.stats()).gateway
        done = await text_client.complete(prompt, sampling, TextParams(stop=[stop]))
        assert done.stop_reason == stop and done.finished is None
        assert len(done.token_ids) <= 5
        async with asyncio.timeout(30):
            while (after := (await client.stats()).gateway)["aborted_by_client"] == before[
                "aborted_by_client"
            ]:
                await asyncio.sleep(0.05)
        assert after["aborted_by_client"] == before["aborted_by_client"] + 1
        assert after["output_tokens"] - before["output_tokens"] < 150
        assert not client.live_request_ids()


async def test_a_multi_turn_conversation_through_the_gateway(served: Served) -> None:
    """Three turns: each prompt is the previous prompt + the completion's ids as sampled
    (stop string, EOS or length) + the new messages' ids; the trainer's mask and logprobs
    line up with the sampled ids."""
    tokenizer = served.tokenizer
    conversation = Conversation.start(tokenizer, [{"role": "user", "content": "Hi, café?"}])
    sampled: list[int] = []
    async with AsyncClient(served.gateway.addresses[0]) as client:
        text_client = AsyncTextClient(client, tokenizer)
        for turn in range(3):
            prompt = conversation.prompt_ids
            sampling = SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)
            done = await text_client.complete(prompt, sampling, TextParams(stop=["\n"]))
            conversation.add_completion(done)
            assert conversation.token_ids[len(prompt) :] == done.token_ids
            sampled += done.token_ids
            added = conversation.add_messages([{"role": "user", "content": f"turn {turn} 東京"}])
            assert conversation.token_ids[-len(added) :] == added
    mask = conversation.sampled_mask
    assert [t for t, m in zip(conversation.token_ids, mask, strict=True) if m] == sampled
    logprobs = [lp for lp, m in zip(conversation.sampled_logprobs, mask, strict=True) if m]
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs)
    assert len(conversation.messages) == 7


async def test_a_qwen3_conversation_through_the_gateway(served: Served) -> None:
    """A Qwen3-style thinking template (TRL's copy of Qwen3.5's): its generation prompt
    opens a think block, so each completion through the gateway is reasoning, which the
    template's rendering of the history drops. Three turns: the sampled ids and the opened
    blocks are kept, each prompt extends the last, each dropped block is reported at its
    turn, and a strict conversation refuses the first."""
    from tests.chat_template_corpus import corpus

    tokenizer = load_tokenizer(served.tokenizer.hf.name_or_path)
    tokenizer.hf.chat_template = corpus(unique=False)["trl/qwen3_5_think"]
    start = [{"role": "user", "content": "Hi, café?"}]
    conversation = Conversation.start(tokenizer, start)
    assert conversation.text.endswith("<|im_start|>assistant\n<think>\n")
    sampled: list[int] = []
    async with AsyncClient(served.gateway.addresses[0]) as client:
        text_client = AsyncTextClient(client, tokenizer)
        for turn in range(3):
            prompt = conversation.prompt_ids
            sampling = SamplingParams(max_tokens=10, temperature=0.0)
            done = await text_client.complete(prompt, sampling)
            conversation.add_completion(done)
            assert conversation.token_ids[len(prompt) :] == done.token_ids
            sampled += done.token_ids
            conversation.add_messages([{"role": "user", "content": f"turn {turn}"}])
            assert conversation.token_ids[: len(prompt)] == prompt
    mask = conversation.sampled_mask
    assert [t for t, m in zip(conversation.token_ids, mask, strict=True) if m] == sampled
    dropped = [d for d in conversation.divergences if d.kept.startswith("<think>")]
    assert {d.turn for d in dropped} == {0, 2, 4}  # each prompt's opened block, and more
    assert "<|im_end|><|im_end|>" not in conversation.text
    strict = Conversation.start(tokenizer, start, strict=True)
    first = conversation.turns[1]
    strict.add_completion(conversation.token_ids[first.start : first.end])
    with pytest.raises(TextError, match="strict"):
        strict.add_messages([{"role": "user", "content": "turn 0"}])


async def test_a_stop_string_in_one_sample_aborts_only_that_sample(served: Served) -> None:
    """n = 2: sample 0 meets its stop string early and is stopped in the engine at once
    (AbortSamples); sample 1 runs on to max_tokens."""
    tokenizer = served.tokenizer
    prompt = _prompt(5, tokenizer)
    sampling = SamplingParams(n=2, max_tokens=300, temperature=0.9, seed=7, ignore_eos=True)
    async with AsyncClient(served.gateway.addresses[0]) as client:
        text_client = AsyncTextClient(client, tokenizer)
        free = await text_client.complete_samples(prompt, sampling)
        early = tokenizer.decode(free[0].token_ids[:5], skip_special_tokens=True)
        stop = next(
            early[i : i + 3]
            for i in range(len(early) - 3, -1, -1)
            if early[i : i + 3].strip() and early[i : i + 3] not in free[1].text
        )
        before = (await client.stats()).gateway
        done = await text_client.complete_samples(prompt, sampling, TextParams(stop=[stop]))
        after = (await client.stats()).gateway
    assert done[0].stop_reason == stop and len(done[0].token_ids) <= 5
    assert done[1].token_ids == free[1].token_ids and done[1].finish_reason == FinishReason.LENGTH
    assert after["aborted_by_client"] == before["aborted_by_client"] + 1
    assert after["output_tokens"] - before["output_tokens"] < 450  # not 2 x 300


@contextlib.asynccontextmanager
async def _face_beside_vllm(served: Served) -> AsyncIterator[tuple[Any, Any]]:
    """(face, vllm): JSON clients of a face with the served tokenizer over the gateway, and
    of vLLM's server on the same model."""
    import aiohttp

    from tests.client.http_face.conftest import Http, face_over

    async with (
        face_over(served.gateway, tokenizer=served.tokenizer) as (_, base),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
    ):
        yield Http(session, base), Http(session, f"http://127.0.0.1:{served.server.port}")


def _merged_choices(answer: Any) -> list[tuple]:
    """(index, text, token ids, finish reason, stop reason) of each choice of a completions
    answer, whole or streamed (its SSE events, merged)."""
    if isinstance(answer, dict):
        events = [answer]
    else:
        assert answer[-1] == "[DONE]", answer[-2:]
        events = answer[:-1]
    merged: dict[int, list] = {}
    for event in events:
        for c in event["choices"]:
            m = merged.setdefault(c["index"], [c["index"], "", [], None, None])
            m[1] += c["text"]
            m[2] += c["token_ids"] or []
            if c["finish_reason"]:
                m[3], m[4] = c["finish_reason"], c["stop_reason"]
    return [tuple(merged[i]) for i in sorted(merged)]


async def test_the_http_face_with_a_tokenizer_gives_vllms_text_for_text_prompts(served):
    """``engine-gateway http --tokenizer``: /v1/completions with text prompts (a batch of
    two), text, stop strings and special tokens as vLLM's server gives them, streamed and
    not, greedy and seeded n = 2 (issue 69)."""
    async with _face_beside_vllm(served) as (face, vllm):
        stops = 0
        for seed in range(6):
            prompts = [f"question {seed}: café 日本語 😀?", f"tell {seed} more"]
            n = 2 if seed % 3 == 1 else 1
            sampling = _sampling(seed if n == 1 else 3 * seed, n, {})
            body = {"model": served.server.model, "prompt": prompts, "max_tokens": 30, **sampling}
            status, free = await face.post("/v1/completions", body, headers=None)
            assert status == 200, free
            case = _case(seed, served.tokenizer, free["choices"][0]["text"])
            asked = {**body, **case, "max_tokens": 40, "return_token_ids": True}
            (fs, f_answer), (vs, v_answer) = await asyncio.gather(
                face.post("/v1/completions", asked, headers=None),
                vllm.post("/v1/completions", asked, headers=None),
            )
            assert (fs, vs) == (200, 200), (f_answer, v_answer)
            got, expected = _merged_choices(f_answer), _merged_choices(v_answer)
            assert got == expected, (served.kind, seed, case)
            stops += sum(isinstance(c[4], str) for c in got)
        assert stops >= 4, stops  # the cases do end on stop strings


def _generate_choices(answer: Any) -> list[tuple]:
    """(index, text, token ids, finish reason, stop reason, logprob entries) of each choice
    of a generate answer, whole or streamed; logprobs to 4 decimals."""
    events = [answer] if isinstance(answer, dict) else answer[:-1]
    merged: dict[int, list] = {}
    for event in events:
        for c in event["choices"]:
            m = merged.setdefault(c["index"], [c["index"], "", [], None, None, []])
            m[1] += c["text"]
            m[2] += c["token_ids"] or []
            if c["finish_reason"]:
                m[3], m[4] = c["finish_reason"], c["stop_reason"]
            for e in (c["logprobs"] or {}).get("content") or []:
                tops = [(t["token"], t["bytes"], round(t["logprob"], 4)) for t in e["top_logprobs"]]
                m[5].append((e["token"], e["bytes"], round(e["logprob"], 4), tops))
    return [tuple(merged[i]) for i in sorted(merged)]


async def test_the_http_faces_generate_text_mode_equals_vllm_serves(served):
    """Issue 77 item 15: ``/inference/v1/generate`` with ``output_mode: "text"`` on a face
    with ``--tokenizer`` answers as ``vllm serve`` does: text with its stop strings and
    special-token options, the ids of every token, the chat-shaped logprobs (token text,
    bytes, candidates), streamed and not, greedy and seeded n = 2."""
    async with _face_beside_vllm(served) as (face, vllm):
        stops = 0
        for seed in range(6):
            prompt = _prompt(seed, served.tokenizer)
            n = 2 if seed % 3 == 1 else 1
            sampling = {**_sampling(seed if n == 1 else 3 * seed, n, {}), "max_tokens": 30}
            free_body = {"token_ids": prompt, "sampling_params": sampling, "output_mode": "text"}
            status, free = await face.post("/inference/v1/generate", free_body, headers=None)
            assert status == 200, free
            case = _case(seed, served.tokenizer, free["choices"][0]["text"])
            stream = case.pop("stream")
            text_fields = {k: case[k] for k in ("stop", "include_stop_str_in_output",
                                                 "skip_special_tokens")}  # fmt: skip
            body = {
                **free_body,
                "sampling_params": {**sampling, **text_fields, "max_tokens": 40, "logprobs": 2},
                "stream": stream,
            }
            (fs, f_answer), (vs, v_answer) = await asyncio.gather(
                face.post("/inference/v1/generate", body, headers=None),
                vllm.post("/inference/v1/generate", body, headers=None),
            )
            assert (fs, vs) == (200, 200), (f_answer, v_answer)
            got, expected = _generate_choices(f_answer), _generate_choices(v_answer)
            differ = [
                (i, field, g[field], e[field])
                for i, (g, e) in enumerate(zip(got, expected, strict=True))
                for field in range(6)
                if g[field] != e[field]
            ]
            assert not differ, (served.kind, seed, case, differ)
            stops += sum(isinstance(c[4], str) for c in got)
        assert stops >= 3, stops
