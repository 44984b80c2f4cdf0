"""Token-level stop sequences on the real engine: sequences picked from a greedy run's own
output, checked token for token (streamed and final), with the engine really stopped."""

from __future__ import annotations

import asyncio

import pytest

from client import FinishReason, SamplingParams
from client.results import Accumulator
from tests.helpers import RecordingClient, greedy

pytestmark = pytest.mark.engine
PROMPT = [11, 12, 13, 14]


def expected_cut(tokens, sequences, *, include=False, min_tokens=0, engine_stop_at=None):
    """Reference: vLLM's stop-string rules applied to token ids, one token at a time.

    ``engine_stop_at``: 1-based position where the engine itself stops on a stop token
    (that token is not matched unless included). Returns (tokens, matched sequence or None).
    """
    limit = len(tokens) if engine_stop_at is None else engine_stop_at
    for end in range(1, limit + 1):
        if end <= min_tokens or (end == engine_stop_at and not include):
            continue
        for sequence in sequences:
            if end >= len(sequence) and tokens[end - len(sequence) : end] == sequence:
                return tokens[: end if include else end - len(sequence)], sequence
    return tokens[:limit], None


def first_seen_at(tokens, start, length):
    """A slice of ``tokens`` of ``length`` from ``start`` or later that occurs nowhere earlier,
    so a stop on it cuts exactly there whatever the model's output repeats."""
    for i in range(start, len(tokens) - length + 1):
        piece = tokens[i : i + length]
        if all(tokens[j : j + length] != piece for j in range(i)):
            return i, piece
    pytest.fail(f"every {length}-token slice after {start} repeats an earlier one: {tokens}")


@pytest.fixture
async def client(real_gateway):
    async with RecordingClient(real_gateway.addresses[0], name="stops") as c:
        yield c


async def collect(client, prompt, sampling, *, stream=True, request_id=None):
    """The single sample's Completion, from a streamed or a non-streamed request."""
    acc = Accumulator()
    async for out in client.generate(prompt, sampling, stream=stream, request_id=request_id):
        acc.add(out)
    (completion,) = acc.done.values()
    return completion


async def both_ways(client, prompt, sampling, rid):
    """(streamed completion, non-streamed completion), with the streamed frames checked:
    one terminal, nothing after it, and every token sent is in the final cut."""
    streamed = await collect(client, prompt, sampling, request_id=f"{rid}-s")
    final = await collect(client, prompt, sampling, stream=False, request_id=f"{rid}-f")
    for rid_ in (f"{rid}-s", f"{rid}-f"):
        assert len(client.terminals(rid_)) == 1 and client.outputs_after_terminal(rid_) == 0
    sent = [t for f in client.frames for o in f.outputs if o.request_id == f"{rid}-s"
            for t in o.new_token_ids]  # fmt: skip
    assert sent == streamed.token_ids  # held back, never retracted
    return streamed, final


async def test_stop_sequences_cut_greedy_output_exactly(client, real_gateway):
    reference = (await client.complete(PROMPT, greedy(40))).token_ids
    assert len(reference) == 40
    absent = next([v, v, v] for v in range(512) if v not in reference)
    cases = {
        "first token, length 1": [[reference[0]]],
        "length 3 mid-stream": [reference[10:13]],
        "ends on the last token": [reference[37:40]],
        "never occurs": [absent],
        "two sequences, the earlier wins": [reference[20:24], reference[15:17]],
    }
    for name, sequences in cases.items():
        for include in (False, True):
            sampling = greedy(40, stop_token_sequences=sequences, include_stop_sequence=include)
            want, matched = expected_cut(reference, sequences, include=include)
            for got in await both_ways(client, PROMPT, sampling, f"{name}-{include}"):
                assert got.token_ids == want, (name, include)
                assert got.output_tokens == len(want), (name, include)
                if matched is None:
                    assert got.finish_reason is FinishReason.LENGTH and got.stop_reason is None
                else:
                    assert got.finish_reason is FinishReason.STOP, (name, include)
                    assert got.stop_reason == matched, (name, include)


async def test_overlapping_partial_matches(client):
    """[a, a, b] against a, a, a, b: the match starts at the second a."""
    for first in range(20, 60):
        prompt = [first, first + 1]
        tokens = (await client.complete(prompt, greedy(120))).token_ids
        spots = [
            i
            for i in range(len(tokens) - 3)
            if tokens[i] == tokens[i + 1] == tokens[i + 2] != tokens[i + 3]
        ]
        if spots:
            break
    else:
        pytest.fail("no a, a, a, b run in 40 greedy outputs of the tiny model")
    i = spots[0]
    a, b = tokens[i], tokens[i + 3]
    sequences = [[a, a, b]]
    want, matched = expected_cut(tokens, sequences)
    assert matched == [a, a, b] and len(want) <= i + 1
    for got in await both_ways(client, prompt, greedy(120, stop_token_sequences=sequences), "ov"):
        assert got.token_ids == want and got.stop_reason == [a, a, b]


