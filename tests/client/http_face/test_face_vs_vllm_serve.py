"""The HTTP face answers as ``vllm serve`` does, route by route (issue 69 item 2): the same
bodies to both, on the same tiny model, and the answers compared field by field (token
ids, finish and stop reasons, logprobs, weight versions, usage, status and error shape)."""

from __future__ import annotations

import asyncio
import copy
import itertools
from typing import Any

import pytest

from tests.client.http_face.conftest import AUTH, in_framework_venv
from tests.conftest import TEST_MAX_MODEL_LEN

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_tokens": 8}
SAME_BODIES = {
    "greedy": {"token_ids": [5, 6, 7], "sampling_params": GREEDY},
    "greedy-logprobs": {
        "token_ids": [5, 6, 7],
        "sampling_params": {**GREEDY, "logprobs": 3},
    },
    "logprobs-0": {"token_ids": [9, 4], "sampling_params": {**GREEDY, "logprobs": 0}},
    "seeded-n2-logprobs": {
        "token_ids": [11, 12, 13, 14],
        "sampling_params": {"temperature": 0.9, "seed": 7, "n": 2, "max_tokens": 6, "logprobs": 2},
    },
    "seeded-topk-topp": {
        "token_ids": [30, 31],
        "sampling_params": {
            "temperature": 1.2,
            "top_k": 20,
            "top_p": 0.8,
            "seed": 3,
            "max_tokens": 10,
        },
    },
    "stop-token": {
        "token_ids": [5, 6, 7],
        "sampling_params": {**GREEDY, "stop_token_ids": [448], "max_tokens": 20},
    },
    "ignore-eos-min-tokens": {
        "token_ids": [40, 41, 42],
        "sampling_params": {**GREEDY, "ignore_eos": True, "min_tokens": 4},
    },
    "penalties-bias": {
        "token_ids": [7, 7, 7, 7],
        "sampling_params": {
            **GREEDY,
            "repetition_penalty": 1.3,
            "presence_penalty": 0.5,
            "logit_bias": {"84": -100.0},
        },
    },
    "renderers-body": {  # what renderers 0.1.12 sends for verifiers
        "model": None,
        "token_ids": [1, 20, 21, 22],
        "sampling_params": {
            "temperature": 1.0,
            "max_tokens": 6,
            "seed": 11,
            "stop_token_ids": [2],
            "logprobs": 1,
            "skip_special_tokens": False,
        },
        "cache_salt": "episode-1",
        "priority": 0,
    },
    "skyrl-trainer-body": {  # SkyRL 0.3.0's get_sampling_params_for_backend("vllm", ...)
        "token_ids": [5, 6, 7],
        "sampling_params": {
            "min_tokens": 1,
            "skip_special_tokens": True,
            "include_stop_str_in_output": True,
            "max_tokens": 8,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "logprobs": 0,
            "stop": None,
        },
    },
    "request-id-and-prompt-ids": {
        "request_id": "mine-1",
        "return_token_ids": True,
        "token_ids": [5, 6],
        "sampling_params": {**GREEDY, "max_tokens": 3},
    },
    "unknown-fields-ignored": {
        "token_ids": [5, 6],
        "bogus": 1,
        "sampling_params": {**GREEDY, "max_tokens": 3, "not_a_field": True},
    },
}
BAD_BODIES = {
    "empty-prompt": {"token_ids": [], "sampling_params": GREEDY},
    "negative-id": {"token_ids": [5, -1], "sampling_params": GREEDY},
    "ids-not-a-list": {"token_ids": "x", "sampling_params": GREEDY},
    "no-sampling-params": {"token_ids": [5]},
    "greedy-n2": {"token_ids": [5], "sampling_params": {**GREEDY, "n": 2}},
    "negative-temperature": {"token_ids": [5], "sampling_params": {"temperature": -1}},
    "zero-max-tokens": {"token_ids": [5], "sampling_params": {"max_tokens": 0}},
    "max-tokens-a-string": {"token_ids": [5], "sampling_params": {"max_tokens": "a"}},
    "top-p-zero": {"token_ids": [5], "sampling_params": {"top_p": 0.0}},
    "unknown-model": {"token_ids": [5], "sampling_params": GREEDY, "model": "nosuch"},
    "prompt-over-max-model-len": {"token_ids": [5] * 2100, "sampling_params": GREEDY},
    "empty-cache-salt": {"token_ids": [5], "sampling_params": GREEDY, "cache_salt": ""},
}


