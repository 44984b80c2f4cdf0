"""A pool request that starts once its HTTP caller has a slot: ``AdmittedStream``."""

from __future__ import annotations

import asyncio
from typing import Any

from codec import Finished, FinishReason, RequestOutput

from .fairness import CallerSlots

__all__ = ["AdmittedStream"]


class AdmittedStream:
    """``stream`` (a PoolStream, which starts when first iterated) run once ``caller``
    holds one of ``slots``; the slot is given back when it ends or is closed. Aborted
    while it waits for its slot, it never reaches a gateway and ends each of its
    ``samples`` with ABORT (no tokens), as an aborted request does."""

    def __init__(
        self, stream: Any, slots: CallerSlots, caller: str, *, samples: int, prompt_tokens: int
    ):
        self.stream = stream
        self.request_id: str = stream.request_id
        self._slots = slots
        self._caller = caller
        self._samples = samples
        self._prompt_tokens = prompt_tokens
        self._holding = False
        self._started = False
        self._ended = False
        self._aborts: list[RequestOutput] | None = None  # aborted before it started
        self._abort_wanted: asyncio.Future[None] | None = None

    @property
    def started(self) -> bool:
        """It holds a slot and went to the pool (aborts go there)."""
        return self._started

    def abort_waiting(self) -> bool:
        """Abort it if it still waits for its slot; False when it started or ended."""
        if self._started or self._ended or self._aborts is not None:
            return False
        self._aborts = [
            RequestOutput(
                self.request_id,
                [],
                Finished(FinishReason.ABORT, None, self._prompt_tokens, 0),
                index=index,
            )
            for index in range(self._samples)
        ]
        if self._abort_wanted is not None and not self._abort_wanted.done():
            self._abort_wanted.set_result(None)
        return True

    def __aiter__(self) -> AdmittedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._started and self._aborts is None:
            await self._wait_for_slot()
        if self._aborts is not None:
            if not self._aborts:
                self._ended = True
                raise StopAsyncIteration
            return self._aborts.pop(0)
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            self._end()
            raise

    async def _wait_for_slot(self) -> None:
        self._abort_wanted = asyncio.get_running_loop().create_future()
        taking = asyncio.ensure_future(self._slots.acquire(self._caller))
        try:
            await asyncio.wait({taking, self._abort_wanted}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller's cancellation: no slot kept
            if taking.done() and not taking.cancelled() and taking.exception() is None:
                self._slots.release(self._caller)
            else:
                taking.cancel()  # acquire() gives back a slot granted as it is cancelled
            raise
        if not taking.done():
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)
        if taking.cancelled():
            return  # aborted while waiting: self._aborts is set
        taking.result()  # a full queue's 429
        self._holding = True
        if self._aborts is not None:  # granted and aborted at once: it never starts
            self._end()
            return
        self._started = True

    def _end(self) -> None:
        self._ended = True
        if self._holding:
            self._holding = False
            self._slots.release(self._caller)

    def abort_samples(self, indices: Any) -> None:
        """As RequestStream.abort_samples (client.text ends a sample on a stop string)."""
        if self._started:
            self.stream.abort_samples(indices)

    async def aclose(self) -> None:
        try:
            await self.stream.aclose()  # an Abort when it is still live
        finally:
            self._end()
