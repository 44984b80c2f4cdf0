"""The open weight update's rules (sans-IO): who may continue it, which calls wait for its
end, and when the gateway ends it itself."""

from __future__ import annotations

from codec import (
    AbandonWeightUpdate,
    FinishWeightUpdate,
    GetStats,
    ListLoras,
    LoadLora,
    Pause,
    Resume,
    StartWeightUpdate,
    UpdateWeights,
)
from gateway.weight_updates import WeightUpdates

TRAINER, OTHER = b"trainer", b"other"


def opened(now: float = 0.0, timeout: float = 10.0) -> WeightUpdates:
    updates = WeightUpdates(stall_timeout_s=timeout)
    assert updates.refusal(TRAINER, StartWeightUpdate(1), now) is None
    updates.call_began(StartWeightUpdate(1), TRAINER, now)
    updates.call_ended(StartWeightUpdate(1), TRAINER, True, now)
    return updates


def test_chunks_and_finish_need_an_open_update_of_their_own_session():
    closed = WeightUpdates()
    for call in (UpdateWeights(1), FinishWeightUpdate(2)):
        assert "no weight update is open" in closed.refusal(TRAINER, call, 0.0)
    updates = opened()
    assert updates.refusal(TRAINER, UpdateWeights(3), 1.0) is None
    assert updates.refusal(TRAINER, FinishWeightUpdate(4), 1.0) is None
    for call in (UpdateWeights(5), FinishWeightUpdate(6)):
        assert "another session" in updates.refusal(OTHER, call, 1.0)


def test_engine_changing_calls_wait_for_the_end_and_reads_do_not():
    updates = opened()
    for call in (StartWeightUpdate(1), Pause(2), Resume(3), LoadLora(4, "a", "/a")):
        for client in (TRAINER, OTHER):
            assert "a weight update is open" in updates.refusal(client, call, 2.0)
    assert updates.refusal(OTHER, GetStats(5), 2.0) is None
    assert updates.refusal(OTHER, ListLoras(6), 2.0) is None


def test_a_failed_start_opens_nothing_and_a_failed_chunk_or_finish_ends_the_update():
    updates = WeightUpdates()
    updates.call_ended(StartWeightUpdate(1), TRAINER, False, 0.0)
    assert updates.open is None
    updates = opened()
    updates.call_began(UpdateWeights(2), TRAINER, 1.0)
    updates.call_ended(UpdateWeights(2), TRAINER, True, 1.5)
    assert updates.open is not None and updates.open.last_call_at == 1.5
    updates.call_began(UpdateWeights(3), TRAINER, 2.0)
    updates.call_ended(UpdateWeights(3), TRAINER, False, 2.5)
    assert updates.open is None
    updates = opened()
    updates.call_began(FinishWeightUpdate(4), TRAINER, 1.0)
    updates.call_ended(FinishWeightUpdate(4), TRAINER, False, 1.0)
    assert updates.open is None


def test_the_gateway_ends_an_update_whose_session_ended_or_that_stalled():
    updates = opened(timeout=10.0)
    assert updates.abandon_reason(5.0, lambda client: True) is None
    assert "session that opened" in updates.abandon_reason(5.0, lambda client: False)
    assert "no call continued" in updates.abandon_reason(10.5, lambda client: True)
    # A chunk under way is not silence, however long it takes.
    updates.call_began(UpdateWeights(2), TRAINER, 1.0)
    assert updates.abandon_reason(100.0, lambda client: True) is None
    updates.call_ended(UpdateWeights(2), TRAINER, True, 100.0)
    assert updates.abandon_reason(105.0, lambda client: True) is None
    # Once the server is ending it, it is not asked to again.
    updates.abandoning = True
    assert updates.abandon_reason(500.0, lambda client: False) is None
    updates.abandoned()
    assert updates.open is None and not updates.abandoning


def test_a_successful_finish_or_abandon_closes_the_update_and_only_its_owner_may_abandon():
    for end in (FinishWeightUpdate(2), AbandonWeightUpdate(2)):
        updates = opened()
        assert "another session" in updates.refusal(OTHER, end, 1.0)
        assert updates.refusal(TRAINER, end, 1.0) is None
        updates.call_began(end, TRAINER, 1.0)
        assert updates.open.calls_in_flight == 1
        updates.call_ended(end, TRAINER, True, 1.5)
        assert updates.open is None
    assert "no weight update is open" in updates.refusal(TRAINER, AbandonWeightUpdate(3), 2.0)


def test_the_stall_clock_counts_from_the_last_call_and_skips_the_gateways_own_stalls():
    updates = opened(timeout=10.0)
    assert updates.abandon_reason(10.0, lambda client: True) is None  # not past it yet
    assert "no call continued" in updates.abandon_reason(10.01, lambda client: True)
    updates.forgive(5.0)  # the gateway's loop did not run for 5 s: not the trainer's silence
    assert updates.abandon_reason(15.0, lambda client: True) is None
    assert "no call continued" in updates.abandon_reason(15.01, lambda client: True)
    WeightUpdates().forgive(3.0)  # nothing open: nothing to move
