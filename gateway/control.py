"""Control operations: which engine call each allowed control message makes, and its reply.

Rule: only these message types exist, each mapped here to a fixed engine method; nothing
read from the wire names a method. Authorization and Pause(abort)'s terminals happen
before, in SessionTable.on_control; the paused state changes here, once the engine call
succeeded. The server runs ``control_reply`` as its own task (those in
``ENGINE_STATE_CALLS`` one at a time) and sends what it returns.
"""

from __future__ import annotations

import time
from typing import Any

from codec import (
    CONTROL_MESSAGES,
    AbandonWeightUpdate,
    ControlDone,
    FinishWeightUpdate,
    GetStats,
    InitWeightTransfer,
    ListLoras,
    LoadLora,
    Pause,
    ReloadWeights,
    ResetPrefixCache,
    Resume,
    ServerMessage,
    SetWeightVersion,
    ShutdownWeightTransfer,
    Sleep,
    StartWeightUpdate,
    StatsReply,
    UnloadLora,
    UpdateWeights,
    WakeUp,
)

from .errors import RequestRejected
from .sessions import SessionTable
from .weight_updates import WeightUpdates

__all__ = ["ENGINE_STATE_CALLS", "control_reply"]

# Calls that change the engine's state run one at a time, in the order they arrived: two
# LoadLora at once picked the same adapter id, and vLLM served one adapter under both names.
ENGINE_STATE_CALLS = tuple(c for c in CONTROL_MESSAGES if c not in (GetStats, ListLoras))


async def control_reply(
    engine: Any,
    table: SessionTable,
    call: Any,
    client_id: bytes = b"",
    updates: WeightUpdates | None = None,
    now: float = 0.0,
) -> ServerMessage:
    """Make ``call``'s engine call; its ControlDone or StatsReply. Engine errors propagate
    (the server turns them into Errors carrying the call_id). ``engine``: an Engine with
    ``engine.EngineControls``' methods (an unsupported one raises NotImplementedError,
    which the server answers UNSUPPORTED). ``updates``: the open weight update, which
    refuses calls that may not run while it is open (RequestRejected)."""
    if updates is not None and (problem := updates.refusal(client_id, call, now)):
        raise RequestRejected(problem)
    if updates is None:
        return await _engine_call(engine, table, call)
    updates.call_began(call, client_id, now)
    ok = False
    try:
        reply = await _engine_call(engine, table, call)
        ok = True
        return reply
    finally:
        updates.call_ended(call, client_id, ok, time.monotonic())


async def _engine_call(engine: Any, table: SessionTable, call: Any) -> ServerMessage:
    call_id = call.call_id
    match call:
        case Pause(mode=mode, clear_cache=clear_cache):
            await engine.pause(mode, clear_cache)
            table.paused = True  # not before: a failed Pause leaves the state as it was
            table.stats.pause_calls += 1
            return ControlDone(call_id, "pause", mode)
        case Resume():
            await engine.resume()
            table.paused = False
            return ControlDone(call_id, "resume")
        case ResetPrefixCache(reset_running=reset_running):
            done = await engine.reset_prefix_cache(reset_running)
            return ControlDone(call_id, "reset_prefix_cache", done)
        case ReloadWeights(path=path, version=version):
            result = await engine.reload_weights(path, version)
            return ControlDone(call_id, "reload_weights", result)
        case SetWeightVersion(version=version):
            await engine.set_weight_version(version)
            return ControlDone(call_id, "set_weight_version", version)
        case Sleep(level=level):
            await engine.sleep(level)
            return ControlDone(call_id, "sleep", level)
        case WakeUp(tags=tags):
            await engine.wake_up(tags)
            return ControlDone(call_id, "wake_up")
        case LoadLora(name=name, path=path):
            await engine.load_lora(name, path)
            return ControlDone(call_id, "load_lora", name)
        case UnloadLora(name=name):
            await engine.unload_lora(name)
            return ControlDone(call_id, "unload_lora", name)
        case ListLoras():
            return ControlDone(call_id, "list_loras", await engine.list_loras())
        case GetStats():
            gateway = table.gateway_stats()
            gateway.update(await engine.encoder_cache_counts())
            return StatsReply(call_id, engine.engine_stats(), gateway)
        case InitWeightTransfer(init_info=init_info):
            result = await engine.init_weight_transfer(init_info)
            return ControlDone(call_id, "init_weight_transfer", result)
        case StartWeightUpdate(pause=mode):
            # Generation is held while layers wait for their tensors; a client's own pause
            # stays its own (it resumes), the gateway's hold ends with the update.
            await engine.start_weight_update(hold=not table.paused, mode=mode or "keep")
            return ControlDone(call_id, "start_weight_update")
        case UpdateWeights(update_info=update_info):
            await engine.update_weights(update_info)
            return ControlDone(call_id, "update_weights")
        case FinishWeightUpdate(version=version):
            result = await engine.finish_weight_update(version)
            return ControlDone(call_id, "finish_weight_update", result)
        case AbandonWeightUpdate():
            await engine.abandon_weight_update("its trainer abandoned it (AbandonWeightUpdate)")
            return ControlDone(call_id, "abandon_weight_update")
        case ShutdownWeightTransfer():
            await engine.shutdown_weight_transfer()
            return ControlDone(call_id, "shutdown_weight_transfer")
    raise TypeError(f"not a control call: {call!r}")  # the table passes only the above
