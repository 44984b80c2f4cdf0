"""The face's pure pieces, value for value: bodies.py's checks and defaults (each refusal
names its field), responses.py's shapes (usage arithmetic, weight spans, logprobs, choices).
Written against a mutation run (issue 77): each assertion kills a changed condition,
constant or operator that the earlier tests let through."""

from __future__ import annotations

import json
import math

import pytest

from client.http_face.bodies import (
    MAX_REQUEST_ID_CHARS,
    HttpError,
    options_from,
    parse_completion,
    parse_generate,
    sampling_from,
)
from client.http_face.replies import Ended
from client.http_face.responses import (
    completion_choice,
    completion_logprobs,
    final_usage,
    finish_reason_name,
    generate_body,
    generate_choice,
    text_logprobs_content,
    usage,
    weight_spans,
)
from client.results import Completion
from codec import FinishReason, Logprobs, WeightVersionSpan


def _refused(call, *args, **kwargs) -> HttpError:  # noqa: ANN001
    """The 400 ``call`` raises, in vLLM's error shape with a message that says something."""
    with pytest.raises(HttpError) as info:
        call(*args, **kwargs)
    error = info.value
    assert error.status == 400, error.message
    assert isinstance(error.message, str) and len(error.message) > 10, error.message
    assert error.body() == {
        "error": {"message": error.message, "type": error.kind, "param": error.param,
                  "code": 400},
    }  # fmt: skip
    return error


def test_error_kinds_follow_the_status_unless_named():
    kinds = {s: HttpError(s, "m").kind for s in (400, 401, 403, 404, 405, 408, 413, 429, 500,
                                                  503, 418)}  # fmt: skip
    assert kinds == {
        400: "BadRequestError", 401: "Unauthorized", 403: "Forbidden", 404: "NotFoundError",
        405: "MethodNotAllowedError", 408: "RequestTimeout", 413: "BadRequestError",
        429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError",
        418: "BadRequestError",
    }  # fmt: skip
    assert HttpError(400, "m", kind="Bad Request").kind == "Bad Request"


def test_bodies_nested_too_deep_are_a_400_not_a_crash():
    deep = b"[" * 100_000 + b"]" * 100_000
    for call, raw in (
        (parse_generate, b'{"token_ids": [1], "sampling_params": {"x": %s}}' % deep),
        (parse_completion, b'{"prompt": %s}' % deep),
    ):
        error = _refused(call, raw)
        assert (error.message, error.kind) == (
            "JSON decode error: nested too deeply",
            "Bad Request",
        )


def _generate(**fields) -> bytes:  # noqa: ANN003
    return json.dumps({"token_ids": [1], "sampling_params": {}, **fields}).encode()


# ---------------------------------------------------------------- generate bodies


def test_generate_defaults_are_vllms():
    body = parse_generate(_generate())
    assert body.stream is False and body.priority == 0 and body.output_mode == "tokens"
    assert body.request_id is None and body.cache_salt is None and body.stream_options is None
    assert body.return_token_ids is None and body.kv_transfer_params is None
    streamed = parse_generate(_generate(stream=True, stream_options={}))
    assert streamed.stream_options.include_usage is False
    assert streamed.stream_options.continuous_usage_stats is False


def test_generate_refusals_name_their_field():
    assert _refused(parse_generate, _generate(token_ids=[])).param == "body.token_ids"
    negative = _refused(parse_generate, _generate(token_ids=[3, -1]))
    assert negative.param == "body.token_ids" and "negative" in negative.message
    assert (negative.kind, _refused(parse_generate, _generate(token_ids=[])).kind) == (
        "Bad Request", "Bad Request")  # fmt: skip
    assert parse_generate(_generate(token_ids=[0, 0])).token_ids == [0, 0]  # id 0 is an id
    missing = _refused(parse_generate, b'{"sampling_params": {}}')
    assert missing.param == "body.token_ids"
    wrong = _refused(parse_generate, _generate(token_ids=["a"]))
    assert wrong.param == "body.token_ids" and wrong.kind == "Bad Request"
    nested = _refused(parse_generate, _generate(stream_options={"include_usage": "x"}))
    assert (
        nested.param == "body.stream_options.include_usage" and "Expected `bool" in nested.message
    )
    for name in ("features", "content_parts", "ec_transfer_params", "reasoning_ended",
                 "reasoning_parser_kwargs"):  # fmt: skip
        assert _refused(parse_generate, _generate(**{name: {}})).param == name
    long_id = _refused(parse_generate, _generate(request_id="x" * (MAX_REQUEST_ID_CHARS + 1)))
    assert long_id.param == "request_id"
    assert parse_generate(_generate(request_id="x" * MAX_REQUEST_ID_CHARS)).request_id
    assert _refused(parse_generate, _generate(output_mode="json")).param == "output_mode"
    text = _refused(parse_generate, _generate(output_mode="text"))
    assert "tokenizer" in text.message
    assert parse_generate(_generate(output_mode="text"), text_output=True).output_mode == "text"
    no_detok = _generate(output_mode="text", sampling_params={"detokenize": False})
    assert _refused(parse_generate, no_detok, text_output=True).param == "output_mode"
    malformed = _refused(parse_generate, b"not json")
    assert (malformed.kind, malformed.param) == ("Bad Request", None)


