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
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from client.errors import ClientError
from client.pool import GatewayPool
from client.text.logprob_tokens import LogprobTokenText
from client.text.stream import TextStream
from codec import ModelInfo, RequestOptions, SamplingParams

from .access import Access, Caller, routing_key
from .admitted import AdmittedStream
from .bodies import MAX_REQUEST_ID_CHARS, HttpError, options_from, parse_generate, sampling_from
from .completions import CompletionRoutes
from .control import ControlRoutes
from .fairness import CallerSlots
from .generate import GenerateAnswer
from .limits import MAX_BODY_BYTES, FaceLimits
from .pieces import Piece, fold, pieces_of
from .replies import (
    MAX_CONTROL_BODY_BYTES,
    error_of,
    json_answer,
    json_object,
    package_version,
    read_body,
)
from .text import TextPrompts, text_params_from

__all__ = ["HttpFace", "build_app", "serving"]

logger = logging.getLogger("engine_gateway.http")

MAX_ABORT_IDS = 4096  # request ids in one /abort_requests body
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HttpFace(CompletionRoutes, ControlRoutes):
    """The routes' state: the pool, the served model, the loaded adapters, live requests,
    and the callers' shares of the gateways' budget."""

    def __init__(
        self,
        pool: GatewayPool,
        model: ModelInfo,
        *,
        served_model_name: str | None = None,
        api_key: str | None = None,
        open_data_routes: bool = False,
        tokenizer: Any = None,
        limits: FaceLimits | None = None,
    ):
        self.pool = pool
        self.model = model
        self.model_name = served_model_name or model.name
        self.access = Access(api_key, open_data_routes)
        self.tokenizer = tokenizer  # client.text's TextTokenizer: text on the data routes
        self.limits = limits or FaceLimits()
        self.created = int(time.time())
        self.loras: dict[str, str] = {}  # adapter name -> the path it was loaded from
        # Per caller, the request ids answered -> their streams, while live.
        self.live: dict[tuple[str, str], set[AdmittedStream]] = {}
        self.fingerprint = f"engine-gateway-{package_version()}"
        self.slots = CallerSlots(
            self.limits.capacity(pool),
            per_caller=self.limits.per_caller(pool),
            queued_per_caller=self.limits.max_queued_per_caller,
        )
        self.text = TextPrompts(tokenizer, model.max_model_len) if tokenizer is not None else None
        # Logprob tokens' texts; made once (it reads the whole tokenizer's configuration).
        self.token_text = LogprobTokenText(tokenizer) if tokenizer is not None else None

    # ---- live requests, per caller, by the id answered (a reused id keeps each)

    def admit(
        self,
        caller: Caller,
        answer_id: str,
        stream: Any,
        *,
        samples: int,
        prompt_tokens: int,
    ) -> AdmittedStream:
        """``stream`` (a pool request, not yet started) run in ``caller``'s share, and
        tracked under ``answer_id`` for the caller's aborts."""
        admitted = AdmittedStream(
            stream, self.slots, caller.key, samples=samples, prompt_tokens=prompt_tokens
        )
        self.live.setdefault((caller.key, answer_id), set()).add(admitted)
        return admitted

    def untrack(self, caller: Caller, answer_id: str, admitted: AdmittedStream) -> None:
        streams = self.live.get((caller.key, answer_id))
        if streams is not None:
            streams.discard(admitted)
            if not streams:
                del self.live[(caller.key, answer_id)]

    # ---- access

    def check_data_access(self, request: web.Request) -> Caller:
        return self.access.data(request)

    def check_control_access(self, request: web.Request) -> Caller:
        return self.access.control(request)

    def check_request_rights(self, request: web.Request, body: Any) -> None:
        """Request fields the gateway takes only from clients it allows control calls
        (which the face is): the HTTP caller must be the operator."""
        if body.kv_transfer_params is not None:
            self.access.control(request, "kv_transfer_params (the KV blocks an engine loads)")

    # ---- generate

    def lora_for(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 otherwise."""
        if model is None or model == self.model_name:  # as vllm serve: with
            return None  # --served-model-name, the model's path is not a name it serves
        if model in self.loras:
            return model
        raise HttpError(
            404,
            f"The model `{model}` does not exist: this face serves `{self.model_name}` and the"
            " LoRA adapters loaded on it (/v1/models lists them)",
            kind="NotFoundError",
            param="model",
        )

    def text_params(self, fields: dict[str, Any]) -> Any:
        """The text-side fields of a body (stop strings, special tokens) as client.text's
        TextParams, taken out of ``fields``; None without a tokenizer (sampling_from then
        refuses what needs one)."""
        if self.tokenizer is None:
            return None
        return text_params_from(fields)

    def answer_id(self, request: web.Request, given: str | None, prefix: str) -> str:
        """The id answered: the body's (its parser bounded it), else X-Request-Id's, else
        a random one."""
        header = request.headers.get("X-Request-Id")
        if not given and header is not None and len(header) > MAX_REQUEST_ID_CHARS:
            raise HttpError(
                400, f"X-Request-Id longer than {MAX_REQUEST_ID_CHARS} characters",
                param="X-Request-Id",
            )  # fmt: skip
        return f"{prefix}{given or header or os.urandom(8).hex()}"

    def start(
        self,
        caller: Caller,
        answer_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        options: RequestOptions | None,
        *,
        stream: bool,
        text: Any = None,
    ) -> tuple[AsyncIterator[Piece], AdmittedStream]:
        """One prompt's request in ``caller``'s share, tracked under ``answer_id``: its
        pieces (through client.text with ``text``, a TextParams) and the admitted stream
        (to close). Nothing reaches a gateway before the pieces are iterated."""
        admitting = _Admitting(self, caller, answer_id, sampling.n or 1, len(prompt))
        if text is None:
            outputs: Any = admitting.generate(prompt, sampling, stream=stream, options=options)
        else:
            outputs = TextStream(
                admitting, self.tokenizer, prompt, sampling, text,
                stream=stream, request_id=None, options=options,
            )  # fmt: skip
        assert admitting.admitted is not None
        eos = self.tokenizer.hf.eos_token_id if self.tokenizer is not None else None
        return pieces_of(outputs, text=text is not None, eos_token_id=eos), admitting.admitted

    async def generate(self, request: web.Request) -> web.StreamResponse:
        caller = self.check_data_access(request)
        limit = self.limits.body_bytes(self.model, 1)
        raw = await read_body(request, limit, self.limits.read_timeout_s)
        body = parse_generate(raw, text_output=self.tokenizer is not None)
        self.check_request_rights(request, body)
        lora = self.lora_for(body.model)
        fields = dict(body.sampling_params)
        text = self.text_params(fields) if body.output_mode == "text" else None
        sampling = sampling_from(fields)
        self.limits.check_samples(1, sampling.n or 1)
        request_id = self.answer_id(request, body.request_id, "generate-tokens-")
        options = options_from(body, lora, routing_key(caller, request))
        pieces, admitted = self.start(
            caller, request_id, body.token_ids, sampling, options,
            stream=bool(body.stream), text=text,
        )  # fmt: skip
        decode = self.token_text.text if self.token_text is not None else None
        answer = GenerateAnswer(request_id, body, sampling.logprobs, decode, text is not None)
        try:
            if body.stream:
                return await answer.streamed(request, pieces)
            samples = await fold(pieces)
            return json_answer(
                answer.whole(body.model or self.model_name, int(time.time()), samples)
            )
        finally:
            self.untrack(caller, request_id, admitted)
            await admitted.aclose()  # an Abort when it is still live (the HTTP client left)

    async def abort_requests(self, request: web.Request) -> web.Response:
        """vLLM's ``/abort_requests``: the named requests of this caller (the ids answered;
        a data route), or, with none named (or no body), every request of the face (a
        control route). ``aborted`` counts the requests the gateways confirmed aborted."""
        caller = self.check_data_access(request)
        body = await json_object(request, allow_empty=True, limit=MAX_CONTROL_BODY_BYTES)
        named = body.get("request_ids")
        if named is not None and not (
            isinstance(named, list)
            and len(named) <= MAX_ABORT_IDS
            and all(isinstance(i, str) for i in named)
        ):
            raise HttpError(
                400,
                f"request_ids must be a list of at most {MAX_ABORT_IDS} strings",
                param="request_ids",
            )
        if named:
            streams = [s for i in named for s in self.live.get((caller.key, i), ())]
        else:
            self.check_control_access(request)
            streams = [s for ss in self.live.values() for s in ss]
        aborted = sum(stream.abort_waiting() for stream in streams)
        started = [s.stream.request_id for s in streams if s.started]
        if started:
            acks = await self.pool.abort(started)
            aborted += sum(len(ack.aborted) for ack in acks)
        return json_answer({"status": "aborted", "aborted": aborted})

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


class _Admitting:
    """The pool as client.text's TextStream sees it: the one request it starts runs in the
    caller's share (HttpFace.admit)."""

    def __init__(self, face: HttpFace, caller: Caller, answer_id: str, samples: int, prompt: int):
        self.face, self.caller, self.answer_id = face, caller, answer_id
        self.samples, self.prompt_tokens = samples, prompt
        self.admitted: AdmittedStream | None = None

    def generate(self, prompt: list[int], sampling: SamplingParams, **kwargs: Any) -> Any:
        self.admitted = self.face.admit(
            self.caller, self.answer_id, self.face.pool.generate(prompt, sampling, **kwargs),
            samples=self.samples, prompt_tokens=self.prompt_tokens,
        )  # fmt: skip
        return self.admitted


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
            kind = "NotFoundError" if exc.status == 404 else "MethodNotAllowedError"
            unknown = HttpError(exc.status, exc.reason, kind=kind)
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
    # keepalive_timeout also closes a connection whose request head has not arrived in time
    # (aiohttp closes a connection idle in reading a request when it fires); a body is
    # bounded by read_body.
    runner = web.AppRunner(
        build_app(face),
        handler_cancellation=True,
        access_log=None,
        keepalive_timeout=face.limits.read_timeout_s,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield bound
    finally:
        await runner.cleanup()
        if face.text is not None:
            face.text.close()
