"""The face's pieces on their own: bodies into the gateway's structs, outputs into vLLM's
logprob shapes, and request fields reaching the gateway (a gateway on the fake engine)."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest

from client.http_face.bodies import HttpError, parse_completion, parse_generate, sampling_from
from client.http_face.responses import completion_logprobs, logprobs_content
from codec import Logprobs
from tests.client.http_face.conftest import AUTH, TOKEN, Http, face_over, in_framework_venv
from tests.conftest import running_gateway


def test_sampling_fields_map_and_unserved_ones_are_refused_by_name():
    params = sampling_from(
        {
            "temperature": 0,
            "max_tokens": 3,
            "logit_bias": {"7": -1.5},
            "skip_special_tokens": False,  # text-only: vLLM's own token path ignores it
            "not_a_vllm_field": 1,
            "stop": [],  # the default: not a use of stop strings
        }
    )
    assert (params.temperature, params.max_tokens, params.logit_bias) == (0.0, 3, {7: -1.5})
    for field, value in [
        ("stop", ["x"]),
        ("structured_outputs", {"regex": "a"}),
        ("bad_words", ["no"]),
        ("extra_args", {"k": 1}),
        ("logprob_token_ids", [1]),
    ]:
        with pytest.raises(HttpError) as info:
            sampling_from({field: value})
        assert info.value.status == 400 and info.value.param == field
    with pytest.raises(HttpError) as info:
        sampling_from({"max_tokens": "many"})
    assert "sampling_params.max_tokens" in info.value.message
    with pytest.raises(HttpError):
        sampling_from({"logit_bias": {"seven": 1.0}})
    with pytest.raises(HttpError):  # the gateway's own field is not a vLLM one
        parse_generate(b'{"token_ids": [1], "sampling_params": {}, "features": {}}')
    assert sampling_from({"stop_token_sequences": [[1, 2]]}).stop_token_sequences is None


def test_completion_bodies_take_ids_or_batches_and_refuse_text():
    body, prompts, fields = parse_completion(b'{"prompt": [1, 2], "n": 2, "seed": 3}')
    assert prompts == [[1, 2]] and fields == {"n": 2, "seed": 3, "max_tokens": 16}
    _, prompts, _ = parse_completion(b'{"prompt": [[1], [2, 3]], "max_tokens": 4}')
    assert prompts == [[1], [2, 3]]
    for raw in (b'{"prompt": "hi"}', b'{"prompt": ["a"]}', b'{"prompt": [[]]}', b'{"prompt": 5}'):
        with pytest.raises(HttpError):
            parse_completion(raw)
    with pytest.raises(HttpError, match="suffix"):
        parse_completion(b'{"prompt": [1], "suffix": "x"}')
    _, prompts, _ = parse_completion(b'{"prompt": ["hi", [4]]}', text_prompts=True)
    assert prompts == ["hi", [4]]


def test_logprob_rows_read_as_vllms_dict_of_candidates():
    """A row is [sampled, top1, top2, ...]; the sampled id met again among the top-k keeps
    its first place and takes that entry's rank (vLLM builds a dict from the row)."""
    rows = Logprobs(token_ids=[[9, 4, 9, 5]], logprobs=[[-1.0, -0.5, -1.0, -2.0]], ranks=[3])
    (entry,) = logprobs_content(rows, top=2)
    assert (entry["token_id"], entry["rank"], entry["token"]) == (9, 2, "token_id:9")
    assert [(t["token_id"], t["rank"]) for t in entry["top_logprobs"]] == [(9, 2), (4, 1)]
    assert len(logprobs_content(rows, top=0)[0]["top_logprobs"]) == 1
    assert len(logprobs_content(rows, top=-1)[0]["top_logprobs"]) == 3
    floor = Logprobs(token_ids=[[3]], logprobs=[[float("-inf")]], ranks=[1])
    assert logprobs_content(floor, top=1)[0]["logprob"] == -9999.0
    done = completion_logprobs(
        Logprobs(token_ids=[[9, 4, 9], [12, 12]], logprobs=[[-1.0, -0.5, -1.0], [-0.1, -0.1]],
                 ranks=[2, 1]),
        top=1,
    )  # fmt: skip
    assert done["tokens"] == ["token_id:9", "token_id:12"]
    assert done["top_logprobs"] == [{"token_id:9": -1.0, "token_id:4": -0.5}, {"token_id:12": -0.1}]
    assert done["text_offset"] == [0, len("token_id:9")]
    every = completion_logprobs(rows, top=-1)  # -1: every candidate
    assert every["top_logprobs"] == [{"token_id:9": -1.0, "token_id:4": -0.5, "token_id:5": -2.0}]