def test_sampling_values_are_checked_and_mapped():
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
        for value in (math.nan, math.inf, -math.inf):
            refusal = _refused(sampling_from, {name: value})
            assert refusal.param == name and "finite" in refusal.message
        assert getattr(sampling_from({name: 0.5}), name) == 0.5
    assert sampling_from({"detokenize": True}).max_tokens is None  # a boolean: taken
    assert sampling_from({"detokenize": False}).max_tokens is None
    assert sampling_from({"max_tokens": "5", "temperature": 1}).max_tokens == 5  # lax, as vLLM
    assert sampling_from({"temperature": 1}).temperature == 1.0
    assert _refused(sampling_from, {"detokenize": "yes"}).param == "detokenize"
    assert sampling_from({"stop": None}).max_tokens is None  # the unused value
    assert _refused(sampling_from, {"stop": "x"}).param == "stop"
    assert sampling_from({"prompt_logprob_start": 0, "flat_logprobs": False}).n in (None, 1)
    assert sampling_from({"logit_bias": {"3": 1.5, "-0": 2}}).logit_bias == {3: 1.5, 0: 2}
    assert _refused(sampling_from, {"logit_bias": {"x": 1}}).param == "logit_bias"
    bad_n = _refused(sampling_from, {"n": "two"})
    assert (bad_n.param, bad_n.kind) == ("body.sampling_params", "Bad Request")
    assert "sampling_params.n" in bad_n.message


def test_options_are_none_only_when_every_field_is_the_default():
    body = parse_generate(_generate())
    assert options_from(body, None, None) is None
    for changed, lora, key in (
        (parse_generate(_generate(priority=1)), None, None),
        (parse_generate(_generate(cache_salt="s")), None, None),
        (parse_generate(_generate(kv_transfer_params={"a": 1})), None, None),
        (body, "adapter", None),
        (body, None, "session"),
    ):
        options = options_from(changed, lora, key)
        assert options is not None
        assert (options.priority, options.cache_salt, options.lora_name, options.routing_key) == (
            changed.priority, changed.cache_salt, lora, key)  # fmt: skip
        assert options.kv_transfer_params == changed.kv_transfer_params


# ---------------------------------------------------------------- completion bodies


def test_completion_defaults_and_fields():
    body, prompts, fields = parse_completion(b'{"prompt": [4, 5]}')
    assert prompts == [[4, 5]] and fields == {"max_tokens": 16}
    assert body.stream is False and body.priority == 0 and body.n == 1 and body.echo is False
    assert body.logprobs is None and body.stream_options is None
    _, _, fields = parse_completion(b'{"prompt": [4], "max_tokens": 3, "model": "m", "seed": 2}')
    assert fields == {"max_tokens": 3, "seed": 2}  # request fields are not sampling fields
    _, _, fields = parse_completion(b'{"prompt": [4], "n": 2, "logprobs": 1}')
    assert fields == {"n": 2, "logprobs": 1, "max_tokens": 16}
    body, prompts, _ = parse_completion(b'{"prompt": [[0], [0, 1]], "priority": "2"}')
    assert prompts == [[0], [0, 1]] and body.priority == 2  # id 0; lax numbers, as vLLM


def test_completion_refusals_name_their_field():
    cases = {
        b'{"prompt": []}': "prompt",
        b'{"prompt": [[]]}': "prompt",
        b'{"prompt": [[1], []]}': "prompt",
        b'{"prompt": [[1, -2]]}': "prompt",
        b'{"prompt": [-2]}': "prompt",
        b'{"prompt": "text"}': "prompt",
        b'{"prompt": [[1], "text"]}': "prompt",
        b'{"prompt": 5}': "prompt",
        b'{"prompt": [[1.5]]}': "prompt",
        b'{"prompt": [1], "suffix": "x"}': "suffix",
        b'{"prompt": [1], "echo": true}': "echo",
        b'{"prompt": [1], "use_beam_search": true}': "use_beam_search",
        b'{"prompt": [1], "response_format": {}}': "response_format",
        b'{"prompt": [1], "prompt_embeds": "x"}': "prompt_embeds",
        b'{"prompt": [1], "request_id": "%s"}' % (b"r" * 257): "request_id",
    }
    for raw, param in cases.items():
        assert _refused(parse_completion, raw).param == param, raw
    shapes = _refused(parse_completion, b'{"prompt": [[1.5]]}')
    assert shapes.kind == "Bad Request" and "token ids" in shapes.message
    empty = _refused(parse_completion, b'{"prompt": [[]]}')
    assert empty.message == "Prompt cannot be empty"
    assert "empty" in _refused(parse_completion, b'{"prompt": [""]}', text_prompts=True).message
    not_object = _refused(parse_completion, b"[1]")
    assert (not_object.message, not_object.kind) == ("Request body must be a JSON object",
                                                      "Bad Request")  # fmt: skip
    assert _refused(parse_completion, b"{").kind == "Bad Request"
    many = _refused(parse_completion, b'{"prompt": [[1], [2], [3]]}', max_prompts=2)
    assert "3 prompts" in many.message and many.param == "prompt"
    assert len(parse_completion(b'{"prompt": [[1], [2]]}', max_prompts=2)[1]) == 2


