"""The HTTP face: vLLM 0.32's routes for RL frameworks, on aiohttp, over a GatewayPool.

Data routes (``/inference/v1/generate``, ``/v1/models``, ...) need the operator's bearer
token when one is set (as ``vllm serve --api-key``), unless ``open_data_routes`` (a
framework client that sends no token, as TRL's). Control routes
(pause, weights, LoRA, abort of every request, ...) always need it: without ``--api-key``
they answer 401. A control route reaches every gateway of the pool (each serves its own
engines), and the gateways must allow the face's key (``--control-key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from client.errors import ClientError
from client.pool import GatewayPool
from client.results import completions_of
from codec import ModelInfo

from .bodies import (
    GenerateBody,
    HttpError,
    options_from,
    parse_generate,
    sampling_from,
)
from .completions import CompletionRoutes
from .control import ControlRoutes
from .replies import error_of, json_answer, json_object, package_version, sse
from .responses import final_usage, generate_response, stream_chunk, usage

__all__ = ["HttpFace", "build_app"]

logger = logging.getLogger("engine_gateway.http")

MAX_BODY_BYTES = 64 << 20  # a 2M-token prompt as JSON fits; anything larger gets 413
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpFace(CompletionRoutes, ControlRoutes):
    """The routes' state: the pool, the served model, the loaded adapters, live requests."""

    def __init__(
        self,
        pool: GatewayPool,
        model: ModelInfo,
        *,
        served_model_name: str | None = None,
        api_key: str | None = None,
        open_data_routes: bool = False,
        tokenizer: Any = None,
    ):
        self.pool = pool
        self.model = model
        self.model_name = served_model_name or model.name
        self.api_key = api_key
        self.open_data_routes = open_data_routes
        self.tokenizer = tokenizer  # client.text's TextTokenizer: text on /v1/completions
        self.created = int(time.time())
        self.loras: dict[str, str] = {}  # adapter name -> the path it was loaded from
        # The face's request ids (as answered) -> the pool's ids, while live.
        self.live: dict[str, set[str]] = {}
        self.fingerprint = f"engine-gateway-{package_version()}"

    # ---- live requests, by the id answered (callers may reuse one: each keeps its own)

    def track(self, answer_id: str, pool_id: str) -> None:
        self.live.setdefault(answer_id, set()).add(pool_id)

    def untrack(self, answer_id: str, pool_id: str) -> None:
        ids = self.live.get(answer_id)
        if ids is not None:
            ids.discard(pool_id)
            if not ids:
                del self.live[answer_id]

    # ---- access

    def _bearer_ok(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {self.api_key}"
        return hmac.compare_digest(given.encode(), expected.encode())

    def check_data_access(self, request: web.Request) -> None:
        if self.api_key is not None and not self.open_data_routes and not self._bearer_ok(request):
            raise HttpError(401, "Unauthorized: a bearer token is needed (--api-key)")

    def check_control_access(self, request: web.Request) -> None:
        if self.api_key is None:
            raise HttpError(
                401, "control routes need the operator's token: start the face with --api-key"
            )
        if not self._bearer_ok(request):
            raise HttpError(401, "Unauthorized: control routes need the operator's bearer token")

    # ---- generate

    def lora_for(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 otherwise."""
        if model is None or model == self.model_name or model == self.model.name:
            return None
        if model in self.loras:
            return model
        raise HttpError(
            404, f"The model `{model}` does not exist.", kind="NotFoundError", param="model"
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.check_data_access(request)
        body = parse_generate(await request.read())
        lora = self.lora_for(body.model)
        sampling = sampling_from(body.sampling_params)
        base = body.request_id or request.headers.get("X-Request-Id") or os.urandom(8).hex()
        request_id = f"generate-tokens-{base}"
        options = options_from(body, lora, request.headers.get("X-Session-ID"))
        stream = self.pool.generate(
            body.token_ids, sampling, stream=bool(body.stream), options=options
        )
        self.track(request_id, stream.request_id)
        try:
            if body.stream:
                return await self._stream(request, body, request_id, stream, sampling.logprobs)
            return await self._whole(body, request_id, stream, sampling.logprobs)
        finally:
            self.untrack(request_id, stream.request_id)
            await stream.aclose()  # an Abort when it is still live (the HTTP client left)

    async def _whole(
        self, body: GenerateBody, request_id: str, stream: Any, top: int | None
    ) -> web.Response:
        completions = await completions_of(stream)
        return json_answer(
            generate_response(
                request_id,
                body.model or self.model_name,
                int(time.time()),
                completions,
                body.token_ids,
                top_logprobs=top,
                return_token_ids=bool(body.return_token_ids),
            )
        )

    async def _stream(
        self,
        request: web.Request,
        body: GenerateBody,
        request_id: str,
        stream: Any,
        top: int | None,
    ) -> web.StreamResponse:
        outputs = aiter(stream)
        first = await anext(outputs)  # a refused request answers with its error, not a stream
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        prompt_ids = body.token_ids if body.return_token_ids else None
        generated: dict[int, int] = {}
        prompt_tokens = len(body.token_ids)
        out: Any = first
        try:
            while True:
                generated[out.index] = generated.get(out.index, 0) + len(out.new_token_ids)
                if out.finished is not None:
                    prompt_tokens = out.finished.prompt_tokens
                running = usage(prompt_tokens, generated[out.index]) if continuous else None
                chunk = stream_chunk(
                    request_id,
                    out,
                    top_logprobs=top,
                    prompt_token_ids=prompt_ids,
                    running_usage=running,
                )
                prompt_ids = None
                await response.write(sse(chunk))
                try:
                    out = await anext(outputs)
                except StopAsyncIteration:
                    break
            if include_usage:
                final = final_usage(prompt_tokens, sum(generated.values()))
                last = {"request_id": request_id, "usage": final, "output_mode": "tokens"}
                last["choices"] = []
                await response.write(sse(last))
        except ClientError as exc:  # mid-stream: vLLM sends the error as a data line
            await response.write(sse(error_of(exc).body()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def abort_requests(self, request: web.Request) -> web.Response:
        """vLLM's ``/abort_requests``: the named requests (the ids answered; a data route),
        or, with none named, every request of the face (a control route)."""
        body = await json_object(request)
        named = body.get("request_ids")
        if named is not None and not (
            isinstance(named, list) and all(isinstance(i, str) for i in named)
        ):
            raise HttpError(400, "request_ids must be a list of strings", param="request_ids")
        if named:
            self.check_data_access(request)
            ids = [pool_id for i in named for pool_id in self.live.get(i, ())]
        else:
            self.check_control_access(request)
            ids = [pool_id for ids in self.live.values() for pool_id in ids]
        if ids:
            await self.pool.abort(ids)
        return json_answer({"status": "aborted", "aborted": len(ids)})

    # ---- models, health

    async def models(self, request: web.Request) -> web.Response:
        self.check_data_access(request)
        cards = [self._card(self.model_name, self.model.name, None)]
        cards += [self._card(name, path, self.model_name) for name, path in self.loras.items()]
        return json_answer({"object": "list", "data": cards})

    def _card(self, name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
            "max_model_len": self.model.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }

    async def health(self, request: web.Request) -> web.Response:
        replies = await self.pool.health()
        serving = any(r is not None and r.ready for r in replies.values())
        return web.Response(status=200 if serving else 503)

    async def _healths(self) -> list[Any]:
        return [r for r in (await self.pool.health()).values() if r is not None]

    @staticmethod
    def _ranks(healths: list[Any]) -> int:
        """Data-parallel ranks over the gateways that answered (each gateway's engines)."""
        return sum(max(len(r.engines), 1) for r in healths)

    async def is_paused(self, request: web.Request) -> web.Response:
        self.check_data_access(request)
        return json_answer({"is_paused": any(r.paused for r in await self._healths())})

    async def world_size(self, request: web.Request) -> web.Response:
        """Data-parallel ranks over the pool's gateways (each gateway's engines)."""
        self.check_data_access(request)
        return json_answer({"world_size": self._ranks(await self._healths())})

    async def server_info(self, request: web.Request) -> web.Response:
        """vLLM's ``/server_info`` in its JSON form, with what the gateways tell: the model,
        its length and served name, the data-parallel ranks. The weight-transfer backend is
        not among them: ``weight_transfer_config`` is null (docs/FRAMEWORKS.md)."""
        self.check_data_access(request)
        healths = await self._healths()
        config = {
            "model_config": {
                "model": self.model.name,
                "served_model_name": self.model_name,
                "max_model_len": self.model.max_model_len,
                "skip_tokenizer_init": True,
            },
            "parallel_config": {"data_parallel_size": self._ranks(healths)},
            "weight_transfer_config": None,
        }
        if request.query.get("config_format") != "json":
            return json_answer({"vllm_config": str(config)})
        gateways = [{"state": r.state, "paused": r.paused} for r in healths]
        return json_answer({"vllm_config": config, "engine_gateway": {"gateways": gateways}})

    async def finish_session(self, request: web.Request) -> web.Response:
        """SkyRL's router route (``POST /finish_session?session_id=``), called at the end of
        each trajectory to release what a session-aware router holds for it. The face holds
        nothing per session (its X-Session-ID is each request's routing key, which the
        gateways age out), so, as a router that tracks no sessions, it answers 200."""
        self.check_data_access(request)
        return web.Response(status=200)

    async def refused_route(self, request: web.Request) -> web.Response:
        why = _REFUSED.get(request.path, "")
        raise HttpError(
            404,
            f"{request.path} is not served by engine-gateway's HTTP face{why}"
            " (docs/FRAMEWORKS.md lists its routes)",
            kind="NotFoundError",
        )


_REFUSED = {
    "/v1/chat/completions": ": chat templates are the client's (client.text's Conversation)",
    "/skyrl/v1/generate": ": routed experts are not served by the gateway",
    "/tokenize": ": tokenize in the client (client.text)",
    "/detokenize": ": detokenize in the client (client.text)",
}


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure answers in vLLM's error shape; nothing else is disturbed."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 413:
            too_large = HttpError(413, f"request body over {MAX_BODY_BYTES} bytes")
            return json_answer(too_large.body(), 413)
        if exc.status in (404, 405):
            unknown = HttpError(exc.status, exc.reason, kind="NotFoundError")
            return json_answer(unknown.body(), exc.status)
        raise
    except (HttpError, ClientError, TimeoutError) as exc:
        error = error_of(exc)
        return json_answer(error.body(), error.status)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:
        logger.exception("route %s failed", request.path)
        error = error_of(exc)
        return json_answer(error.body(), error.status)


ROUTES: list[tuple[str, str, str]] = [
    ("POST", "/inference/v1/generate", "generate"),
    ("POST", "/v1/completions", "completions"),
    ("POST", "/inference/v1/abort_requests", "abort_requests"),
    ("POST", "/abort_requests", "abort_requests"),
    ("GET", "/v1/models", "models"),
    ("GET", "/health", "health"),
    ("GET", "/server_info", "server_info"),
    ("GET", "/get_world_size", "world_size"),
    ("GET", "/is_paused", "is_paused"),
    ("POST", "/pause", "pause"),
    ("POST", "/resume", "resume"),
    ("POST", "/reset_prefix_cache", "reset_prefix_cache"),
    ("POST", "/sleep", "sleep"),
    ("POST", "/wake_up", "wake_up"),
    ("POST", "/update_weights", "update_weights"),
    ("POST", "/init_weight_transfer_engine", "init_weight_transfer"),
    ("POST", "/start_weight_update", "start_weight_update"),
    ("POST", "/finish_weight_update", "finish_weight_update"),
    ("POST", "/shutdown_weight_transfer_engine", "shutdown_weight_transfer"),
    ("POST", "/update_weight_version", "update_weight_version"),
    ("POST", "/v1/load_lora_adapter", "load_lora"),
    ("POST", "/load_lora_adapter", "load_lora"),
    ("POST", "/v1/unload_lora_adapter", "unload_lora"),
    ("POST", "/unload_lora_adapter", "unload_lora"),
    ("POST", "/finish_session", "finish_session"),  # SkyRL's router's
    # vLLM routes the face names and refuses (a 404 naming the route and why).
    ("POST", "/v1/chat/completions", "refused_route"),
    ("POST", "/skyrl/v1/generate", "refused_route"),
    ("POST", "/tokenize", "refused_route"),
    ("POST", "/detokenize", "refused_route"),
    ("POST", "/start_draft_weight_update", "refused_route"),
    ("POST", "/weight_checker", "refused_route"),
]


def build_app(face: HttpFace) -> web.Application:
    """The aiohttp application serving ``face``'s routes."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    for method, path, name in ROUTES:
        app.router.add_route(method, path, getattr(face, name))
    return app


@contextlib.asynccontextmanager
async def serving(face: HttpFace, host: str, port: int) -> Any:
    """Serve ``face`` on ``host:port`` until the block ends; yields the bound port."""
    runner = web.AppRunner(build_app(face), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield bound
    finally:
        await runner.cleanup()
