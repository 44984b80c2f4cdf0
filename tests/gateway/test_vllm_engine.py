"""The gateway on the real CPU vLLM EngineCore (one shared per test session).

Correctness is vLLM's own: outputs equal offline ``LLM.generate`` on the same
prompt ids, stop behaviour and validation match vLLM's.
"""

from __future__ import annotations

import asyncio
import functools
import random

import pytest

from client import AsyncClient, FinishReason, RequestFailed, SamplingParams
from codec import ErrorCode, Logprobs, RequestOptions
from gateway.tiny_model import TINY_EOS_TOKEN_IDS, ensure_tiny_model
from tests.conftest import TEST_MAX_MODEL_LEN
from tests.helpers import RecordingClient
from tests.offline_reference import run_offline_reference

pytestmark = pytest.mark.engine
_rng = random.Random(1)


def _prompt(length: int) -> list[int]:
    return [_rng.randrange(4, 512) for _ in range(length)]


# (name, prompt, sampling kwargs shared by the gateway and offline vLLM)
CASES = [
    ("greedy-3", [1, 17, 42], dict(temperature=0.0, max_tokens=24)),
    ("greedy-1", [7], dict(temperature=0.0, max_tokens=16)),
    ("greedy-64", _prompt(64), dict(temperature=0.0, max_tokens=32)),
    ("greedy-300", _prompt(300), dict(temperature=0.0, max_tokens=16)),
    ("near-max-model-len", _prompt(TEST_MAX_MODEL_LEN - 6), dict(temperature=0.0)),
    ("seeded", [3, 4, 5], dict(temperature=1.0, seed=1234, max_tokens=16)),
    (
        "seeded-top-k",
        _prompt(20),
        dict(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=16),
    ),
    ("logprobs", [9, 8, 7, 6], dict(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2)),
    (
        "penalties",
        _prompt(16),
        dict(
            temperature=0.0,
            max_tokens=16,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        ),
    ),
]


# Cases with several samples (n > 1): compared sample by sample.
SAMPLE_CASES = [
    ("n3-seeded", [3, 4, 5], dict(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)),
    ("n2-seeded-logprobs", [9, 8], dict(n=2, temperature=0.8, seed=3, max_tokens=6, logprobs=2)),
    # The model's EOS ids (2, 3) are half of what may be sampled: samples end at them.
    (
        "n3-eos-reachable",
        [3, 4, 5],
        dict(n=3, temperature=1.0, seed=4, max_tokens=12, allowed_token_ids=[2, 3, 7, 9]),
    ),
]


@pytest.fixture(scope="module")
def offline_reference() -> dict[str, dict]:
    """Run vLLM's offline LLM.generate on every case in a subprocess."""
    cases = [{"prompt": p, "sampling": s} for _, p, s in CASES + SAMPLE_CASES]
    results = run_offline_reference(str(ensure_tiny_model()), TEST_MAX_MODEL_LEN, cases, keep=True)
    return {
        name: result for (name, _, _), result in zip(CASES + SAMPLE_CASES, results, strict=True)
    }


@pytest.fixture
async def client(real_gateway):
    async with AsyncClient(real_gateway.addresses[0], name="test") as c:
        yield c


def _assert_logprobs_match(ours: Logprobs, theirs: list[dict[str, float] | None]) -> None:
    rows = [row for row in theirs if row is not None]
    assert len(ours.token_ids) == len(rows)
    for ids, values, row in zip(ours.token_ids, ours.logprobs, rows, strict=True):
        got = dict(zip(ids, values, strict=True))
        assert set(map(int, row)) <= set(got)
        for token, logprob in row.items():
            assert got[int(token)] == pytest.approx(logprob, abs=1e-5)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "final"])