# ---------------------------------------------------------------- answers


def test_usage_arithmetic_and_the_final_chunks_form():
    assert usage(7, 3) == {
        "prompt_tokens": 7,
        "total_tokens": 10,
        "completion_tokens": 3,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert final_usage(7, 3) == {"prompt_tokens": 7, "total_tokens": 10, "completion_tokens": 3}


def test_finish_reasons_and_weight_spans():
    names = {r: finish_reason_name(r) for r in FinishReason}
    assert names[FinishReason.STOP] == "stop" and names[FinishReason.LENGTH] == "length"
    assert names[FinishReason.ABORT] == "abort" and names[FinishReason.TIMED_OUT] == "abort"
    spans = [WeightVersionSpan("v1", 0, 3), WeightVersionSpan("v2", 3, 2)]
    assert weight_spans(spans) == [
        {"version": "v1", "start": 0, "end": 3},
        {"version": "v2", "start": 3, "end": 5},
    ]
    assert weight_spans(None) is None


ROWS = Logprobs(token_ids=[[9, 4, 9], [12, 7]], logprobs=[[-1.0, -0.5, -1.0], [-0.1, -3.0]],
                ranks=[2, 1])  # fmt: skip


def test_completion_logprobs_carry_the_logprob_not_the_rank():
    done = completion_logprobs(ROWS, 1, decode=lambda t, _: f"<{t}>")
    assert done["tokens"] == ["<9>", "<12>"]
    assert done["token_logprobs"] == [-1.0, -0.1]
    assert done["top_logprobs"] == [{"<9>": -1.0, "<4>": -0.5}, {"<12>": -0.1, "<7>": -3.0}]
    assert done["text_offset"] == [0, 3]
    floor = Logprobs(token_ids=[[3]], logprobs=[[-math.inf]], ranks=[1])
    assert completion_logprobs(floor, 0)["token_logprobs"] == [-9999.0]


def test_text_logprobs_are_the_chat_shape():
    (first, second) = text_logprobs_content(ROWS, 1, decode=lambda t, _: "é" if t == 9 else str(t))
    assert first == {
        "token": "é",
        "logprob": -1.0,
        "bytes": [195, 169],
        "top_logprobs": [
            {"token": "é", "logprob": -1.0, "bytes": [195, 169]},
        ],
    }
    assert [t["token"] for t in second["top_logprobs"]] == ["12"]
    every = text_logprobs_content(ROWS, -1, decode=lambda t, _: str(t))
    assert [len(e["top_logprobs"]) for e in every] == [2, 2]


def test_generate_choices_and_bodies():
    end = Ended(FinishReason.STOP, 2)
    spans = [WeightVersionSpan("v1", 0, 2)]
    choice = generate_choice(1, [5, 2], end, spans, ROWS, None)
    assert choice == {
        "index": 1,
        "finish_reason": "stop",
        "stop_reason": 2,
        "token_ids": [5, 2],
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": [{"version": "v1", "start": 0, "end": 2}],
        "logprobs": None,
    }
    running = generate_choice(0, [5], None, None, None, 0)
    assert running["finish_reason"] is None and running["stop_reason"] is None
    assert running["logprobs"] == {"content": []} and "text" not in running
    text = generate_choice(0, [5], end, None, None, None, text="hi")
    assert text["text"] == "hi"
    listed = generate_choice(0, [5], Ended(FinishReason.STOP, [4, 5]), None, None, None)
    assert listed["stop_reason"] == 5
    body = generate_body("r", "m", 3, [choice, running], 4, prompt_token_ids=None,
                         kv_transfer_params={"k": 1})  # fmt: skip
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["total_tokens"] == 7
    assert body["output_mode"] == "tokens" and body["kv_transfer_params"] == {"k": 1}
    assert generate_body("r", "m", 3, [], 4, prompt_token_ids=[1], kv_transfer_params=None,
                         text=True)["output_mode"] == "text"  # fmt: skip


def test_a_completions_choice_whole_and_streamed():
    end = Ended(FinishReason.LENGTH, None)
    whole = completion_choice(3, [1, 2], None, end, [7], streamed=False, text="ab")
    assert whole == {
        "index": 3,
        "text": "ab",
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": [1, 2],
        "prompt_logprobs": None,
        "prompt_token_ids": [7],
        "routed_experts": None,
    }
    chunk = completion_choice(0, [1], None, None, None, streamed=True)
    assert chunk == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": [1],
    }


