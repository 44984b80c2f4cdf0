"""Request bodies of vLLM's routes, checked as vLLM's pydantic models check them, into the
gateway's SamplingParams and RequestOptions.

As vLLM, a field this surface does not know is ignored. A field vLLM knows but the face
cannot serve over token ids (stop strings without a tokenizer, structured outputs,
multimodal features, routed experts, ...) is refused with a 400 naming it, never dropped.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from codec import RequestOptions, SamplingParams

__all__ = ["HttpError", "GenerateBody", "parse_generate", "sampling_from", "options_from"]

MAX_REQUEST_ID_CHARS = 256  # a caller's request id is echoed back and logged: bounded


class HttpError(Exception):
    """An answer in vLLM's error shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, kind: str = "", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind or _KINDS.get(status, "BadRequestError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


_KINDS = {
    400: "BadRequestError",
    401: "Unauthorized",
    403: "Forbidden",
    405: "MethodNotAllowedError",
    408: "RequestTimeout",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class GenerateBody(msgspec.Struct, frozen=True):
    """vLLM 0.32's ``GenerateRequest`` (scale_out/token_in_token_out/protocol.py)."""

    token_ids: list[int]
    sampling_params: dict[str, Any]
    request_id: str | None = None
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    output_mode: str = "tokens"
    return_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Fields vLLM knows that the face cannot serve: refused when given.
    features: Any = None
    content_parts: Any = None
    ec_transfer_params: Any = None
    reasoning_ended: Any = None
    reasoning_parser_kwargs: Any = None
    token_offsets: Any = None  # renderer metadata: accepted, unused


_UNSERVED_REQUEST_FIELDS = {
    "features": "multimodal features (send images through the native client: docs/IMAGES.md)",
    "content_parts": "multimodal content parts (docs/IMAGES.md: the native client)",
    "ec_transfer_params": "encoder-cache disaggregation",
    "reasoning_ended": "structured outputs (reasoning parser state)",
    "reasoning_parser_kwargs": "structured outputs (reasoning parser)",
}

# vLLM SamplingParams fields the gateway takes as they are (not its own stop sequences).
_GATEWAY_ONLY = {"stop_token_sequences", "include_stop_sequence", "hold_back_stop_sequences"}
_SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__) - _GATEWAY_ONLY
# vLLM fields the gateway does not serve, and the value that means "not used".
_UNSERVED_SAMPLING: dict[str, tuple[Any, str]] = {
    "stop": ((None, []), "stop strings need a tokenizer: use stop_token_ids"),
    "bad_words": ((None, []), "bad_words are strings: send bad_words_token_ids"),
    "structured_outputs": ((None,), "structured outputs are not served by the gateway"),
    "logprob_token_ids": ((None,), "logprobs of chosen token ids are not served"),
    "prompt_logprob_token_ids": ((None,), "prompt logprobs of chosen ids are not served"),
    "prompt_logprob_start": ((None, 0), "prompt_logprob_start is not served"),
    "flat_logprobs": ((None, False), "flat logprobs are not served"),
    "repetition_detection": ((None,), "repetition detection is not served"),
    "thinking_token_budget": ((None,), "thinking token budgets are not served"),
    "watermarking": ((None,), "watermarking is not served"),
    "extra_args": ((None, {}), "extra_args reach no engine through the gateway"),
    "routed_experts_prompt_start": ((None,), "routed experts are not served"),
    "trace_decode_token_ids": ((None, False), "decode traces are not served"),
}


def decode_json(raw: bytes) -> Any:
    """``msgspec.json.decode`` with vLLM's 400 for what is not JSON, or is nested too deep
    to read."""
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"JSON decode error: {exc}", kind="Bad Request") from None
    except RecursionError:
        raise _too_deep() from None


def _check_request_id(request_id: str | None) -> None:
    """A caller's request id is echoed back and logged: at most MAX_REQUEST_ID_CHARS."""
    if request_id is not None and len(request_id) > MAX_REQUEST_ID_CHARS:
        raise HttpError(
            400, f"request_id longer than {MAX_REQUEST_ID_CHARS} characters", param="request_id"
        )


def _too_deep() -> HttpError:
    return HttpError(400, "JSON decode error: nested too deeply", kind="Bad Request")


