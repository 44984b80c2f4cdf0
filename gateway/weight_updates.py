"""Who may continue an open weight update, and when the gateway ends one itself.

Sans-IO: the server asks ``refusal`` before each engine-state control call (under its
engine-state lock), reports each call's outcome, and asks ``abandon_reason`` on every
housekeeping tick. Between StartWeightUpdate and its end the engine holds generation, so an
update belongs to the session that opened it; it ends with FinishWeightUpdate or
AbandonWeightUpdate, with a failed call, or here: when that session ends (the trainer died
or lost its connection) or no call came for ``stall_timeout_s`` (of the gateway's own
running time: ``forgive`` takes out a stall of its loop, as sessions' heartbeats do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from codec import (
    AbandonWeightUpdate,
    ClientMessage,
    FinishWeightUpdate,
    GetStats,
    ListLoras,
    StartWeightUpdate,
    UpdateWeights,
)

__all__ = ["OpenUpdate", "WeightUpdates"]

DEFAULT_STALL_TIMEOUT_S = 120.0
# Calls that continue (or end) an open update: only from the session that opened it.
_CONTINUING = (UpdateWeights, FinishWeightUpdate, AbandonWeightUpdate)


@dataclass
class OpenUpdate:
    owner: bytes  # the routing id of the session that opened it
    opened_at: float
    last_call_at: float  # when its latest call began or ended
    calls_in_flight: int = 0


class WeightUpdates:
    """The gateway's open weight update, if any (one at a time: the engine has one)."""

    def __init__(self, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S):
        self.stall_timeout_s = stall_timeout_s
        self.open: OpenUpdate | None = None
        self.abandoning = False  # the server is ending the open update itself

    def refusal(self, client_id: bytes, call: ClientMessage, now: float) -> str | None:
        """Why ``call`` from ``client_id`` may not run now (INVALID_REQUEST), or None."""
        update = self.open
        if isinstance(call, _CONTINUING):
            if update is None:
                return f"{type(call).__name__}: no weight update is open (StartWeightUpdate)"
            if update.owner != client_id:
                return f"{type(call).__name__}: the open weight update belongs to another session"
            return None
        if update is None or isinstance(call, (GetStats, ListLoras)):
            return None
        opened = now - update.opened_at
        whose = "this session" if update.owner == client_id else "another session"
        return (
            f"{type(call).__name__}: a weight update is open ({whose} opened it {opened:.1f}s"
            " ago and holds generation); FinishWeightUpdate ends it"
        )

    def call_began(self, call: ClientMessage, client_id: bytes, now: float) -> None:
        if self.open is not None and isinstance(call, _CONTINUING):
            self.open.calls_in_flight += 1
            self.open.last_call_at = now

    def call_ended(self, call: ClientMessage, client_id: bytes, ok: bool, now: float) -> None:
        """``call`` (refused by nobody) finished: ``ok`` when the engine call succeeded."""
        if isinstance(call, StartWeightUpdate):
            if ok:
                self.open = OpenUpdate(client_id, now, now)
            return
        update = self.open
        if update is None or not isinstance(call, _CONTINUING):
            return
        update.calls_in_flight -= 1
        update.last_call_at = now
        if isinstance(call, (FinishWeightUpdate, AbandonWeightUpdate)) or not ok:
            self.open = None  # a failed chunk ends the update (vLLM's rule)

    def abandon_reason(self, now: float, has_session: Callable[[bytes], bool]) -> str | None:
        """Why the gateway must end the open update now, or None."""
        update = self.open
        if update is None or self.abandoning:
            return None
        if not has_session(update.owner):
            return "the session that opened the weight update ended (trainer gone?)"
        idle = now - update.last_call_at
        if update.calls_in_flight == 0 and idle > self.stall_timeout_s:
            return (
                f"no call continued the weight update for {idle:.0f}s (stall timeout"
                f" {self.stall_timeout_s:.0f}s)"
            )
        return None

    def forgive(self, paused_s: float) -> None:
        """The gateway itself did not run for ``paused_s``: that is not the trainer's silence."""
        if self.open is not None:
            self.open.last_call_at += paused_s

    def abandoned(self) -> None:
        self.open = None
        self.abandoning = False
