"""verifiers' ``TrainClient`` over the gateway's socket: no HTTP server, no HTTP hop.

verifiers 0.4.0's ``TrainClient`` renders each turn with the ``renderers`` package and hands
the ids to ``renderers.client.generate``, which POSTs vLLM's generate body through an
``AsyncOpenAI`` client and parses vLLM's answer. ``GatewayTrainClient`` is that TrainClient
with the OpenAI client swapped for ``GatewayGenerate``: the body becomes a Generate on an
AsyncClient or GatewayPool (``X-Session-ID`` the routing key), and the answer is built as the
HTTP face builds it (client.http_face.responses), so a rollout is id for id the one through
``engine-gateway http``. Needs verifiers (in its own venv) and this package's client
(pyzmq, msgspec); not the ``http`` extra::

    client = GatewayTrainClient(TrainClientConfig(renderer_model_name=TOKENIZER), gateway)
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec
import openai
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig

from client.errors import ClientError, RequestFailed
from client.http_face.bodies import HttpError, options_from, parse_generate, sampling_from
from client.http_face.replies import error_of
from client.http_face.responses import generate_response
from client.results import completions_of
from codec import ModelInfo

__all__ = ["GatewayGenerate", "GatewayTrainClient"]

SESSION_ID_HEADER = "X-Session-ID"
_ERROR_TYPES = {
    400: openai.BadRequestError,
    401: openai.AuthenticationError,
    404: openai.NotFoundError,
    429: openai.RateLimitError,
}


class GatewayGenerate:
    """What ``renderers.client.generate`` uses of an ``AsyncOpenAI`` client (``post`` of a
    generate body, ``get`` of ``/models``, ``base_url``, ``close``), served by a gateway.

    ``client``: an AsyncClient or GatewayPool, connected (the caller owns it). A ``model``
    other than the served one names a LoRA adapter. Errors are the OpenAI SDK's
    (``openai.APIStatusError`` with vLLM's status and error body), as verifiers expects."""

    def __init__(self, client: Any):
        self.client = client
        self.base_url = httpx.URL("http://engine-gateway.invalid/v1")
        self._model: ModelInfo | None = None

    async def model(self) -> ModelInfo:
        if self._model is None:
            clients = getattr(self.client, "clients", [self.client])
            up = next((c for c in clients if c.connected), clients[0])
            self._model = (await up.model_info()).model
        return self._model

    async def get(self, path: str, **_: Any) -> dict[str, Any]:
        if path.rstrip("/") != "/models":
            raise self._error(HttpError(404, f"{path} is not served"), path)
        model = await self.model()
        return {"data": [{"id": model.name, "max_model_len": model.max_model_len}]}

    async def post(
        self, url: str, *, body: dict[str, Any], options: Any = None, **_: Any
    ) -> httpx.Response:
        headers = (options or {}).get("headers") or {}
        lora: str | None = None
        try:
            request = parse_generate(msgspec.json.encode(body))
            model = await self.model()
            lora = None if request.model in (None, model.name) else request.model
            sampling = sampling_from(request.sampling_params)
            stream = self.client.generate(
                request.token_ids,
                sampling,
                stream=False,
                options=options_from(request, lora, headers.get(SESSION_ID_HEADER)),
            )
            try:
                completions = await completions_of(stream)
            finally:
                await stream.aclose()
        except RequestFailed as exc:
            error = error_of(exc)
            if lora is not None and self._model and "is not loaded" in exc.message:
                error = HttpError(
                    404,
                    f"The model `{lora}` does not exist: the gateway serves"
                    f" `{self._model.name}`"
                    " (verifiers' model must be that name) and the LoRA adapters loaded on"
                    " it by name",
                    kind="NotFoundError",
                    param="model",
                )
            raise self._error(error, url) from exc
        except (HttpError, ClientError) as exc:
            raise self._error(error_of(exc), url) from exc
        answer = generate_response(
            f"generate-tokens-{stream.request_id}",
            request.model or model.name,
            int(time.time()),
            completions,
            request.token_ids,
            top_logprobs=sampling.logprobs,
            return_token_ids=bool(request.return_token_ids),
        )
        return httpx.Response(
            200, content=msgspec.json.encode(answer), request=httpx.Request("POST", url)
        )

    @staticmethod
    def _error(error: HttpError, url: str) -> openai.APIStatusError:
        response = httpx.Response(
            error.status, json=error.body(), request=httpx.Request("POST", url)
        )
        kind = _ERROR_TYPES.get(error.status)
        if kind is None:
            kind = openai.InternalServerError if error.status >= 500 else openai.APIStatusError
        return kind(error.message, response=response, body=error.body())

    async def close(self) -> None:
        """The gateway client is the caller's: it stays open."""


class GatewayTrainClient(TrainClient):
    """verifiers' TrainClient, its generate calls served by a gateway over the socket."""

    def __init__(self, config: TrainClientConfig, client: Any):
        super().__init__(config)
        self.client = GatewayGenerate(client)
