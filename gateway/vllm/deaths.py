"""Worker-death reports, from an EngineCore process to the gateway that started it.

vLLM's EngineCore tells its clients only "EngineDeadError" when a worker dies; the plugin
writes the worker's name and signal to ``$TMPDIR/engine-gateway-deaths-UID/<EngineCore
pid>`` first (``write_death_report``), and the gateway reads it for its ENGINE_DEAD
message (``death_report``). No vLLM import here.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable

_DEATHS_PREFIX = "engine-gateway-deaths"


def _deaths_folder() -> str:
    return os.path.join(tempfile.gettempdir(), f"{_DEATHS_PREFIX}-{os.getuid()}")


def write_death_report(engine_pid: int, text: str) -> None:
    """Record why engine process ``engine_pid``'s worker died (``death_report`` reads it)."""
    folder = _deaths_folder()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, str(engine_pid))
    with open(f"{path}.tmp", "w") as file:
        file.write(text)
    os.replace(f"{path}.tmp", path)


def death_report(engine_pids: Iterable[int], remove: bool = False) -> str | None:
    """What a worker of one of these engine processes died of, if one reported it;
    ``remove``: delete their reports (at start, of earlier processes with those pids)."""
    found = None
    for pid in engine_pids:
        path = os.path.join(_deaths_folder(), str(pid))
        try:
            with open(path) as file:
                found = found or file.read()
        except OSError:
            continue
        if remove:
            with contextlib.suppress(OSError):
                os.remove(path)
    return found
