"""client.frameworks.trl's GatewayVLLMClient on its own (no TRL needed to import it): the
calls TRL 1.16's GRPO makes that the adapter must take, refuse by name or clean up after,
against a gateway on the fake engine (issue 77 item 11)."""

from __future__ import annotations

import time

import pytest

from client.errors import RequestFailed
from client.frameworks import trl as trl_adapter
from client.frameworks.trl import GatewayVLLMClient
from codec import ErrorCode
from gateway.auth import ControlPolicy
from gateway.fake_engine import FakeEngine
from tests.conftest import gateway_in_thread


def test_text_only_generation_kwargs_are_taken_and_unknown_ones_named():
    engine = FakeEngine(step_interval_s=0.001)
    with gateway_in_thread(engine) as gateway:
        trl = GatewayVLLMClient(base_url=gateway.addresses[0])
        try:
            text_only = {
                "skip_special_tokens": False,
                "include_stop_str_in_output": True,
                "spaces_between_special_tokens": False,
            }
            out = trl.generate([[1, 2, 3]], n=2, max_tokens=4, generation_kwargs=text_only)
            assert [len(ids) for ids in out["completion_ids"]] == [4, 4]
            with pytest.raises(ValueError, match=r"\['no_such_field'\]"):
                trl.generate([[1, 2]], generation_kwargs={"no_such_field": 1})
            with pytest.raises(NotImplementedError, match="image_features"):
                trl.image_features([[1, 2]], images=None)
        finally:
            trl.close()


def test_one_refused_prompt_aborts_the_batchs_other_requests():
    engine = FakeEngine(step_interval_s=0.01)
    with gateway_in_thread(engine) as gateway:
        trl = GatewayVLLMClient(base_url=gateway.addresses[0])
        try:
            vocab = trl.client.model_info().model.vocab_size
            with pytest.raises(RequestFailed):
                trl.generate([[1, 2], [3, 4], [vocab + 5]], max_tokens=100_000,
                             generation_kwargs={"ignore_eos": True})  # fmt: skip
            deadline = time.monotonic() + 5
            while len(engine.aborted) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(engine.added) == 2 and sorted(engine.aborted) == sorted(engine.added)
        finally:
            trl.close()


def test_a_failed_push_takes_no_version_and_close_shuts_the_weight_transfer(monkeypatch):
    pushes: list[str] = []

    def push(client, tensors, *, version):  # noqa: ANN001
        list(tensors)
        if not pushes:
            pushes.append(f"failed {version}")
            raise RequestFailed(None, ErrorCode.INVALID_REQUEST, "the update was refused")
        pushes.append(version)

    class Tensor:
        def detach(self) -> Tensor:
            return self

    monkeypatch.setattr(trl_adapter, "send_weights", push)
    engine = FakeEngine(step_interval_s=0.001)
    with gateway_in_thread(engine, control=ControlPolicy(open=True)) as gateway:
        trl = GatewayVLLMClient(base_url=gateway.addresses[0])
        shutdowns = []
        real = trl.client.shutdown_weight_transfer_engine
        monkeypatch.setattr(
            trl.client, "shutdown_weight_transfer_engine", lambda: shutdowns.append(1) or real()
        )
        with pytest.raises(RequestFailed):
            trl.update_named_params(None, [("w", Tensor())])
        trl.update_named_params(None, [("w", Tensor())])
        assert pushes == ["failed trl-update-1", "trl-update-1"]
        assert trl.weight_versions == ["trl-update-1"]
        trl.close()
        assert shutdowns == [1]