async def _both(servers: dict, path: str, *args: Any, **kwargs: Any) -> tuple:
    """The same call to vllm serve and to the face, at once: ((status, answer), ...)."""
    return await asyncio.gather(
        servers["vllm"].post(path, *args, **kwargs), servers["face"].post(path, *args, **kwargs)
    )


def _without_face_tokens(value: Any) -> Any:
    """The face's answer less the ``token`` it adds to each logprob entry (checked here:
    ``token_id:N`` of the entry's own id), and less the request's random id and time."""
    if isinstance(value, dict):
        if "token_id" in value and "token" in value:
            assert value["token"] == f"token_id:{value['token_id']}", value
        return {
            k: _without_face_tokens(v)
            for k, v in value.items()
            if not (k == "token" and "token_id" in value)
        }
    if isinstance(value, list):
        return [_without_face_tokens(v) for v in value]
    return value


def _comparable(body: Any) -> Any:
    body = copy.deepcopy(body)
    if isinstance(body, dict):
        if "request_id" in body:
            assert body["request_id"].startswith("generate-tokens-"), body["request_id"]
            body["request_id"] = body["request_id"] if "mine" in body["request_id"] else "*"
        body.pop("created", None)
    return body


def _merged_stream(events: list[Any]) -> dict[str, Any]:
    """An SSE answer as per-choice totals (engines may split steps into other chunks)."""
    assert events[-1] == "[DONE]", events[-3:]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    first_prompt_ids = [e.get("prompt_token_ids") for e in events[:-1] if "prompt_token_ids" in e]
    for event in events[:-1]:
        if not event["choices"]:
            usage = event["usage"]
            continue
        (choice,) = event["choices"]
        total = choices.setdefault(
            choice["index"], {"token_ids": [], "logprobs": [], "finish_reason": None}
        )
        total["token_ids"] += choice["token_ids"]
        if choice["logprobs"] is not None:
            total["logprobs"] += choice["logprobs"]["content"]
        if choice["finish_reason"] is not None:
            assert total["finish_reason"] is None, "two terminal chunks for one choice"
            total["finish_reason"] = choice["finish_reason"]
            total["stop_reason"] = choice["stop_reason"]
            total["weight_versions"] = choice["weight_versions"]
        else:
            assert choice["weight_versions"] is None
    return {"choices": choices, "usage": usage, "prompt_ids": first_prompt_ids}


@pytest.mark.parametrize("name", list(SAME_BODIES))
async def test_generate_answers_as_vllm_serve(servers, name):
    body = SAME_BODIES[name]
    (vs, v_body), (fs, f_body) = await _both(servers, "/inference/v1/generate", body)
    assert (fs, vs) == (200, 200), (f_body, v_body)
    assert _comparable(_without_face_tokens(f_body)) == _comparable(v_body)
    if body["sampling_params"].get("logprobs") is not None:  # renderers' check passes
        for choice in f_body["choices"]:
            tokens = [e["token"] for e in choice["logprobs"]["content"]]
            assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]