@pytest.mark.parametrize(("name", "prompt", "sampling"), CASES, ids=[c[0] for c in CASES])
async def test_outputs_equal_offline_llm_generate(
    client, offline_reference, name, prompt, sampling, stream
):
    expected = offline_reference[name]
    (want,) = expected["samples"]
    outs = [o async for o in client.generate(prompt, SamplingParams(**sampling), stream=stream)]
    if not stream:
        assert len(outs) == 1
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == want["token_ids"]
    finished = outs[-1].finished
    assert str(finished.finish_reason.name).lower() == want["finish_reason"]
    assert finished.stop_reason == want["stop_reason"]
    assert (finished.prompt_tokens, finished.output_tokens) == (len(prompt), len(tokens))
    if "logprobs" in sampling:
        merged = functools.reduce(Logprobs.concat, [o.logprobs for o in outs], None)
        _assert_logprobs_match(merged, want["logprobs"])
        # Sampled ranks are compared in the seeded n > 1 case: this random bf16 model has
        # near-ties at greedy positions, where a rank may differ with the batch shape.
        merged = functools.reduce(Logprobs.concat, [o.prompt_logprobs for o in outs], None)
        _assert_logprobs_match(merged, expected["prompt_logprobs"])
        assert [ids[0] for ids in merged.token_ids] == prompt[1:]
        assert merged.ranks == expected["prompt_ranks"]


@pytest.mark.parametrize(
    ("name", "prompt", "sampling"), SAMPLE_CASES, ids=[c[0] for c in SAMPLE_CASES]
)
async def test_n_samples_equal_offline_llm_generate_sample_by_sample(
    client, offline_reference, name, prompt, sampling
):
    expected = offline_reference[name]["samples"]
    done = await client.complete_samples(prompt, SamplingParams(**sampling))
    assert [c.index for c in done] == list(range(sampling["n"]))
    for got, want in zip(done, expected, strict=True):
        assert got.token_ids == want["token_ids"]
        assert got.finish_reason.name.lower() == want["finish_reason"]
        if want["logprobs"] is not None:
            _assert_logprobs_match(got.logprobs, want["logprobs"])
            assert got.logprobs.ranks == want["ranks"]


async def test_near_max_model_len_defaults_max_tokens_to_the_rest_of_the_context(client):
    prompt = _prompt(TEST_MAX_MODEL_LEN - 6)
    done = await client.complete(prompt, SamplingParams(temperature=0.0, ignore_eos=True))
    assert done.output_tokens == 6 and done.finish_reason is FinishReason.LENGTH


async def test_seeded_sampling_gives_the_same_tokens_twice(client):
    sampling = SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True)
    first = await client.complete([5, 6, 7], sampling)
    second = await client.complete([5, 6, 7], sampling)
    other = await client.complete(
        [5, 6, 7], SamplingParams(temperature=1.0, seed=100, max_tokens=24, ignore_eos=True)
    )
    assert first.token_ids == second.token_ids
    assert other.token_ids != first.token_ids


async def test_n_samples_stream_with_indexes_and_seeds_per_sample(client):
    sampling = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    first = await client.complete_samples([11, 12], sampling)
    second = await client.complete_samples([11, 12], sampling)
    assert [c.index for c in first] == [0, 1, 2]
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert len({tuple(c.token_ids) for c in first}) == 3  # seed + i per sample
    single = await client.complete(
        [11, 12], SamplingParams(temperature=1.0, seed=6, max_tokens=8, ignore_eos=True)
    )
    assert single.token_ids == first[1].token_ids  # sample 1 used seed 5 + 1


@pytest.mark.parametrize("eos", TINY_EOS_TOKEN_IDS)
async def test_each_eos_id_from_the_generation_config_stops_the_request(client, eos):
    done = await client.complete(
        [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0})
    )
    assert done.token_ids == [eos]
    assert done.finish_reason is FinishReason.STOP and done.stop_reason == eos


async def test_ignore_eos_runs_to_max_tokens(client):
    done = await client.complete(
        [1, 2, 3],
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={2: 100.0}),
    )
    assert done.token_ids == [2] * 5 and done.finish_reason is FinishReason.LENGTH
    assert done.stop_reason is None


async def test_min_tokens_holds_eos_back(client):
    done = await client.complete(
        [1, 2, 3],
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4, logit_bias={2: 100.0}),
    )
    assert len(done.token_ids) == 5 and done.token_ids[-1] == 2
    assert not set(done.token_ids[:4]) & set(TINY_EOS_TOKEN_IDS)
    assert done.finish_reason is FinishReason.STOP


