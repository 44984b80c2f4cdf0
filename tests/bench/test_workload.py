"""RequestRecord: timings the garbage collector need not walk, and their JSON trip."""

from __future__ import annotations

import gc
import json

from bench.workload import RequestRecord


def test_token_times_are_not_walked_item_by_item_by_the_collector():
    record = RequestRecord(start=0.0)
    for _ in range(512):
        record.got(1)
    assert len(record.token_times) == 512
    # A list would hand the collector all 512 floats to visit on every full collection.
    assert len(gc.get_referents(record.token_times)) <= 1


def test_a_record_survives_the_direct_drivers_json_trip():
    record = RequestRecord(start=1.5, prompt_len=7)
    record.got(2)
    record.got(0)  # a frame with no tokens is not a token arrival
    record.got(1)
    record.end = record.token_times[-1] + 0.001
    back = RequestRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert back == record
    assert back.output_tokens == 3 and len(back.token_times) == 2
    assert back.itls == record.itls