@pytest.mark.parametrize(
    "name", ["greedy-logprobs", "seeded-n2-logprobs", "request-id-and-prompt-ids"]
)
async def test_streamed_generate_answers_as_vllm_serve(servers, name):
    body = {
        **SAME_BODIES[name],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    (vs, v_events), (fs, f_events) = await _both(servers, "/inference/v1/generate", body)
    assert (fs, vs) == (200, 200)
    face, vllm = _merged_stream(_without_face_tokens(f_events)), _merged_stream(v_events)
    assert face == vllm
    assert face["usage"]["completion_tokens"] == sum(
        len(c["token_ids"]) for c in face["choices"].values()
    )
    # Equal to the same request unstreamed, too.
    _, whole = await servers["face"].post("/inference/v1/generate", SAME_BODIES[name])
    for choice in whole["choices"]:
        assert face["choices"][choice["index"]]["token_ids"] == choice["token_ids"]


@pytest.mark.parametrize("name", list(BAD_BODIES))
async def test_bad_bodies_get_vllm_serve_status_and_error_shape(servers, name):
    body = BAD_BODIES[name]
    (vs, v_body), (fs, f_body) = await _both(servers, "/inference/v1/generate", body)
    assert fs == vs and 400 <= fs < 500, (f_body, v_body)
    assert set(f_body) == {"error"} and set(f_body["error"]) == set(v_body["error"])
    assert (f_body["error"]["code"], f_body["error"]["type"]) == (
        v_body["error"]["code"],
        v_body["error"]["type"],
    ), (f_body, v_body)
    if v_body["error"]["param"] is not None:
        assert f_body["error"]["param"] == v_body["error"]["param"], (f_body, v_body)


async def test_malformed_json_and_no_token_are_refused_as_vllm_serve(servers):
    for raw in (b"nope", b"{", b"[1, 2]"):
        (vs, v_body), (fs, f_body) = await _both(servers, "/inference/v1/generate", raw=raw)
        assert fs == vs == 400 and f_body["error"]["type"] == v_body["error"]["type"], raw
    body = SAME_BODIES["greedy"]
    for headers in (None, {"Authorization": "Bearer wrong"}):
        (vs, _), (fs, f_body) = await _both(
            servers, "/inference/v1/generate", body, headers=headers
        )
        assert fs == vs == 401, f_body


async def test_models_route_as_vllm_serve(servers):
    (vs, v_body), (fs, f_body) = await asyncio.gather(
        servers["vllm"].get("/v1/models"), servers["face"].get("/v1/models")
    )
    assert fs == vs == 200
    (v_card,), (f_card,) = v_body["data"], f_body["data"]
    for key in ("id", "object", "owned_by", "root", "parent", "max_model_len"):
        assert f_card[key] == v_card[key], key
    assert set(f_card) == set(v_card)


async def test_out_of_vocabulary_ids_are_refused_and_every_other_stream_runs_on(servers):
    """vLLM 0.32's generate route passes an id past the vocabulary to its engine, which dies
    of it (HTTP 500, then every request fails): the face refuses it with a 400 naming it."""
    face = servers["face"]
    long = {
        "token_ids": [3, 4],
        "stream": True,
        "sampling_params": {**GREEDY, "max_tokens": 200, "ignore_eos": True},
    }
    running = asyncio.ensure_future(face.post("/inference/v1/generate", long))
    status, body = await face.post(
        "/inference/v1/generate", {"token_ids": [5, 100000], "sampling_params": GREEDY}
    )
    assert status == 400 and "100000" in body["error"]["message"], body
    status, events = await running
    assert status == 200 and _merged_stream(events)["choices"][0]["finish_reason"] == "length"
    assert len(_merged_stream(events)["choices"][0]["token_ids"]) == 200


async def test_unserved_fields_are_refused_by_name(servers):
    face = servers["face"]
    cases = {
        "structured_outputs": {"sampling_params": {**GREEDY, "structured_outputs": {"json": {}}}},
        "stop": {"sampling_params": {**GREEDY, "stop": ["x"]}},
        "features": {"features": {"mm_hashes": {}, "mm_placeholders": {}}},
        "output_mode": {"output_mode": "text"},
        "repetition_detection": {"sampling_params": {**GREEDY, "repetition_detection": {"x": 1}}},
    }
    for field, change in cases.items():
        body = {"token_ids": [5, 6], "sampling_params": GREEDY, **change}
        status, answer = await face.post("/inference/v1/generate", body)
        assert status == 400 and field in answer["error"]["message"], (field, answer)


async def test_abort_requests_by_the_id_answered(servers):
    face, state = servers["face"], servers["face_state"]
    long = {
        "request_id": "to-abort",
        "token_ids": [3, 4],
        "sampling_params": {**GREEDY, "max_tokens": 1500, "ignore_eos": True},
    }
    running = asyncio.ensure_future(face.post("/inference/v1/generate", long))
    async with asyncio.timeout(30):
        while not any(
            answer_id == "generate-tokens-to-abort" and all(s.started for s in streams)
            for (_, answer_id), streams in state.live.items()
        ):
            await asyncio.sleep(0.02)
    status, answer = await face.post(
        "/inference/v1/abort_requests", {"request_ids": ["generate-tokens-to-abort"]}
    )
    assert (status, answer) == (200, {"status": "aborted", "aborted": 1})
    status, body = await running
    (choice,) = body["choices"]
    assert status == 200 and choice["finish_reason"] == "abort", body
    assert len(choice["token_ids"]) < 1500


async def test_a_client_that_leaves_mid_stream_aborts_its_request(servers):
    """An HTTP client gone mid-stream: the face aborts the request (the gateway confirms:
    nothing of it is left live), and another stream runs on to its end."""
    import aiohttp

    face, gateway = servers["face"], servers["gateway"]
    long = {
        "token_ids": [8, 9],
        "stream": True,
        "sampling_params": {**GREEDY, "max_tokens": 1500, "ignore_eos": True},
    }
    other = asyncio.ensure_future(
        face.post(
            "/inference/v1/generate",
            {**long, "sampling_params": {**long["sampling_params"], "max_tokens": 300}},
        )
    )
    url = face.base + "/inference/v1/generate"
    async with (
        aiohttp.ClientSession() as leaving,
        leaving.post(url, json=long, headers=AUTH) as response,
    ):
        assert response.status == 200
        await response.content.readline()  # the first chunk: it runs
    async with asyncio.timeout(30):  # the one left: aborted; the other: still running
        while gateway.table.live_requests > 1:
            await asyncio.sleep(0.05)
    status, events = await other
    assert status == 200 and len(_merged_stream(events)["choices"][0]["token_ids"]) == 300
    async with asyncio.timeout(10):
        while gateway.table.live_requests:
            await asyncio.sleep(0.05)


COMPLETIONS = {
    "batch-seeded-n2": {
        "prompt": [[5, 6, 7], [8, 9]],
        "n": 2,
        "temperature": 0.8,
        "seed": 1,
        "max_tokens": 5,
        "return_token_ids": True,
    },
    "one-prompt-greedy-default-length": {"prompt": [5, 6, 7], "temperature": 0.0},
    "stop-token-ids": {
        "prompt": [[5, 6, 7]],
        "temperature": 0.0,
        "max_tokens": 20,
        "stop_token_ids": [448],
        "return_token_ids": True,
    },
}


def _comparable_completion(body: dict) -> dict:
    body = copy.deepcopy(body)
    assert body.pop("id").startswith("cmpl-")
    for key in ("created", "system_fingerprint"):
        body.pop(key)
    return body


@pytest.mark.parametrize("name", list(COMPLETIONS))
async def test_completions_with_token_id_prompts_answer_as_vllm_serve(servers, name):
    model = servers["face_state"].model_name
    body = {"model": model, **COMPLETIONS[name]}
    (vs, v_body), (fs, f_body) = await _both(servers, "/v1/completions", body)
    assert (fs, vs) == (200, 200), (f_body, v_body)
    assert _comparable_completion(f_body) == _comparable_completion(v_body)
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    (vs, v_events), (fs, f_events) = await _both(servers, "/v1/completions", streamed)
    assert (fs, vs) == (200, 200)

    def merged(events: list) -> tuple[dict, dict]:
        assert events[-1] == "[DONE]"
        choices: dict = {}
        for event in events[:-1]:
            for c in event["choices"]:
                total = choices.setdefault(c["index"], {"token_ids": [], "prompt": None})
                total["token_ids"] += c["token_ids"] or []
                total["prompt"] = total["prompt"] or c["prompt_token_ids"]
                if c["finish_reason"]:
                    total["end"] = (c["finish_reason"], c["stop_reason"])
        return choices, events[-2]["usage"]

    assert merged(f_events) == merged(v_events)


async def test_completion_logprobs_are_trls_shape_and_the_generate_routes_values(servers):
    """vLLM's completions route needs a tokenizer for logprobs (TRL asks for
    return_tokens_as_token_ids); the face answers with ``token_id:N`` tokens, the values
    of the generate route (equal to vllm serve's, above), ``logprobs + 1`` candidates."""
    face = servers["face"]
    body = {"prompt": [[11, 12, 13, 14]], "n": 2, "temperature": 0.9, "seed": 7, "max_tokens": 6}
    status, answer = await face.post(
        "/v1/completions",
        {**body, "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    assert status == 200, answer
    sampling = {k: body[k] for k in ("n", "temperature", "seed", "max_tokens")}
    _, generated = await face.post(
        "/inference/v1/generate",
        {"token_ids": body["prompt"][0], "sampling_params": {**sampling, "logprobs": 2}},
    )
    for choice, same in zip(answer["choices"], generated["choices"], strict=True):
        content = same["logprobs"]["content"]
        logprobs = choice["logprobs"]
        assert choice["token_ids"] == same["token_ids"]
        assert logprobs["tokens"] == [f"token_id:{t}" for t in same["token_ids"]]
        assert logprobs["token_logprobs"] == [e["logprob"] for e in content]
        for tops, entry in zip(logprobs["top_logprobs"], content, strict=True):
            assert len(tops) == 3 and tops[f"token_id:{entry['token_id']}"] == entry["logprob"]
        assert logprobs["text_offset"][0] == 0


async def test_text_prompts_are_refused_without_a_tokenizer(servers):
    body = {"prompt": "hello", "max_tokens": 2}
    (vs, _), (fs, f_body) = await _both(servers, "/v1/completions", body)
    assert fs == vs == 400 and "tokenizer" in f_body["error"]["message"]


def _run_verifiers_rollout(target: str, model: str) -> dict:
    from gateway.tiny_model import ensure_tiny_tokenizer

    tokenizer = str(ensure_tiny_tokenizer())
    native = not target.startswith("http")
    return in_framework_venv(
        ".venv-verifiers", "verifiers_rollout.py", target, tokenizer, model, our_client=native
    )


async def test_verifiers_train_client_unchanged_over_three_turns_with_tool_messages(servers):
    """verifiers 0.4.0's TrainClient (renderers 0.1.12), as released, against the face:
    three turns, each with the tool's answer appended; its parsed ids and logprobs equal
    vllm serve's for the same generate bodies (which renderers itself cannot read from vllm
    serve 0.32: its logprob entries lack ``token``), and offline vLLM's on the same ids."""
    from gateway.tiny_model import ensure_tiny_model
    from tests.offline_reference import run_offline_reference

    model = servers["face_state"].model_name
    face_run, vllm_run, native_run = await asyncio.gather(
        asyncio.to_thread(_run_verifiers_rollout, servers["face"].base, model),
        asyncio.to_thread(_run_verifiers_rollout, servers["vllm"].base, model),
        asyncio.to_thread(_run_verifiers_rollout, servers["gateway"].addresses[0], model),
    )
    # The native adapter (client.frameworks.verifiers, issue 70): the same rollout, id for
    # id, over the socket.
    refused_type, status, message = native_run.pop("refused")
    assert (refused_type, status) == ("BadRequestError", 400) and "1000000" in message
    unknown_type, status, message = native_run.pop("unknown_model")
    assert (unknown_type, status) == ("NotFoundError", 404), message
    assert f"the gateway serves `{model}`" in message
    assert native_run == face_run, native_run
    assert vllm_run["error"] == "MalformedGenerateResponseError", vllm_run
    assert "token_id:" in vllm_run["message"]
    turns = face_run["turns"]
    assert len(turns) == 3, face_run
    for before, after in itertools.pairwise(turns):  # each turn's prompt extends the last
        assert after["prompt_ids"][: len(before["prompt_ids"])] == before["prompt_ids"]
    sampling = {
        "temperature": 0.0,
        "max_tokens": 12,
        "stop_token_ids": face_run["stop_token_ids"],
        "logprobs": 1,
        "skip_special_tokens": False,
    }
    offline = await asyncio.to_thread(
        run_offline_reference,
        str(ensure_tiny_model()),
        TEST_MAX_MODEL_LEN,
        [{"prompt": t["prompt_ids"], "sampling": sampling} for t in turns],
        keep=True,
    )
    for turn, reference in zip(turns, offline, strict=True):
        body = {"token_ids": turn["prompt_ids"], "sampling_params": sampling}
        status, answer = await servers["vllm"].post("/inference/v1/generate", body)
        assert status == 200, answer
        (choice,) = answer["choices"]
        assert turn["completion_ids"] == choice["token_ids"] != []
        assert turn["completion_logprobs"] == [e["logprob"] for e in choice["logprobs"]["content"]]
        (sample,) = reference["samples"]
        assert turn["completion_ids"] == sample["token_ids"]


async def test_trl_vllm_client_unchanged_generates_and_resets_the_prefix_cache(servers):
    """TRL 1.16's VLLMClient, as released (one line added: the operator's token for the
    control route), on a face whose data routes are open: two token-id prompts, n = 2
    seeded samples, logprobs; the samples equal vllm serve's for the same completions body,
    and TRL parsed the face's logprobs (the generate route's values, equal to vllm serve's:
    above); reset_prefix_cache and TRL's server-info fields answer."""
    from tests.client.http_face.conftest import TOKEN, face_over

    async with face_over(servers["gateway"], api_key=TOKEN, open_data_routes=True) as (_, base):
        trl = await asyncio.to_thread(in_framework_venv, ".venv-trl", "trl_client.py", base)
    assert "error" not in trl, trl
    assert trl["prompt_ids"] == [[5, 6, 7], [8, 9]] and len(trl["completion_ids"]) == 4
    body = {
        "model": trl["model"],
        "prompt": trl["prompt_ids"],
        "n": 2,
        "temperature": 0.9,
        "max_tokens": 6,
        "seed": 5,
        "return_token_ids": True,
    }
    status, answer = await servers["vllm"].post("/v1/completions", body)
    assert status == 200, answer
    assert trl["completion_ids"] == [c["token_ids"] for c in answer["choices"]]
    # TRL parsed the logprobs the face sent (the same body again: the same batch, so the
    # same numerics; the tiny model's near-ties can flip between batch shapes).
    status, again = await servers["face"].post("/v1/completions", {**body, "logprobs": 1})
    assert status == 200 and trl["completion_ids"] == [c["token_ids"] for c in again["choices"]]
    for choice in again["choices"]:
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        for position, top in enumerate(logprobs["top_logprobs"]):
            ranked = sorted(top.items(), key=lambda item: -item[1])
            assert trl["logprob_token_ids"][choice["index"]][position] == [
                int(t.removeprefix("token_id:")) for t, _ in ranked
            ]
            assert trl["logprobs"][choice["index"]][position] == [v for _, v in ranked]
    assert trl["world_size"] == 1 and trl["max_model_len"] == TEST_MAX_MODEL_LEN
    assert trl["weight_transfer_config"] is None and trl["reset_prefix_cache"]


async def test_skyrl_remote_inference_client_unchanged(servers):
    """SkyRL 0.3.0's RemoteInferenceClient, as released (its session given the operator's
    token), driven as its generator does: a batch with session ids and logprobs equal to
    vllm serve's for the same bodies; pause (keep) and resume with a request running loses
    none of its tokens; reset_prefix_cache, world size; sleep refused with vLLM's reason on
    the CPU engine, through SkyRL's own error."""
    from gateway.tiny_model import ensure_tiny_tokenizer

    model = servers["face_state"].model_name
    sky = await asyncio.to_thread(
        in_framework_venv, ".venv-skyrl", "skyrl_client.py", servers["face"].base, model,
        str(ensure_tiny_tokenizer()),
    )  # fmt: skip
    assert "error" not in sky, sky
    for prompt, ids, logprobs, reason in zip(
        [[5, 6, 7], [8, 9]], sky["response_ids"], sky["response_logprobs"], sky["stop_reasons"],
        strict=True,
    ):  # fmt: skip
        body = {
            "token_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_tokens": 8, "logprobs": 1},
        }
        status, answer = await servers["vllm"].post("/inference/v1/generate", body)
        (choice,) = answer["choices"]
        assert (ids, reason) == (choice["token_ids"], choice["finish_reason"])
        assert logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
    # The native adapter (client.frameworks.skyrl, issue 70 item 3): the multi-turn rollout,
    # id for id and logprob for logprob, as RemoteInferenceClient's through the face.
    native = await asyncio.to_thread(
        in_framework_venv, ".venv-skyrl", "skyrl_client.py", "native",
        servers["gateway"].addresses[0], model, str(ensure_tiny_tokenizer()), our_client=True,
    )  # fmt: skip
    assert "error" not in native, native
    assert native["rollout"] == sky["rollout"] and len(sky["rollout"]) == 2
    assert native["world_size"] == [1, 1]
    assert sky["across_tokens"] == 480
    assert sky["world_size"] == [1, 1]
    assert "Sleep mode is not supported" in sky["sleep"], sky["sleep"]