def _decode_error(exc: msgspec.MsgspecError) -> HttpError:
    message = str(exc)
    param = None
    if "at `$." in message:
        param = "body." + message.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0]
    elif message.startswith("Object missing required field `"):
        param = "body." + message.split("`")[1]
    return HttpError(400, message, kind="Bad Request", param=param)


def parse_generate(raw: bytes, *, text_output: bool = False) -> GenerateBody:
    """The body of ``/inference/v1/generate``, or an HttpError as vLLM answers it;
    ``text_output``: the face has a tokenizer (``output_mode: "text"`` is served)."""
    try:
        body = msgspec.json.decode(raw, type=GenerateBody)
    except msgspec.MsgspecError as exc:
        raise _decode_error(exc) from None
    except RecursionError:
        raise _too_deep() from None
    if not body.token_ids:
        raise HttpError(
            400, "token_ids must have at least 1 item", kind="Bad Request", param="body.token_ids"
        )
    if any(t < 0 for t in body.token_ids):
        raise HttpError(
            400,
            "token_ids must not contain negative values",
            kind="Bad Request",
            param="body.token_ids",
        )
    for name, what in _UNSERVED_REQUEST_FIELDS.items():
        if getattr(body, name) is not None:
            raise HttpError(400, f"{name}: {what}; not served by engine-gateway", param=name)
    _check_request_id(body.request_id)
    if body.output_mode not in ("tokens", "text"):
        raise HttpError(
            400,
            f"output_mode must be 'tokens' or 'text', got {body.output_mode!r}",
            param="output_mode",
        )
    if body.output_mode == "text":
        if not text_output:
            raise HttpError(
                400,
                "output_mode='text' requires a tokenizer, but this server does not load one."
                " Use output_mode='tokens' (detokenize on the client: client.text), or start"
                " the face with --tokenizer.",
                param="output_mode",
            )
        if body.sampling_params.get("detokenize") is False:
            raise HttpError(
                400,
                "output_mode='text' requires detokenize=True in sampling_params",
                param="output_mode",
            )
    return body


def sampling_from(fields: dict[str, Any]) -> SamplingParams:
    """vLLM's sampling_params object as the gateway's SamplingParams (the gateway checks
    the values as vLLM does); HttpError for a field it cannot serve or a wrong type."""
    taken: dict[str, Any] = {}
    for name, value in fields.items():
        if name in _SAMPLING_FIELDS:
            taken[name] = value
        elif name in _UNSERVED_SAMPLING:
            unused, why = _UNSERVED_SAMPLING[name]
            if value not in unused:
                raise HttpError(400, f"sampling_params.{name}: {why}", param=name)
        elif name == "detokenize" and value is not False and value is not True:
            raise HttpError(400, "sampling_params.detokenize must be a boolean", param=name)
        # Anything else is ignored, as vLLM ignores it: a field that only shapes text
        # (skip_special_tokens, include_stop_str_in_output: stop strings are refused
        # above, and a stop token id is in the ids either way), which this token-id
        # surface never makes, or one vLLM does not know.
    if isinstance(taken.get("logit_bias"), dict):
        taken["logit_bias"] = _int_keyed(taken["logit_bias"])
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
        value = taken.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            raise HttpError(400, f"sampling_params.{name} must be finite", param=name)
    try:
        return msgspec.convert(taken, SamplingParams, strict=False)
    except msgspec.ValidationError as exc:
        message = str(exc).replace("at `$.", "at `sampling_params.")
        raise HttpError(400, message, kind="Bad Request", param="body.sampling_params") from None


def _int_keyed(bias: dict[Any, Any]) -> dict[Any, Any]:
    """logit_bias arrives with string keys (JSON): vLLM reads them as token ids."""
    try:
        return {int(k): v for k, v in bias.items()}
    except (TypeError, ValueError):
        raise HttpError(400, "logit_bias keys must be token ids", param="logit_bias") from None


def options_from(
    body: GenerateBody | CompletionBody, lora_name: str | None, routing_key: str | None
) -> RequestOptions | None:
    """The request-level fields as RequestOptions (None when all are defaults)."""
    kv = body.kv_transfer_params
    if (
        body.priority == 0
        and body.cache_salt is None
        and kv is None
        and lora_name is None
        and routing_key is None
    ):
        return None
    return RequestOptions(
        priority=body.priority,
        cache_salt=body.cache_salt,
        kv_transfer_params=kv,
        lora_name=lora_name,
        routing_key=routing_key,
    )


