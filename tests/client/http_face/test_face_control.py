"""The face's control routes as prime-rl's admin client calls them (issue 69 item 3): pause
keep, update_weights from a second checkpoint, resume with a request in flight, a LoRA loaded
by the same name twice; and who may call them."""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest

from tests.client.http_face.conftest import AUTH, TOKEN, Http, face_over, in_framework_venv
from tests.conftest import TEST_MAX_MODEL_LEN, cpu_engine_args, engine_gateway

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0.0, "max_tokens": 24}


@pytest.fixture(scope="module")
async def face():
    from gateway.auth import ControlPolicy

    async with (
        engine_gateway(
            # 2048 (the model's own): a request that outlives pause -> update -> resume over
            # HTTP (the tiny model makes ~1000 tokens a second on the 2-core VM)
            cpu_engine_args(
                enable_lora=True,
                max_lora_rank=8,
                max_model_len=2048,
                weight_transfer_config={"backend": "cpu"},
            ),
            control=ControlPolicy(open=True),
        ) as gateway,
        face_over(gateway, api_key=TOKEN) as (_, base),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session,
    ):
        http = Http(session, base)
        http.gateway = gateway
        yield http


async def _tokens(face: Http, prompt: list[int], **body) -> list[int]:
    status, answer = await face.post(
        "/inference/v1/generate", {"token_ids": prompt, "sampling_params": GREEDY, **body}
    )
    assert status == 200, answer
    return answer["choices"][0]["token_ids"]


async def test_control_routes_need_the_operators_token(face):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for path in ("/pause", "/resume", "/update_weights", "/v1/load_lora_adapter"):
            status, answer = await face.post(path, {}, headers=headers)
            assert status == 401 and answer["error"]["code"] == 401, (path, answer)
        status, _ = await face.post("/abort_requests", {}, headers=headers)  # all: control
        assert status == 401
    status, answer = await face.get("/is_paused")
    assert (status, answer) == (200, {"is_paused": False})


async def test_a_face_without_an_api_key_refuses_every_control_route(face):
    async with face_over(face.gateway) as (_, base):
        keyless = Http(face.session, base)
        for headers in (None, AUTH):
            status, answer = await keyless.post("/pause", headers=headers)
            assert status == 401 and "--api-key" in answer["error"]["message"], answer
        status, answer = await keyless.post(
            "/inference/v1/generate", {"token_ids": [5], "sampling_params": GREEDY}, headers=None
        )
        assert status == 200, answer  # its data routes are open


async def test_prime_rl_admin_sequence(face, tmp_path):
    """pause(keep) -> update_weights(weight_dir: B) -> resume, with a request running
    across it: that request reports two weight spans; afterwards the greedy output equals
    offline vLLM on B. Then an adapter loaded under one name twice (load_inplace) serves
    the second adapter."""
    from gateway.tiny_model import ensure_tiny_model
    from tests.lora_adapter import make_tiny_lora
    from tests.offline_reference import run_offline_reference

    model_a, model_b = ensure_tiny_model(), ensure_tiny_model(weights_seed=1)
    prompt = [17, 18, 19, 20]
    offline_b = asyncio.ensure_future(
        asyncio.to_thread(
            run_offline_reference,
            str(model_b),
            TEST_MAX_MODEL_LEN,
            [{"prompt": prompt, "sampling": GREEDY}],
            keep=True,
        )
    )
    before = await _tokens(face, prompt)
    across_body = {
        "token_ids": [3, 3, 3],
        "stream": True,
        "sampling_params": {**GREEDY, "max_tokens": 2040, "ignore_eos": True},
    }
    async with face.session.post(
        face.base + "/inference/v1/generate", json=across_body, headers=AUTH
    ) as across:
        assert across.status == 200
        await across.content.readline()  # its first tokens: it runs
        status, answer = await face.post("/pause?mode=keep&clear_cache=false")
        assert (status, answer) == (200, {"status": "paused"})
        assert await face.get("/is_paused") == (200, {"is_paused": True})
        status, answer = await face.post("/update_weights", {"weight_dir": str(model_b)})
        assert status == 200, answer
        assert await face.post("/resume") == (200, {"status": "resumed"})
        events = [
            json.loads(line[6:])
            for line in (await across.text()).split("\n")
            if line.startswith("data: {")
        ]
    (final,) = [e["choices"][0] for e in events if e["choices"][0]["finish_reason"]]
    first, second = final["weight_versions"]
    assert first["start"] == 0 and second["start"] == first["end"] > 0
    assert second["end"] == 2040
    assert (first["version"], second["version"]) == ("default", str(model_b))
    after = await _tokens(face, prompt)
    ((reference,),) = [r["samples"] for r in await offline_b]
    assert after == reference["token_ids"] != before
    # Back to A (the other tests' weights), by the same route.
    assert (await face.post("/update_weights", {"weight_dir": str(model_a)}))[0] == 200
    assert await _tokens(face, prompt) == before

    # A LoRA adapter under one name, loaded twice: the second load serves the second one.
    one = str(make_tiny_lora(tmp_path / "one", seed=1))
    two = str(make_tiny_lora(tmp_path / "two", seed=2))
    load = {"lora_name": "policy", "lora_path": one}
    assert (await face.post("/v1/load_lora_adapter", load))[0] == 200
    tuned_one = await _tokens(face, prompt, model="policy")
    status, answer = await face.post("/v1/load_lora_adapter", {**load, "lora_path": two})
    assert status == 400 and "load_inplace" in answer["error"]["message"]  # as vLLM
    again = {"lora_name": "policy", "lora_path": two, "load_inplace": True}
    assert (await face.post("/load_lora_adapter", again))[0] == 200
    tuned_two = await _tokens(face, prompt, model="policy")
    assert (await face.post("/v1/load_lora_adapter", {"lora_name": "fresh", "lora_path": two}))[
        0
    ] == 200
    assert tuned_two == await _tokens(face, prompt, model="fresh") != tuned_one
    status, models = await face.get("/v1/models")
    assert [m["id"] for m in models["data"]][1:] == ["policy", "fresh"]
    for name in ("policy", "fresh"):
        assert (await face.post("/v1/unload_lora_adapter", {"lora_name": name}))[0] == 200
    status, answer = await face.post(
        "/inference/v1/generate",
        {"token_ids": prompt, "sampling_params": GREEDY, "model": "policy"},
    )
    assert status == 404