def test_generate_response_of_completions_counts_every_sample():
    from client.http_face.responses import generate_response

    samples = [
        Completion(
            "r",
            i,
            [1] * (i + 2),
            FinishReason.LENGTH,
            None,
            5,
            i + 2,
            0,
            kv_transfer_params={"k": i} if i else None,
        )  # fmt: skip
        for i in range(2)
    ]
    answer = generate_response("r", "m", 1, samples, [1, 2, 3, 4, 5], top_logprobs=None,
                               return_token_ids=True)  # fmt: skip
    assert answer["usage"]["prompt_tokens"] == 5 and answer["usage"]["completion_tokens"] == 5
    assert answer["prompt_token_ids"] == [1, 2, 3, 4, 5]
    assert answer["kv_transfer_params"] == {"k": 1}
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    empty = generate_response("r", "m", 1, [], [1, 2], top_logprobs=None, return_token_ids=False)
    assert empty["usage"]["prompt_tokens"] == 2 and empty["prompt_token_ids"] is None


def test_the_edges_the_mutation_run_found():
    """Boundaries and pass-throughs a changed constant or argument would break."""
    ok, _, _ = parse_completion(b'{"prompt": [1], "request_id": "%s"}' % (b"r" * 256))
    assert len(ok.request_id) == 256
    assert _refused(parse_generate, _generate(output_mode="text")).param == "output_mode"
    assert _refused(parse_completion, b'{"prompt": "x"}').param == "prompt"
    assert _refused(parse_completion, b'{"prompt": [""]}', text_prompts=True).param == "prompt"
    assert _refused(parse_completion, b'{"prompt": [1], "n": "x"}').param == "body.n"
    # A sampled token outside the top-k keeps its own rank; NaN is clamped as -inf is.
    from client.http_face.responses import logprobs_content

    outside = Logprobs(token_ids=[[9, 4, 5]], logprobs=[[math.nan, -0.5, -2.0]], ranks=[3])
    (entry,) = logprobs_content(outside, 1)
    assert (entry["rank"], entry["logprob"]) == (3, -9999.0)
    assert [(t["token_id"], t["rank"]) for t in entry["top_logprobs"]] == [(9, 3)]
    # Text-mode choices: chat-shaped logprobs through decode, placeholders without one.
    end = Ended(FinishReason.STOP, [4, 5, 6])
    text = generate_choice(0, [9, 12], end, None, ROWS, 1, text="x", decode=lambda t, _: f"<{t}>")
    assert text["stop_reason"] == 6
    assert [e["token"] for e in text["logprobs"]["content"]] == ["<9>", "<12>"]
    placeholders = generate_choice(0, [9, 12], end, None, ROWS, 0, text="x")
    assert placeholders["logprobs"]["content"][0]["token"] == "token_id:9"
    assert (
        generate_choice(0, [], Ended(FinishReason.STOP, []), None, None, None)["stop_reason"]
        is None
    )
    # Offsets accumulate each token's length.
    three = Logprobs(token_ids=[[1], [22], [333]], logprobs=[[-1.0], [-1.0], [-1.0]],
                     ranks=[1, 1, 1])  # fmt: skip
    assert completion_logprobs(three, 0, decode=lambda t, _: str(t))["text_offset"] == [0, 1, 3]
    stopped = completion_choice(0, [1], None, Ended(FinishReason.STOP, 7), [3], streamed=True)
    assert (stopped["stop_reason"], stopped["prompt_token_ids"]) == (7, [3])


def test_generate_response_passes_each_completions_fields_through():
    from client.http_face.responses import generate_response

    spans = [WeightVersionSpan("v3", 0, 2)]
    done = Completion("r", 0, [9, 12], FinishReason.STOP, 12, 9, 2, 0, logprobs=ROWS,
                      weight_versions=spans)  # fmt: skip
    answer = generate_response("req", "model", 77, [done], [1, 2, 3], top_logprobs=1,
                               return_token_ids=False)  # fmt: skip
    assert (answer["request_id"], answer["model"], answer["created"]) == ("req", "model", 77)
    assert answer["usage"]["prompt_tokens"] == 9  # the gateway's count, not len(prompt)
    (choice,) = answer["choices"]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", 12)
    assert choice["weight_versions"] == [{"version": "v3", "start": 0, "end": 2}]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == [9, 12]
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 1