def test_trls_logprob_rows_are_the_completions_share_by_descending_logprob():
    """client.frameworks.trl answers TRL's logprob shapes from the same candidates as the
    face's completions route: the sampled token and ``logprobs`` more; -1: all of them."""
    from client.frameworks.trl import _ranked

    rows = Logprobs(token_ids=[[9, 4, 9, 5]], logprobs=[[-1.0, -0.5, -1.0, -2.0]], ranks=[3])
    assert _ranked(rows, 0) == [[(9, -1.0)]]
    assert _ranked(rows, 1) == [[(4, -0.5), (9, -1.0)]]
    assert _ranked(rows, -1) == [[(4, -0.5), (9, -1.0), (5, -2.0)]]


async def test_request_fields_reach_the_gateway_and_oversize_bodies_get_413():
    """X-Session-ID is the routing key; cache_salt, priority and X-Request-Id map as the
    native client's; a body over the face's limit is refused in vLLM's shape; SkyRL's
    /finish_session answers 200 to the operator's token."""
    from gateway.fake_engine import FakeEngine

    @dataclasses.dataclass
    class Recording(FakeEngine):
        seen: list = dataclasses.field(default_factory=list)

        def prepare(self, engine_request_id, request):
            self.seen.append(request.options)
            return super().prepare(engine_request_id, request)

    engine = Recording()
    async with (
        running_gateway(engine) as gateway,
        face_over(gateway, api_key=TOKEN) as (_, base),
        aiohttp.ClientSession() as session,
    ):
        face = Http(session, base)
        body = {
            "token_ids": [1, 2],
            "sampling_params": {"max_tokens": 2},
            "cache_salt": "run-3",
            "priority": 5,
        }
        headers = {**AUTH, "X-Session-ID": "episode-9", "X-Request-Id": "rid-1"}
        status, answer = await face.post("/inference/v1/generate", body, headers=headers)
        assert status == 200 and answer["request_id"] == "generate-tokens-rid-1", answer
        (options,) = engine.seen
        assert (options.priority, options.cache_salt) == (5, "run-3")
        assert options.routing_key.endswith(":episode-9")  # the gateway keys it per client
        status, answer = await face.post("/inference/v1/generate", raw=b"[" * (65 << 20))
        assert status == 413 and answer["error"]["code"] == 413
        status, answer = await face.post("/no/such/route", {})
        assert status == 404 and set(answer["error"]) == {"message", "type", "param", "code"}
        # SkyRL's router route, as its RemoteInferenceClient calls it after each trajectory.
        assert (await face.post("/finish_session?session_id=episode-9"))[0] == 200
        assert (await face.post("/finish_session?session_id=x", headers=None))[0] == 401


def test_skyrl_adapter_asks_the_gateway_what_skyrls_client_asks_vllm():
    """client.frameworks.skyrl over a recording stand-in (in .venv-skyrl, where SkyRL
    imports): sleep keeps the base weights (level 1) for a LoRA-only trainer, as SkyRL's
    own client; pause modes (SkyRL's PauseMode or a string) and clear_cache reach the
    gateway; a LoRA synced twice under one name is unloaded, then loaded; SkyRL's NCCL
    request, a nameless LoraLoadRequest and router replay are refused by name; cache salts vLLM 0.32
    refuses become one valid salt each, others go unchanged."""
    done = in_framework_venv(".venv-skyrl", "skyrl_units.py", our_client=True)
    pauses = [["pause", "abort", True], ["pause", "wait", False], ["pause", "keep", False]]
    assert done["calls_lora_only_False"] == [["sleep", 2], *pauses, ["resume"]]
    assert done["calls_lora_only_True"] == [["sleep", 1], *pauses, ["resume"]]
    assert done["lora_calls"] == [
        ["load_lora", "policy", "/adapters/one"],
        ["unload_lora", "policy"],
        ["load_lora", "policy", "/adapters/two"],
    ]
    (nccl_type, nccl), (nameless_type, nameless), (replay_type, replay) = done["refusals"]
    assert nccl_type == "NotImplementedError" and "BroadcastWeightUpdateRequest" in nccl
    assert nameless_type == "ValueError" and "lora_name" in nameless
    assert replay_type == "NotImplementedError" and "enable_return_routed_experts" in replay
    # Issue 77 item 12: n null is one sample; item 4: a refused prompt ends the batch's
    # other requests (cancelled: their streams abort them), none left running.
    assert done["n_null"] == [[[8, 9]], [["generate", [7], None]]]
    message, calls = done["batch_refused"]
    assert "666" in message
    assert sorted(c for c in calls if c[0] == "cancelled") == [
        ["cancelled", [1]],
        ["cancelled", [2]],
    ]
    salts = done["salts"]
    assert salts["3"] == "3" and salts["x" * 128] == "x" * 128
    mapped = [salts[s] for s in ("policy@3", "policy@4", "a/b", "x" * 129)]
    assert len(set(mapped)) == 4
    for salt in mapped:
        assert salt.startswith("skyrl-") and len(salt) <= 128
        assert not set(salt) & set("@/\\\0")
