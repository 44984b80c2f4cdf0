"""vLLM's trainer-engine interface for the ``cpu`` backend: importing this registers
``CpuTrainerWeightTransferEngine`` with vLLM's ``WeightTransferTrainerFactory`` under
``"cpu"``. Needs vLLM (and torch) in the trainer process.

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from client.vllm_trainer import CpuTrainerInitInfo
    from client.weight_sync import GatewayWeightSyncClient

    engine = WeightTransferTrainerFactory.trainer_init(
        CpuTrainerInitInfo(rank=0), client=GatewayWeightSyncClient(gw), source=ModuleSource(model)
    )
    engine.send_weights()  # start, buckets, finish: as vLLM's nccl and ipc engines do
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from .weight_sync import DEFAULT_BUCKET_BYTES, shared_memory_buckets

__all__ = ["CpuTrainerInitInfo", "CpuTrainerWeightTransferEngine"]


@dataclass
class CpuTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of the ``cpu`` backend (trainer and engines on one host; the
    buffer folder is the gateway's, learnt at init through ``GatewayWeightSyncClient``)."""

    backend: ClassVar[str] = "cpu"

    bucket_bytes: int = DEFAULT_BUCKET_BYTES


class CpuTrainerWeightTransferEngine(TrainerWeightTransferEngine[CpuTrainerInitInfo]):
    """Sends a ``WeightSource`` through shared-memory buckets; only rank 0 talks to the
    gateway, other ranks iterate the source to stay in its collectives."""

    init_info_cls = CpuTrainerInitInfo

    def __init__(self, *, client: Any, source: WeightSource, init_info: CpuTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info

    @classmethod
    def trainer_init(
        cls,
        init_info: CpuTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> CpuTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the cpu trainer engine needs a WeightSource")
        engine = cls(client=client, source=source, init_info=init_info)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
            if not isinstance(getattr(client, "directory", None), str):
                raise ValueError(
                    "the cpu trainer engine needs a GatewayWeightSyncClient (it learns the"
                    " gateway's buffer folder)"
                )
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        """start_weight_update, one update_weights per bucket, finish_weight_update."""
        assert self.source is not None
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        self.client.start_weight_update()
        try:
            with shared_memory_buckets(
                self.source,
                bucket_bytes=self.init_info.bucket_bytes,
                directory=self.client.directory,  # type: ignore[attr-defined]
                arena=getattr(self.client, "arena", None),
            ) as buckets:
                for update_info in buckets:
                    self.client.update_weights(update_info)
            self.client.finish_weight_update(weight_version)
        except BaseException:
            abandon = getattr(self.client, "abandon_weight_update", None)
            if abandon is not None:
                with contextlib.suppress(Exception):
                    abandon()  # the gateway may have ended the update already
            raise


if "cpu" not in WeightTransferTrainerFactory._registry:
    WeightTransferTrainerFactory.register_engine("cpu", CpuTrainerWeightTransferEngine)
