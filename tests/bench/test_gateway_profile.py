"""The profiling tools' own logic: py-spy and cProfile summaries, GC timing, the send and
receive cost probes."""

from __future__ import annotations

import gc

from bench.probes.gateway_profile import gc_timer, summarize_collapsed
from bench.probes.send_cost import measure


def test_collapsed_stacks_are_summarized_by_own_and_inclusive_share(tmp_path):
    path = tmp_path / "p.collapsed"
    path.write_text(
        "main (m.py:1);loop (l.py:2);decode (d.py:3) 3\nmain (m.py:1);loop (l.py:2) 1\n"
    )
    text = summarize_collapsed(path)
    own, inclusive = text.split("total %")
    assert "samples: 4" in own
    assert " 75.00  decode (d.py:3)" in own and " 25.00  loop (l.py:2)" in own
    assert "main (m.py:1)" not in own  # never a leaf
    assert "100.00  main (m.py:1)" in inclusive and "100.00  loop (l.py:2)" in inclusive


def test_gc_timer_counts_collections_by_generation():
    counts = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
    hook = gc_timer(counts)
    gc.callbacks.append(hook)
    try:
        gc.collect(1)
        gc.collect(2)
    finally:
        gc.callbacks.remove(hook)
    assert counts[0][0] == 0 and counts[1][0] == 1 and counts[2][0] == 1
    assert counts[2][1] > 0.0


def test_send_cost_reports_the_sender_and_io_thread_cpu_per_send():
    result = measure(frames=200, size=100, interval=0.0)
    assert result["interval_s"] == 0.0
    assert result["sender_thread_us_per_send"] > 0.0
    assert result["zmq_io_threads_us_per_send"] >= 0.0


def test_thread_sleeps_count_this_threads_waits():
    import time

    from bench.probes.gateway_profile import thread_sleeps

    before = thread_sleeps()["main"]
    for _ in range(5):
        time.sleep(0.001)
    assert thread_sleeps()["main"] - before >= 5


def test_thread_schedstat_counts_this_threads_running_time():
    import time

    from bench.probes.gateway_profile import thread_schedstat

    running0, runnable0 = thread_schedstat()["main"]
    deadline = time.thread_time() + 0.05
    while time.thread_time() < deadline:  # 50 ms on a core
        pass
    running1, runnable1 = thread_schedstat()["main"]
    assert running1 - running0 >= 0.04
    assert runnable1 >= runnable0


def test_a_lean_struct_reads_vllms_engine_step_frame_and_the_savings_are_measured():
    import msgspec

    from bench.probes.engine_decode import LeanOutputs, engine_step_frames, measure

    frames = engine_step_frames(3)
    assert len(frames) == 1  # no out-of-band tensors in a plain token step
    step = msgspec.msgpack.decode(frames[0], type=LeanOutputs)
    assert [(o.request_id, o.new_token_ids) for o in step.outputs] == [
        ("g0.0-00000000", [1000]),
        ("g0.1-00000001", [1001]),
        ("g0.2-00000002", [1002]),
    ]
    result = measure(8)
    assert result["vllm_decode_us_per_step"] > 0 and result["lean_decode_us_per_step"] > 0
    per_step = result["vllm_decode_us_per_step"] - result["lean_decode_us_per_step"]
    assert abs(result["decode_saving_us_per_output"] * 8 - per_step) < 0.2  # per output


def test_cprofile_summary_gives_calls_and_cpu_per_engine_step():
    import cProfile
    import time

    from bench.probes.gateway_profile import summarize_cprofile

    def step() -> int:
        return sum(range(2000))

    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    for _ in range(10):
        step()
    profiler.disable()
    text = summarize_cprofile(profiler, steps=5)
    assert text.startswith("cProfile, thread CPU clock; per engine step (5 steps)")
    rows = [line for line in text.splitlines() if line.endswith("(step)")]
    assert len(rows) == 2  # in both tables
    calls, own, cumulative = (float(x) for x in rows[0].split()[:3])
    assert calls == 2.0  # 10 calls over 5 steps
    assert cumulative >= own > 0.0


def test_recv_cost_receives_every_frame_each_way_and_reports_cpu_per_frame():
    import asyncio

    from bench.probes.recv_cost import compare

    result = asyncio.run(asyncio.wait_for(compare(50, 100, 0.001, rounds=1), 60))
    assert set(result["receiver_us_per_frame"]) == {"asyncio", "watched", "fd"}
    for runs in result["receiver_us_per_frame"].values():
        assert len(runs) == 1 and runs[0] > 0.0  # returned: all 50 frames arrived