async def test_stop_token_ids_stop_at_the_first_occurrence(client):
    prompt = [40, 41, 42, 43]
    free = await client.complete(
        prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    )
    k = next(k for k in range(2, 16) if free.token_ids[k] not in free.token_ids[:k])
    stop = free.token_ids[k]
    done = await client.complete(
        prompt,
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop]),
    )
    assert done.token_ids == free.token_ids[: k + 1]
    assert done.finish_reason is FinishReason.STOP and done.stop_reason == stop


async def test_max_tokens_caps_the_output(client):
    done = await client.complete(
        [9], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    )
    assert len(done.token_ids) == 3 and done.finish_reason is FinishReason.LENGTH


async def test_allowed_token_ids_and_bad_words(client):
    done = await client.complete(
        [9],
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=[77, 78]),
    )
    assert set(done.token_ids) <= {77, 78}
    free = await client.complete(
        [9, 10], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    )
    banned = await client.complete(
        [9, 10],
        SamplingParams(
            temperature=0.0,
            max_tokens=4,
            ignore_eos=True,
            bad_words_token_ids=[[free.token_ids[0]]],
        ),
    )
    assert banned.token_ids[0] != free.token_ids[0]


async def test_64_concurrent_requests_from_three_clients_two_sharing_request_ids(real_gateway):
    address = real_gateway.addresses[0]
    plans = {"a": (101, 22, 6), "b": (202, 22, 9), "c": (303, 20, 7)}  # forced token, count, len

    async def run_client(name: str) -> list:
        token, count, length = plans[name]
        prefix = "c" if name == "c" else "q"  # a and b use the same request ids
        async with RecordingClient(address, name=name) as c:

            async def one(i: int):
                sampling = SamplingParams(
                    temperature=0.0, max_tokens=length, ignore_eos=True, allowed_token_ids=[token]
                )
                outs = [
                    o
                    async for o in c.generate(
                        [i + 4, 5], sampling, stream=i % 2 == 0, request_id=f"{prefix}{i}"
                    )
                ]
                return f"{prefix}{i}", outs

            results = await asyncio.gather(*(one(i) for i in range(count)))
            await asyncio.sleep(0.2)  # a stray output after a terminal would arrive by now
            # From the raw frames: one terminal per request, nothing after it.
            for request_id, _ in results:
                assert len(c.terminals(request_id)) == 1, request_id
                assert c.outputs_after_terminal(request_id) == 0, request_id
            return results

    results = await asyncio.gather(*(run_client(n) for n in plans))
    assert sum(len(r) for r in results) == 64
    for name, per_client in zip(plans, results, strict=True):
        token, _, length = plans[name]
        for request_id, outs in per_client:
            assert all(o.request_id == request_id for o in outs)
            assert outs[-1].finished.finish_reason is FinishReason.LENGTH
            assert [t for o in outs for t in o.new_token_ids] == [token] * length


VLLM_SAYS = "<what vLLM's own SamplingParams answers for these values>"


def vllm_sampling_error(sampling: dict) -> str:
    """The message vLLM's own SamplingParams raises for ``sampling`` (the frontend's check)."""
    from vllm.sampling_params import SamplingParams as VllmSamplingParams

    try:
        VllmSamplingParams(**sampling)
    except Exception as exc:  # vLLM raises ValueError subclasses
        return str(exc)
    raise AssertionError(f"vLLM accepts {sampling}")