class CompletionBody(msgspec.Struct, frozen=True):
    """vLLM 0.32's ``CompletionRequest``, its request-level fields; the sampling fields
    are the body's other keys (``parse_completion`` returns them)."""

    prompt: Any  # ids, a batch of ids, text or texts: checked by parse_completion
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool | None = False
    suffix: str | None = None
    use_beam_search: bool = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    prompt_embeds: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    mm_payload: Any = None


# CompletionRequest fields that are not sampling fields (the rest of the body is).
_COMPLETION_REQUEST_FIELDS = frozenset(CompletionBody.__struct_fields__) - {
    "logprobs",
    "max_tokens",
    "n",
}
_UNSERVED_COMPLETION_FIELDS = {
    "suffix": "suffix",
    "prompt_embeds": "prompt embeddings",
    "response_format": "structured outputs (response_format)",
    "structured_outputs": "structured outputs",
    "mm_payload": "multimodal input (docs/IMAGES.md: the native client)",
}


def parse_completion(
    raw: bytes, *, text_prompts: bool = False, max_prompts: int | None = None
) -> tuple[CompletionBody, list[Any], dict[str, Any]]:
    """The body of ``/v1/completions``: (body, prompts, the rest of its fields). Prompts are
    token-id lists, and with ``text_prompts`` (a tokenizer) also strings, at most
    ``max_prompts`` of them; HttpError for what the face cannot serve."""
    fields = decode_json(raw)
    if not isinstance(fields, dict):
        raise HttpError(400, "Request body must be a JSON object", kind="Bad Request")
    try:
        body = msgspec.convert(fields, CompletionBody, strict=False)
    except msgspec.ValidationError as exc:
        raise _decode_error(exc) from None
    for name, what in _UNSERVED_COMPLETION_FIELDS.items():
        if getattr(body, name) is not None:
            raise HttpError(400, f"{name}: {what} is not served by engine-gateway", param=name)
    if body.echo or body.use_beam_search:
        name = "echo" if body.echo else "use_beam_search"
        raise HttpError(400, f"{name} is not served by engine-gateway", param=name)
    _check_request_id(body.request_id)
    prompts = _prompts(body.prompt, text_prompts, max_prompts)
    sampling = {k: v for k, v in fields.items() if k not in _COMPLETION_REQUEST_FIELDS}
    sampling.setdefault("max_tokens", 16)  # the completions API's default, as vLLM's
    return body, prompts, sampling


def _prompts(prompt: Any, text_prompts: bool, max_prompts: int | None = None) -> list[Any]:
    """A completions prompt as a list of prompts: token-id lists (and strings when
    ``text_prompts``), at most ``max_prompts``."""
    single = isinstance(prompt, str) or (
        isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
    )
    prompts = [prompt] if single else prompt
    if not isinstance(prompts, list) or not prompts:
        raise HttpError(400, "Prompt cannot be empty", param="prompt")
    if max_prompts is not None and len(prompts) > max_prompts:
        raise HttpError(
            400,
            f"{len(prompts)} prompts in one request; this face takes at most {max_prompts}"
            " (--max-prompts-per-request)",
            param="prompt",
        )
    checked: list[Any] = []
    for one in prompts:
        if isinstance(one, str):
            if not text_prompts:
                raise HttpError(
                    400,
                    "text prompts need a tokenizer, which this face does not load: send token"
                    " ids, or start it with --tokenizer",
                    param="prompt",
                )
            if not one:
                raise HttpError(400, "Prompt cannot be empty", param="prompt")
            checked.append(one)
            continue
        try:
            ids = msgspec.convert(one, list[int])
        except msgspec.ValidationError:
            raise HttpError(
                400, "prompt must be token ids, text, or a list of them", kind="Bad Request",
                param="prompt",
            ) from None  # fmt: skip
        if not ids:
            raise HttpError(400, "Prompt cannot be empty", param="prompt")
        if any(t < 0 for t in ids):
            raise HttpError(400, "prompt token ids must not be negative", param="prompt")
        checked.append(ids)
    return checked
