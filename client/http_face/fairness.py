"""Fair shares of the face's gateway budget among its HTTP callers: ``CallerSlots``.

Every HTTP caller reaches the gateways through the face's one session, so the gateways'
per-client limit (``max_in_flight_per_client``, summed over the pool) is one budget for all
of them. ``CallerSlots`` hands it out per caller (a caller is its bearer token, or its
address when it sends none): a request runs when its caller holds fewer than
``per_caller`` slots and the budget has one free; otherwise it waits, as ``vllm serve``
queues (in the caller's own FIFO, at most ``queued_per_caller`` waiting, beyond that a 429
naming the limit). A freed slot goes to the waiting caller holding the fewest, so a caller
that sent a thousand prompts cannot keep another from its next request.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .bodies import HttpError

__all__ = ["CallerSlots"]


@dataclass
class _Caller:
    held: int = 0
    waiting: collections.deque[tuple[int, asyncio.Future[None]]] = field(
        default_factory=collections.deque
    )


class CallerSlots:
    """``capacity`` slots (a gateway request each) shared fairly among callers."""

    def __init__(self, capacity: int, *, per_caller: int, queued_per_caller: int):
        if capacity < 1 or per_caller < 1 or queued_per_caller < 0:
            raise ValueError("capacity and per_caller must be positive, the queue not negative")
        self.capacity = capacity
        self.per_caller = min(per_caller, capacity)
        self.queued_per_caller = queued_per_caller
        self.held = 0
        self._callers: dict[str, _Caller] = {}
        self._order = itertools.count()  # ties between callers: who waited first

    def holding(self, caller: str) -> int:
        """The slots ``caller`` holds now."""
        state = self._callers.get(caller)
        return state.held if state else 0

    def waiting(self, caller: str) -> int:
        state = self._callers.get(caller)
        return len(state.waiting) if state else 0

    @contextlib.asynccontextmanager
    async def slot(self, caller: str) -> AsyncIterator[None]:
        """Hold one of ``caller``'s slots for the block (``acquire`` and ``release``)."""
        await self.acquire(caller)
        try:
            yield
        finally:
            self.release(caller)

    async def acquire(self, caller: str) -> None:
        """One of ``caller``'s slots: at once, or after waiting for it (cancellable); an
        HttpError 429 when the caller already has its queue full. ``release`` gives it
        back."""
        state = self._callers.setdefault(caller, _Caller())
        if not state.waiting and self._free_for(state):
            self._grant(state)
            return
        if len(state.waiting) >= self.queued_per_caller:
            self._forget_if_idle(caller)
            raise HttpError(
                429,
                f"this caller has {state.held} requests running and {len(state.waiting)}"
                f" waiting, the most the face queues for one caller"
                f" (--max-queued-per-caller {self.queued_per_caller}); retry later",
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (next(self._order), waiter)
        state.waiting.append(entry)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():  # granted as it was cancelled
                self.release(caller)
            else:
                state.waiting.remove(entry)
                self._forget_if_idle(caller)
            raise

    def _free_for(self, state: _Caller) -> bool:
        return self.held < self.capacity and state.held < self.per_caller

    def _grant(self, state: _Caller) -> None:
        state.held += 1
        self.held += 1

    def release(self, caller: str) -> None:
        """Give back a slot ``acquire`` took."""
        state = self._callers[caller]
        state.held -= 1
        self.held -= 1
        self._wake()
        self._forget_if_idle(caller)

    def _wake(self) -> None:
        """Grant free slots to waiting callers, the one holding the fewest first."""
        while self.held < self.capacity:
            ready = [
                (s.held, s.waiting[0][0], s)
                for s in self._callers.values()
                if s.waiting and s.held < self.per_caller
            ]
            if not ready:
                return
            _, _, state = min(ready, key=lambda r: (r[0], r[1]))
            _, waiter = state.waiting.popleft()
            self._grant(state)
            waiter.set_result(None)

    def _forget_if_idle(self, caller: str) -> None:
        state = self._callers.get(caller)
        if state is not None and not state.held and not state.waiting:
            del self._callers[caller]