async def test_the_engine_stops_at_the_match_not_at_max_tokens(client, real_gateway, vllm_engine):
    reference = (await client.complete(PROMPT, greedy(40))).token_ids
    cut, sequence = first_seen_at(reference, 5, 3)
    table = real_gateway.table
    for stream in (True, False):
        late_before = table.stats.late_outputs
        sampling = greedy(400, stop_token_sequences=[sequence])
        got = await collect(client, PROMPT, sampling, stream=stream)
        assert got.token_ids == reference[:cut] and got.finish_reason is FinishReason.STOP
        async with asyncio.timeout(10):
            while await vllm_engine.has_unfinished_requests():
                await asyncio.sleep(0.01)
        # Had the engine run on to max_tokens, ~390 more outputs would have been dropped.
        assert table.stats.late_outputs - late_before <= 10


async def test_min_tokens_eos_stop_ids_and_logprobs_combine_as_vllm_rules_say(client):
    reference = (await client.complete(PROMPT, greedy(30))).token_ids
    # min_tokens: a match must end after the first min_tokens tokens (it may begin earlier).
    sequences = [reference[2:4]]
    want, _ = expected_cut(reference, sequences, min_tokens=3)
    sampling = greedy(30, stop_token_sequences=sequences, min_tokens=3)
    for got in await both_ways(client, PROMPT, sampling, "min"):
        assert got.token_ids == want
    # A stop token id (engine side) before the sequence wins; after it, the sequence wins.
    stop_id = reference[6]
    engine_stop = reference.index(stop_id) + 1
    for sequences in ([reference[3:5]], [reference[10:12]]):
        want, matched = expected_cut(reference, sequences, engine_stop_at=engine_stop)
        sampling = greedy(30, stop_token_sequences=sequences, stop_token_ids=[stop_id])
        for got in await both_ways(client, PROMPT, sampling, f"ids{sequences}"):
            assert got.token_ids == want
            assert got.stop_reason == (matched if matched is not None else stop_id)
    # Logprobs are cut with the tokens.
    cut, sequence = first_seen_at(reference, 12, 2)
    sampling = greedy(30, stop_token_sequences=[sequence], logprobs=2)
    for got in await both_ways(client, PROMPT, sampling, "lp"):
        assert got.token_ids == reference[:cut]
        assert len(got.logprobs.ranks) == cut
        assert [row[0] for row in got.logprobs.token_ids] == reference[:cut]


async def test_stop_sequences_per_sample_with_n(client):
    sampling = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=24, ignore_eos=True)
    samples = await client.complete_samples(PROMPT, sampling)
    sequences = [samples[1].token_ids[4:6]]
    stopped = await client.complete_samples(
        PROMPT,
        SamplingParams(
            temperature=1.0,
            seed=7,
            n=3,
            max_tokens=24,
            ignore_eos=True,
            stop_token_sequences=sequences,
        ),
    )
    for before, after in zip(samples, stopped, strict=True):
        want, matched = expected_cut(before.token_ids, sequences)
        assert after.token_ids == want and after.stop_reason == matched
    assert stopped[1].finish_reason is FinishReason.STOP


async def test_streaming_at_once_sends_the_match_and_the_client_trims(client):
    reference = (await client.complete(PROMPT, greedy(40))).token_ids
    cut, sequence = first_seen_at(reference, 8, 3)
    sampling = greedy(40, stop_token_sequences=[sequence], hold_back_stop_sequences=False)
    raw = []
    async for out in client.generate(PROMPT, sampling, request_id="at-once"):
        raw.extend(out.new_token_ids)
        if out.finished is not None:
            assert out.finished.output_tokens == cut
    assert raw[:cut] == reference[:cut] and len(raw) >= cut  # sent before the match was known
    got = await collect(client, PROMPT, sampling)  # the library trims to output_tokens
    assert got.token_ids == reference[:cut] and got.stop_reason == sequence


async def test_bad_stop_sequences_are_refused_with_their_reason(client, real_gateway):
    from client import RequestFailed
    from codec import ErrorCode

    vocab = real_gateway.engine.info.vocab_size
    limit = real_gateway.table.wire_limits.max_stop_sequence_len
    for sequences, fragment in (
        ([[]], "is empty"),
        ([[1, vocab]], "outside the vocabulary"),
        ([[1] * (limit + 1)], f"max_stop_sequence_len is {limit}"),
    ):
        with pytest.raises(RequestFailed) as info:
            await client.complete(PROMPT, greedy(4, stop_token_sequences=sequences))
        assert info.value.code is ErrorCode.INVALID_REQUEST and fragment in info.value.message