async def test_unserved_routes_and_sleep_on_cpu_answer_clearly(face):
    status, answer = await face.post("/v1/chat/completions", {"messages": []})
    assert status == 404 and "/v1/chat/completions" in answer["error"]["message"]
    assert "client.text" in answer["error"]["message"]
    status, answer = await face.post("/sleep?level=1")
    assert status == 400 and "Sleep mode is not supported" in answer["error"]["message"]
    status, answer = await face.post("/sleep?level=7")
    assert status == 400 and answer["error"]["param"] == "level"
    status, answer = await face.post("/reset_prefix_cache")
    assert (status, answer) == (200, {"success": True})


async def test_weight_transfer_routes_reach_the_gateways_backend(face):
    """vLLM's weight-transfer routes through the face: the ``cpu`` backend's init answers
    with its buffer folder; a TCP-store rendezvous (an init map with keys the backend does
    not take) is refused naming them, before any engine call; an update opened and
    finished with no chunks names the version the outputs then carry."""
    status, answer = await face.post("/init_weight_transfer_engine", {"init_info": {}})
    assert status == 200, answer
    (result,) = answer["results"]
    assert result["directory"]
    rendezvous = {"master_address": "127.0.0.1", "master_port": 29500, "world_size": 2}
    status, answer = await face.post("/init_weight_transfer_engine", {"init_info": rendezvous})
    assert status == 400 and "master_address" in answer["error"]["message"], answer
    assert (await face.post("/start_weight_update"))[0] == 200
    status, answer = await face.post("/finish_weight_update", {"weight_version": "step-9"})
    assert status == 200, answer
    status, answer = await face.post(
        "/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": GREEDY}
    )
    (choice,) = answer["choices"]
    assert [s["version"] for s in choice["weight_versions"]] == ["step-9"]
    assert (await face.post("/shutdown_weight_transfer_engine"))[0] == 200


async def test_trl_grpo_trainer_steps_with_weight_pushes_through_the_native_client(face, tmp_path):
    """TRL 1.16's GRPOTrainer, as released, two steps on the CPU (vllm_mode="server") with
    client.frameworks.trl.GatewayVLLMClient in place of TRL's VLLMClient (issue 70 item 1):
    each weight sync goes through the gateway's ``cpu`` weight-transfer backend, after each
    the gateway's greedy output equals offline vLLM on the weights pushed, and the version
    advances."""
    from gateway.tiny_model import ensure_tiny_model, ensure_tiny_tokenizer
    from tests.offline_reference import run_offline_reference

    done = await asyncio.to_thread(
        in_framework_venv, ".venv-trl", "trl_grpo.py", face.gateway.addresses[0],
        str(ensure_tiny_model()), str(ensure_tiny_tokenizer()), str(tmp_path), our_client=True,
    )  # fmt: skip
    assert "error" not in done, done
    assert done["steps"] == 2
    syncs = done["syncs"]
    assert [s["version"] for s in syncs] == ["trl-update-1", "trl-update-2", "trl-update-3"]
    assert all(s["spans"] == [s["version"]] for s in syncs)
    assert syncs[0]["greedy"] != syncs[-1]["greedy"]  # the steps changed the weights
    greedy = {"temperature": 0.0, "max_tokens": 16}
    for sync in syncs:
        ((reference,),) = [
            r["samples"]
            for r in await asyncio.to_thread(
                run_offline_reference,
                sync["checkpoint"],
                TEST_MAX_MODEL_LEN,
                [{"prompt": [5, 6, 7, 8], "sampling": greedy}],
            )
        ]
        assert sync["greedy"] == reference["token_ids"], sync["version"]


