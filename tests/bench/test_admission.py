"""bench.probes.admission's summary of a burst: stage times after the first send, first batch."""

from bench.probes.admission import _markdown, _summary


def _row(sent: float, scheduled: float, **more: float) -> dict:
    return {"sent": sent, "validated": sent + 0.001, "submitted": sent + 0.002,
            "scheduled": scheduled, **more}  # fmt: skip


def test_the_first_batch_is_the_first_128_sent_and_times_count_from_the_first_send():
    # 200 requests sent 1 ms apart from t=10 s; the first 128 scheduled at +50 ms, the rest
    # at +600 ms (the next wave); one request's engine events never came (left out).
    rows = [_row(10 + i / 1000, 10.05 if i < 128 else 10.6) for i in range(200)]
    rows.append({"sent": 10.3, "validated": 10.301})
    summary = _summary("gateway", 201, 32, rows)

    assert summary["first_batch_last_ms"]["sent"] == 127.0
    assert summary["first_batch_last_ms"]["scheduled"] == 50.0
    assert summary["all_last_ms"]["scheduled"] == 600.0
    assert summary["all_last_ms"]["sent"] == 300.0
    assert summary["first_batch_last_ms"]["decoded"] is None  # no gateway stage here
    assert summary["median_gap_ms"]["validated->submitted"] == 1.0
    assert summary["validation_total_ms"] == 201.0  # 1 ms each, from the send


def test_markdown_takes_medians_over_rounds_and_skips_stages_an_arm_lacks():
    rounds = [
        _summary("direct", 2, None, [_row(1.0, 1.0 + s), _row(1.0, 1.0 + s)])
        for s in (0.010, 0.030, 0.020)
    ]
    text = _markdown(rounds)
    assert "| direct | 2 | - | scheduled | 20.0 | 20.0 | 20.0 |" in text
    assert "| decoded |" not in text
