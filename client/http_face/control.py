"""The control routes of vLLM's RL and dev routers (pause, resume, weights, LoRA, sleep):
each a control call on every gateway of the pool, behind the operator's bearer token."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from .bodies import HttpError
from .replies import error_of, json_answer, json_object, query_bool, query_int


class ControlRoutes:
    """The control routes of HttpFace (a mixin: it reads the face's pool and adapters)."""

    pool: Any
    model: Any
    model_name: str
    loras: dict[str, str]

    def check_control_access(self, request: web.Request) -> None:  # pragma: no cover
        raise NotImplementedError

    async def on_every_gateway(
        self,
        call: Callable[[Any], Awaitable[Any]],
        *,
        undo: Callable[[Any], Awaitable[Any]] | None = None,
    ) -> list[Any]:
        """``call(client)`` on every gateway with a session (control: each has its
        engines), all carried to their end. When some fail, the answer names each of them
        and why (with the first failure's status); ``undo(client)`` is then called on the
        gateways where ``call`` succeeded, so the pool is left as it was."""
        clients = [c for c in self.pool.clients if c.connected]
        if not clients:
            raise HttpError(503, "no gateway session")
        results = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
        failed = [
            (c, r) for c, r in zip(clients, results, strict=True) if isinstance(r, BaseException)
        ]
        if not failed:
            return list(results)
        done = [
            c for c, r in zip(clients, results, strict=True) if not isinstance(r, BaseException)
        ]
        if undo is not None and done:
            await asyncio.gather(*(undo(c) for c in done), return_exceptions=True)
        first = error_of(failed[0][1])
        why = "; ".join(f"{c.address}: {error_of(r).message}" for c, r in failed)
        undone = f" (undone on the {len(done)} that succeeded)" if undo and done else ""
        raise HttpError(
            first.status,
            f"failed on {len(failed)} of {len(clients)} gateways{undone}: {why}",
            kind=first.kind,
            param=first.param,
        )

    async def pause(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise HttpError(400, f"mode must be abort, wait or keep, got {mode!r}", param="mode")
        clear = query_bool(request, "clear_cache", True)
        await self.on_every_gateway(lambda c: c.pause(mode, clear_cache=clear and mode != "keep"))
        return json_answer({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        await self.on_every_gateway(lambda c: c.resume())
        return json_answer({"status": "resumed"})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        running = query_bool(request, "reset_running_requests", False)
        results = await self.on_every_gateway(lambda c: c.reset_prefix_cache(reset_running=running))
        return json_answer({"success": all(bool(r) for r in results)})

    async def sleep(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        level = query_int(request, "level", 1, 0, 2)
        await self.on_every_gateway(lambda c: c.sleep(level))
        return json_answer({"status": "sleeping", "level": level})

    async def wake_up(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        tags = request.query.getall("tags", []) or None
        await self.on_every_gateway(lambda c: c.wake_up(tags))
        return json_answer({"status": "awake", "tags": tags})

    async def update_weights(self, request: web.Request) -> web.Response:
        """prime-rl's ``{"weight_dir"}`` reload from a checkpoint, or vLLM's weight-transfer
        ``{"update_info"}`` chunk."""
        self.check_control_access(request)
        body = await json_object(request)
        if "weight_dir" in body:
            path = body["weight_dir"]
            if not isinstance(path, str) or not path:
                raise HttpError(400, "weight_dir must be a folder path", param="weight_dir")
            # The weights' version names the folder unless the body names one: outputs
            # across the reload then report two spans (the same name would merge them).
            version = body.get("weight_version", path)
            if not isinstance(version, str) or not version:
                raise HttpError(400, "weight_version must be a string", param="weight_version")
            await self.on_every_gateway(lambda c: c.reload_weights(path, version=version))
            return json_answer({"status": "ok", "message": "Weights updated"})
        info = body.get("update_info")
        if not isinstance(info, dict | list):
            raise HttpError(400, "update_weights needs weight_dir or update_info")
        await self.on_every_gateway(lambda c: c.update_weights(info))
        return json_answer({"message": "Weights updated"})

    async def init_weight_transfer(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        info = (await json_object(request)).get("init_info")
        if not isinstance(info, dict):
            raise HttpError(400, "init_info must be an object", param="init_info")
        done = await self.on_every_gateway(lambda c: c.init_weight_transfer_engine(info))
        # The backend's answer, per gateway (the `cpu` backend's: the folder for the buffers).
        results = [d.result for d in done]
        return json_answer({"message": "Weight transfer initialized", "results": results})

    async def start_weight_update(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        await self.on_every_gateway(lambda c: c.start_weight_update())
        return json_answer({"message": "Weight update started"})

    async def finish_weight_update(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        version = (await json_object(request, allow_empty=True)).get("weight_version")
        if version is not None and not isinstance(version, str):
            raise HttpError(400, "weight_version must be a string", param="weight_version")
        await self.on_every_gateway(lambda c: c.finish_weight_update(version))
        return json_answer({"message": "Weight update finished"})

    async def shutdown_weight_transfer(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        await self.on_every_gateway(lambda c: c.shutdown_weight_transfer_engine())
        return json_answer({"message": "Weight transfer shut down"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        version = (await json_object(request)).get("new_version")
        if not isinstance(version, str):
            raise HttpError(400, "new_version must be a string", param="new_version")
        await self.on_every_gateway(lambda c: c.set_weight_version(version))
        return json_answer({"success": True, "new_version": version})

    async def load_lora(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        body = await json_object(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise HttpError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in (self.model_name, self.model.name):
            raise HttpError(400, f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.loras:
            if not body.get("load_inplace"):
                raise HttpError(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load"
                    " the adapter in place, set 'load_inplace' to True.",
                )
            await self.on_every_gateway(lambda c: c.unload_lora(name))
            del self.loras[name]
        # A gateway that refuses it: the others unload it again, so a retry can load it.
        await self.on_every_gateway(
            lambda c: c.load_lora(name, path), undo=lambda c: c.unload_lora(name)
        )
        self.loras[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        self.check_control_access(request)
        name = (await json_object(request)).get("lora_name")
        if not isinstance(name, str) or name not in self.loras:
            raise HttpError(
                404, f"The lora adapter '{name}' cannot be found.", kind="NotFoundError"
            )
        await self.on_every_gateway(lambda c: c.unload_lora(name))
        del self.loras[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