def _turns(rollout: dict, row: int) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, generated ids)`` of each turn of trajectory ``row``, read as SkyRL's
    trainer reads a GeneratorOutput: a generated run is a run of loss-mask 1s, and its
    prompt is every id before it (the observations between are loss-mask 0)."""
    prompt, response = rollout["prompt_token_ids"][row], rollout["response_ids"][row]
    mask = rollout["loss_masks"][row]
    assert len(mask) == len(response)
    turns, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            turns.append((prompt + response[:start], response[start:i]))
            start = None
    return turns


async def test_skyrl_gym_generator_runs_multi_turn_episodes_over_the_native_engine(face, tmp_path):
    """SkyRL 0.3.0's SkyRLGymGenerator, as released, on skyrl-gym 0.4.0's multi-turn GSM8K
    environment, over client.frameworks.skyrl.GatewayInferenceEngine (issue 70 item 3):
    each episode runs its three turns (observations between, loss-masked), the generator
    finishes each session; the rollout equals the same rollout over SkyRL's own
    RemoteInferenceClient through the face; and after each weight update the trainer
    makes (full weights A, then B, through the cpu backend; a LoRA synced twice under one
    name as SkyRL's workers sync it) every turn equals offline vLLM on those weights, and
    the weight version the generator salts with advances."""
    from gateway.tiny_model import ensure_tiny_model, ensure_tiny_tokenizer
    from tests.lora_adapter import make_tiny_lora
    from tests.offline_reference import run_offline_reference

    model_a, model_b = ensure_tiny_model(), ensure_tiny_model(weights_seed=1)
    one = make_tiny_lora(tmp_path / "one", seed=1)
    two = make_tiny_lora(tmp_path / "two", seed=2)
    status, models = await face.get("/v1/models")
    assert status == 200, models
    done = await asyncio.to_thread(
        in_framework_venv, ".venv-skyrl", "skyrl_gym_rollout.py", face.base,
        face.gateway.addresses[0], models["data"][0]["id"], str(ensure_tiny_tokenizer()),
        str(model_a), str(model_b), str(one), str(two), our_client=True,
    )  # fmt: skip
    assert "error" not in done, done
    fields = ("prompt_token_ids", "response_ids", "loss_masks", "rewards", "stop_reasons")
    for field in fields:  # the native engine answers as SkyRL's HTTP client through the face
        assert done["a"][field] == done["a_http"][field], field
    ours, theirs = done["a"]["rollout_logprobs"], done["a_http"]["rollout_logprobs"]
    for row, their_row in zip(ours, theirs, strict=True):
        assert row == pytest.approx(their_row, abs=1e-4)
    assert [done[k]["cache_salt"] for k in ("a", "b", "lora_one", "lora_two")] == [
        "1", "2", "policy@3", "policy@4"
    ]  # fmt: skip
    assert done["loras"] == ["policy"] and "object" in done["refused"]
    sampling = done["a"]["sampling"]
    assert sampling["min_tokens"] == 1 and sampling["logprobs"] == 0  # SkyRL's own
    offline_sampling = {
        k: sampling[k] for k in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k",
                                 "min_p", "logprobs")
    }  # fmt: skip
    cases: dict[str, list] = {}
    for key in ("a", "b", "lora_one", "lora_two"):
        rollout = done[key]
        assert rollout["finished_sessions"] == ["q0_0", "q1_0"], key
        assert len(rollout["response_ids"]) == 2
        for row in range(2):
            turns = _turns(rollout, row)
            assert len(turns) == 3, (key, row)  # the environment asked twice more
            for (before, generated), (after, _) in itertools.pairwise(turns):
                assert after[: len(before)] == before  # token in, token out
                assert after[len(before) : len(before) + len(generated)] == generated
                assert len(after) > len(before) + len(generated)  # the observation
            logprobs, mask = rollout["rollout_logprobs"][row], rollout["loss_masks"][row]
            assert all(lp == 0.0 for lp, bit in zip(logprobs, mask, strict=True) if not bit)
            lora = {"lora_one": ["one", 1, str(one)], "lora_two": ["two", 2, str(two)]}.get(key)
            cases.setdefault(key, []).extend(
                {"prompt": p, "sampling": offline_sampling, **({"lora": lora} if lora else {}),
                 "generated": g}
                for p, g in turns
            )  # fmt: skip
    assert done["b"]["response_ids"] != done["a"]["response_ids"]
    assert done["lora_one"]["response_ids"] != done["lora_two"]["response_ids"]

    def offline(model, keys: tuple[str, ...], keep: bool) -> None:  # noqa: ANN001
        runs = [case for key in keys for case in cases[key]]
        results = run_offline_reference(
            str(model), TEST_MAX_MODEL_LEN,
            [{k: v for k, v in c.items() if k != "generated"} for c in runs], keep=keep,
        )  # fmt: skip
        for case, result in zip(runs, results, strict=True):
            (sample,) = result["samples"]
            assert case["generated"] == sample["token_ids"], keys

    await asyncio.to_thread(offline, model_a, ("a",), True)
    await asyncio.to_thread(offline, model_b, ("b", "lora_one", "lora_two"), False)