VALIDATION = [
    ([600], {}, None, "Token id 600 is out of vocabulary"),
    ([], {}, None, "The decoder prompt cannot be empty"),
    ([1] * TEST_MAX_MODEL_LEN, {}, None, "maximum model length of 512"),
    ([1] * (TEST_MAX_MODEL_LEN + 5), {}, None, "max_prompt_tokens (512)"),
    ([1], dict(temperature=-1.0), None, VLLM_SAYS),
    ([1], dict(top_p=0.0), None, VLLM_SAYS),
    ([1], dict(max_tokens=0), None, VLLM_SAYS),
    ([1], dict(min_tokens=5, max_tokens=2), None, VLLM_SAYS),
    ([1], dict(seed=2**64 - 1), None, "seed must be between"),
    ([1], dict(n=2, seed=2**63 - 1), None, "seed + n - 1 must be at most"),
    ([1], dict(logprobs=50), None, "greater than max allowed: 20"),
    ([1], dict(n=100_000), None, "max_num_seqs"),
    ([1], dict(logit_bias={600: 1.0}), None, "out-of-vocab"),
    ([1], dict(allowed_token_ids=[]), None, "allowed_token_ids is not None and empty"),
    ([1], dict(allowed_token_ids=[512]), None, "allowed_token_ids contains out-of-vocab"),
    ([1], dict(bad_words_token_ids=[[600]]), None, "vocabulary size is 512"),
    ([1], dict(stop_token_ids=[-3]), None, "stop_token_ids"),  # InputProcessor's check
    ([1], {}, RequestOptions(lora_name="nope"), "LoRA adapter 'nope' is not loaded"),
    ([1], {}, RequestOptions(data_parallel_rank=3), "data_parallel_rank 3 is out of range"),
]


@pytest.mark.parametrize(
    ("prompt", "sampling", "options", "message"),
    VALIDATION,
    ids=[str(v[1] or v[2] or v[0][:3])[:40] for v in VALIDATION],
)
async def test_each_validation_failure_gives_its_error_while_others_are_served(
    real_gateway, client, prompt, sampling, options, message
):
    async with AsyncClient(real_gateway.addresses[0], name="bystander") as other:
        bystander = asyncio.ensure_future(
            other.complete([5, 6], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        )
        with pytest.raises(RequestFailed) as info:
            await client.complete_samples(prompt, SamplingParams(**sampling), options=options)
        expected = (
            ErrorCode.UNSUPPORTED if options and options.lora_name else ErrorCode.INVALID_REQUEST
        )
        assert info.value.code is expected
        if message is VLLM_SAYS:
            assert info.value.message == vllm_sampling_error(sampling)
        else:
            assert message in info.value.message
        assert (await bystander).output_tokens == 12
    assert real_gateway.table.live_requests == 0


# Exactly four tokens whatever the model samples: unseeded sampling may draw an EOS id.
FOUR_TOKENS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


async def test_vllm_output_task_receives_through_the_loops_watch_of_its_socket(vllm_engine, client):
    """The adapter made vLLM's engine-output socket a LoopWatchedSocket before vLLM's
    output task first received (this pins that structure of the supported vLLM range)."""
    from gateway.loop_watched_socket import LoopWatchedSocket

    sock = vllm_engine._client.resources.output_socket
    assert type(sock) is LoopWatchedSocket
    outs = [o async for o in client.generate([5, 6, 7], FOUR_TOKENS)]
    assert sum(len(o.new_token_ids) for o in outs) == 4
    # The output task waited on the descriptor from this loop: nothing went through
    # pyzmq's own receive (which would have registered its reader and loop instead).
    assert sock._watch_loop is asyncio.get_running_loop()
    assert sock._current_loop is None


async def test_each_step_is_handled_inside_vllms_output_task(vllm_engine, real_gateway, client):
    """run_outputs hands each step to the gateway inside vLLM's output task, through the
    shadowed put_nowait of vLLM's outputs queue (pins that structure of vLLM's client)."""
    queue = vllm_engine._client.outputs_queue
    assert type(queue) is asyncio.Queue and "put_nowait" in vars(queue)
    table = real_gateway.table
    handled_in: list[str] = []

    def on_step(outputs, now, weight_version=None):
        handled_in.append(asyncio.current_task().get_name())
        return type(table).on_step(table, outputs, now, weight_version)

    table.on_step = on_step
    try:
        outs = [o async for o in client.generate([5, 6, 7], FOUR_TOKENS)]
    finally:
        del table.on_step
    assert sum(len(o.new_token_ids) for o in outs) == 4
    assert handled_in and set(handled_in) == {"EngineCoreOutputQueueTask"}
    assert queue.empty()  # nothing is left queued for a get_output nobody calls
