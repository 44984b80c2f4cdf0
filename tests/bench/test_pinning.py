"""bench/pinning.py: engine processes on their cores, everything else on the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.pinning import split_cpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in a process of its own: pinning reaches the process that calls it.
SCRIPT = """
import json, os, subprocess, sys, time
from bench.pinning import pin_engines_apart, split_cpus

NAP = "import threading as t, time; t.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
engine = subprocess.Popen([sys.executable, "-c", NAP, "EngineCore_DP0"])
frontend = subprocess.Popen([sys.executable, "-c", NAP, "api_server"])
time.sleep(1.0)
engine_cpus, other_cpus = split_cpus(1)
counts = pin_engines_apart(engine_cpus, other_cpus)


def threads(pid):
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    return {tid: sorted(os.sched_getaffinity(tid)) for tid in tids}


out = {"counts": counts, "engine_cpus": sorted(engine_cpus), "other_cpus": sorted(other_cpus)}
out |= {"engine": threads(engine.pid), "frontend": threads(frontend.pid)}
out["self"] = threads(os.getpid())
print(json.dumps(out))
engine.kill()
frontend.kill()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cpus")
def test_engine_threads_go_to_the_last_core_and_every_other_thread_to_the_rest():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    engine, other = out["engine_cpus"], out["other_cpus"]
    assert engine == [max(os.sched_getaffinity(0))] and max(other) < engine[0]
    assert len(out["engine"]) == 2  # both of the engine's threads
    assert all(cpus == engine for cpus in out["engine"].values())
    assert all(cpus == other for cpus in [*out["frontend"].values(), *out["self"].values()])
    assert out["counts"]["engine"] == 2 and out["counts"]["other"] >= 3


def test_no_core_left_for_either_side_is_refused():
    cpus = len(os.sched_getaffinity(0))
    for cores in (0, cpus):
        with pytest.raises(SystemExit, match="--pin-engine-cores"):
            split_cpus(cores)
