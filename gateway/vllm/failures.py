"""vLLM's failures, as the gateway tells them: a dead engine (with the worker death its
EngineCore reported) and the text of a refused utility or worker call."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Awaitable, Iterable, Iterator
from typing import Any

from ..errors import EngineDead, RequestRejected
from .deaths import death_report

logger = logging.getLogger(__name__)

__all__ = ["engine_death_named", "engine_failure", "files_call", "vllm_failure_text"]


def engine_failure(exc: BaseException, engine_pids: Iterable[int] = ()) -> EngineDead:
    """What clients are told when vLLM's output task ended with ``exc``; a worker death
    that an engine process in ``engine_pids`` reported is named."""
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(exc, EngineDeadError):  # its own text points at a log only we can see
        cause = death_report(engine_pids)
        if cause is not None:
            logger.error("the engine core failed: %s", cause)
            return EngineDead(f"the engine core failed: {cause}")
        return EngineDead(
            "the engine core failed (vLLM's EngineDeadError: the cause is in the gateway's log)"
        )
    return EngineDead(f"engine process failed: {exc!r}")


# How vLLM reports a utility call that raised in the engine, and in its workers.
_UTILITY_FAILURE = re.compile(r"Call to \w+ method failed: (?P<text>.*)", re.DOTALL)


_WORKER_FAILURE = re.compile(
    r"Worker failed with error '(?P<text>.*)', please check the stack trace above.*", re.DOTALL
)


@contextlib.contextmanager
def engine_death_named(engine_pids: Iterable[int] = ()) -> Iterator[None]:
    """Within: vLLM's EngineDeadError (a control call to a dead engine) is ``EngineDead``,
    which the server answers with ENGINE_DEAD, not INTERNAL."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError as exc:
        raise engine_failure(exc, engine_pids) from exc


def vllm_failure_text(exc: BaseException) -> str:
    """vLLM's words for a failed utility or worker call, less its pointer to a stack trace
    only the gateway's log has."""
    text = str(exc)
    for pattern in (_UTILITY_FAILURE, _WORKER_FAILURE):
        if match := pattern.fullmatch(text):
            text = match["text"]
    return text


async def files_call(operation: str, call: Awaitable[Any], engine_pids: Iterable[int] = ()) -> Any:
    """An engine call whose input the caller named (weights, an adapter, a transfer map).
    vLLM's refusal is the caller's: ``RequestRejected`` (INVALID_REQUEST) with vLLM's words,
    less its pointer to a stack trace only the gateway's log has; a dead engine is
    ``EngineDead``."""
    try:
        with engine_death_named(engine_pids):
            return await call
    except EngineDead:
        raise
    except Exception as exc:
        text = vllm_failure_text(exc)
        logger.warning("%s refused: %s", operation, text)
        raise RequestRejected(f"{operation} failed: {text}") from exc
