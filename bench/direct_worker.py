"""The direct engine-core client in its own driver process (bench only).

    python -m bench.direct_worker MODEL [SETUP_JSON]   (an EngineSetup's fields)

vLLM's async engine-core client shares nothing with the other targets' clients
this way (in the benchmark's own process it delayed their socket wake-ups).
Commands arrive as JSON lines on stdin; each result is one stdout line starting
with ``DIRECT_RESULT `` (vLLM's own log lines are skipped by the reader).
"""

from __future__ import annotations

import asyncio
import json
import sys

from .targets import EngineSetup, InProcessDirectTarget
from .workload import Workload, closed_loop, open_loop

PREFIX = "DIRECT_RESULT "


async def main(model: str, setup: str = "{}") -> None:
    target = InProcessDirectTarget(model, EngineSetup(**json.loads(setup)))
    await target.start()
    print(PREFIX + json.dumps({"ready": True}), flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            cmd = json.loads(line)
            if cmd["op"] == "stop":
                break
            w = cmd["workload"]
            workload = Workload(
                tuple(w["prompt_len"]),
                tuple(w["output_len"]),
                seed=w["seed"],
                vocab_size=w["vocab_size"],
            )
            reqs = workload.requests(cmd["count"], salt=cmd["salt"])
            cpu0 = target.frontend_cpu_s()
            if cmd["mode"] == "closed":
                run = await closed_loop(target.stream, reqs, int(cmd["level"]))
            else:
                run = await open_loop(target.stream, reqs, cmd["level"], seed=cmd["salt"])
            result = {
                "wall_s": run.wall_s,
                "cpu_s": target.frontend_cpu_s() - cpu0,
                "records": [r.to_dict() for r in run.records],
            }
            print(PREFIX + json.dumps(result), flush=True)
    finally:
        await target.stop()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:3]))
