"""``VllmEngine``'s weight-transfer operations: vLLM's weight-transfer API on every engine
and worker, with generation held during an update, the cache-salt key moved, and a
failure part-way turned into ``WeightsIncomplete`` (PROTOCOL.md §7.14).

The workers' side (``weight_updates``) ends a failed update where it stands and reports
how many layers took new weights: none, and the old weights serve on; some, and the model
mixes two sets of weights, so generation is refused until a complete update (every layer)
or a ReloadWeights.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from codec import ErrorCode

from ..errors import EngineDead, RequestRejected, WeightsIncomplete
from ..weight_buffers import WeightBufferFolder
from .failures import engine_death_named, engine_failure, files_call, vllm_failure_text
from .weight_updates import REFUSED

logger = logging.getLogger(__name__)

__all__ = [
    "SERVED_BACKENDS",
    "WeightTransferControls",
    "check_transfer_backend",
    "refuse_store_rendezvous",
]

# vLLM's weight-transfer backends the gateway serves: the ones whose maps it has checked
# for what a client may send. vLLM's others were written for a trusted trainer: ``ipc``
# sends Python objects (msgpack cannot carry them; their pickled form runs the sender's
# code), the Ray ones name trainer actors and their methods.
SERVED_BACKENDS = ("cpu", "nccl")

# Init fields of vLLM's TCPStore rendezvous: the workers join a store at the address the
# client names, and vLLM's StatelessProcessGroup unpickles what that store holds (the NCCL
# unique id, by broadcast_obj), code of the store owner's choosing.
_STORE_RENDEZVOUS = ("master_address", "master_port")


def check_transfer_backend(vllm_config: Any) -> None:
    """Refuse (ValueError) an engine configured with a weight-transfer backend the gateway
    does not serve."""
    backend = getattr(getattr(vllm_config, "weight_transfer_config", None), "backend", None)
    if backend is not None and backend not in SERVED_BACKENDS:
        raise ValueError(
            f"--weight-transfer-config: the gateway serves the {' and '.join(SERVED_BACKENDS)}"
            f" backends, not {backend!r}: its maps carry what a client must not send (ipc:"
            " Python objects, which msgpack cannot carry and a pickle would run)"
        )


def refuse_store_rendezvous(init_info: dict) -> None:
    """Refuse (RequestRejected naming the fields) an ``nccl`` init map that asks for vLLM's
    TCPStore rendezvous; its unique-id rendezvous (``nccl_unique_id_b64``) exchanges no
    Python objects."""
    asked = [key for key in _STORE_RENDEZVOUS if key in init_info]
    if asked:
        raise RequestRejected(
            f"init_info.{'/'.join(asked)}: the TCPStore rendezvous is refused, since vLLM's"
            " workers would unpickle what the store at that address holds (code of its"
            " owner's choosing); send nccl_unique_id_b64 (base64 of the trainer's"
            " ncclGetUniqueId) instead"
        )


class WeightTransferControls:
    """Mixed into ``VllmEngine`` (uses its client, engine pids, epoch and version)."""

    _client: Any
    _vllm_config: Any
    _engine_pids: list[int]
    _weights_epoch: int
    weights_incomplete: str | None = None  # why generation is refused, after a failure
    _holding_generation = False  # the gateway paused the scheduler for the open update
    weight_buffers: WeightBufferFolder | None = None  # the cpu backend's (serve sets root)

    async def init_weight_transfer(self, init_info: dict) -> dict[str, Any] | None:
        """vLLM's init on every worker. The ``cpu`` backend's folder is the gateway's own
        (made here, private), and so is its shared-memory arena: a client may name
        neither. Result for ``cpu``: ``{"directory": path}``, with ``"arena": path,
        "arena_bytes": size`` unless the operator turned the arena off; else None."""
        self._require_transfer()
        if not isinstance(init_info, dict):
            raise RequestRejected("init_info must be a map")
        if self._transfer_backend() != "cpu":
            refuse_store_rendezvous(init_info)
            await self._checked_weight_call("init_weight_transfer_engine", {"init_info": init_info})
            return None
        if init_info:
            raise RequestRejected(
                f"init_info for the cpu backend takes no keys (got {sorted(init_info)}): the"
                " gateway makes the buffer folder and answers with it (result.directory)"
            )
        if self.weight_buffers is None:
            self.weight_buffers = WeightBufferFolder()
        buffers = self.weight_buffers
        try:
            info: dict[str, Any] = {"directory": buffers.make()}
            if buffers.arena is not None:  # allocating its pages takes a while: off the loop
                info["arena"] = await asyncio.to_thread(buffers.arena.make)
                info["arena_bytes"] = buffers.arena.size
        except (OSError, ValueError) as exc:
            raise RequestRejected(f"no memory for weight buffers: {exc}") from None
        try:
            await self._checked_weight_call("init_weight_transfer_engine", {"init_info": info})
        except RequestRejected as exc:
            if "arena" not in info or "arena" not in str(exc):
                raise
            # Engines that cannot reach the gateway's /proc (another PID namespace): the
            # trainer is told of no arena, and sends buffer files as before.
            logger.warning("the engines cannot map the weight arena (%s): buffer files only", exc)
            info = {"directory": info["directory"]}
            await self._checked_weight_call("init_weight_transfer_engine", {"init_info": info})
        return info

    async def shutdown_weight_transfer(self) -> None:
        self._require_transfer()
        await self._weight_call("shutdown_weight_transfer_engine")
        if self.weight_buffers is not None:
            self.weight_buffers.remove()

    async def start_weight_update(self, hold: bool, mode: str = "keep") -> None:
        """Open an update on every worker; ``hold``: pause generation (vLLM's ``mode``:
        keep, wait or abort) until the update ends, whoever ends it, since layers wait on
        the meta device meanwhile."""
        self._require_transfer()
        if hold:
            await self.pause(mode, False)  # type: ignore[attr-defined]
            self._holding_generation = True
        self._weights_epoch += 1  # requests admitted from now on: a key of their own
        try:
            await self._weight_call("start_weight_update")
        except Exception as exc:
            await self._update_failed(exc)

    async def update_weights(self, update_info: dict | list) -> None:
        try:
            await self._weight_call("update_weights", {"update_info": update_info})
        except Exception as exc:
            await self._update_failed(exc)

    async def finish_weight_update(self, version: str | None) -> dict[str, Any]:
        """Close the update on every worker, then reset the prefix cache, name the version
        and let generation run. Result: the version, whether the cache was reset, and how
        many layers (fewest over the workers) took new weights, of how many."""
        try:
            await self._weight_call("finish_weight_update")
        except Exception as exc:
            await self._update_failed(exc)
        self._empty_buffers()
        states = await self._worker_states("engine_gateway_weight_update_state")
        updated = min((s["layers_updated"] for s in states), default=0)
        layers = min((s["layers"] for s in states), default=0)
        if len({s.get("tensors_digest") for s in states}) > 1:
            # Ranks given different chunks now serve different weights under one version.
            counts = sorted({s.get("tensors_received", 0) for s in states})
            self._after_failure(
                f"the workers received different tensors (counts {counts})",
                states,
            )
        elif await self._replicas_differ():
            # Same tensor names, other bytes (a rank given another trainer's chunk).
            self._after_failure("the data-parallel ranks now hold different weights", states)
        if self.weights_incomplete is not None and updated >= layers > 0:
            logger.info("a complete weight update ended the mixed-weights state")
            self.weights_incomplete = None
        reset = await self.reset_prefix_cache(False)  # type: ignore[attr-defined]
        if version is not None:
            await self._set_version(version)  # type: ignore[attr-defined]
        self._weights_epoch += 1
        await self.release_weight_hold()
        kept = sorted({name for s in states for name in s.get("layers_not_updated", [])})
        return {
            "weight_version": version,
            "prefix_cache_reset": reset,
            "layers_updated": updated,
            "layers": layers,
            "layers_not_updated": kept[:8],  # the first few that keep their old weights
        }

    async def abandon_weight_update(self, reason: str) -> None:
        """End the open update where it stands (its trainer is gone, stalled, or asked);
        the hold on generation ends with it, whatever the workers said."""
        try:
            self._empty_buffers()
            states = await self._worker_states("engine_gateway_abandon_weight_update")
            self._after_failure(reason, states)
        finally:
            if self.weights_incomplete is None:  # else the server ends requests first
                await self.release_weight_hold()

    async def release_weight_hold(self) -> None:
        if self._holding_generation:
            self._holding_generation = False
            await self.resume()  # type: ignore[attr-defined]

    # ------------------------------------------------------------ internals

    def _transfer_backend(self) -> str:
        return str(getattr(self._vllm_config.weight_transfer_config, "backend", ""))

    def _empty_buffers(self) -> None:
        """The update ended: files a trainer left in the buffer folder go (the workers
        copied what they loaded)."""
        if self.weight_buffers is not None and (removed := self.weight_buffers.empty()):
            logger.info("removed %d weight buffer file(s) left by the trainer", removed)

    async def _checked_weight_call(self, method: str, kwargs: dict[str, Any]) -> None:
        """``_weight_call`` whose refusal by vLLM (a bad map) is the caller's mistake."""
        await files_call(method, self._weight_call(method, kwargs), self._engine_pids)

    def _require_transfer(self) -> None:
        if self._vllm_config.weight_transfer_config is None:
            raise NotImplementedError(
                "the engine was started without --weight-transfer-config"
                """ (e.g. '{"backend": "cpu"}', or "nccl" / "ipc" on GPUs)"""
            )

    async def _update_failed(self, exc: Exception) -> None:
        """A start, chunk or finish failed: end the update on every worker (vLLM ended it
        on the one that failed; with DP others may still be open), then raise what the
        client gets: WeightsIncomplete if layers took new weights, else the refusal."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDead):
            raise exc
        if isinstance(exc, EngineDeadError):
            raise engine_failure(exc, self._engine_pids) from exc
        text = vllm_failure_text(exc)
        self._empty_buffers()
        states = await self._worker_states("engine_gateway_abandon_weight_update")
        self._after_failure(text, states)
        await self.release_weight_hold()
        code = ErrorCode.INVALID_REQUEST
        logger.warning("weight update failed, the old weights serve on: %s", text)
        if REFUSED in text or "Invalid" in text or "must be called" in text:
            raise RequestRejected(text, code) from None
        raise RequestRejected(f"the weight update failed: {text}", code) from None

    def _after_failure(self, why: str, states: list[dict[str, Any]]) -> None:
        """After an update ended early: WeightsIncomplete if any layer took new weights."""
        self._weights_epoch += 1
        updated = sum(s["layers_updated"] for s in states)
        if updated:
            self.weights_incomplete = (
                f"a weight update failed after {updated} layer(s) took new weights ({why});"
                " generation is refused until a complete update or a ReloadWeights"
            )
            raise WeightsIncomplete(self.weights_incomplete)

    async def _weight_call(self, method: str, kwargs: dict[str, Any] | None = None) -> None:
        """vLLM's worker method ``method`` on every engine (each DP rank) and worker."""
        with engine_death_named(self._engine_pids):
            await self._client.call_utility_all_async("collective_rpc", method, None, (), kwargs)

    async def _worker_states(self, method: str) -> list[Any]:
        per_engine = await self._per_engine(method)
        return [state for workers in per_engine for state in workers]

    async def _per_engine(self, method: str) -> list[list[Any]]:
        """``method``'s result per engine (DP rank), per worker (TP/PP shard) within it."""
        with engine_death_named(self._engine_pids):
            return await self._client.call_utility_all_async(
                "collective_rpc", method, None, (), None
            )

    async def _replicas_differ(self) -> bool:
        """Do the DP ranks now hold other weights? Asked of the workers' parameters only
        where there are replicas to compare (one engine has none)."""
        if self._vllm_config.parallel_config.data_parallel_size < 2:
            return False
        return replicas_differ(await self._per_engine("engine_gateway_weights_digest"))


def replicas_differ(per_engine: list[list[str]]) -> bool:
    """Does a worker's digest (``per_engine``: per DP rank, per worker) differ from its
    peers' in the other ranks (the same TP/PP shard: shards differ by design)?"""
    return any(len(set(peers)) > 1 for peers in zip(*per_engine, strict=False))
