"""StopMatcher against a one-shot reference, for every way a stream can be cut into steps."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.stop_sequences import StopMatcher, check_stop_sequences


def reference(tokens: list[int], sequences: list[list[int]], include: bool, min_tokens: int):
    """(kept tokens, index of the matched sequence or None), token by token as vLLM would."""
    for end in range(1, len(tokens) + 1):
        if end <= min_tokens:
            continue
        for index, sequence in enumerate(sequences):
            if end >= len(sequence) and tokens[end - len(sequence) : end] == sequence:
                kept = end if include else end - len(sequence)
                return tokens[:kept], index
    return tokens, None


def run(matcher: StopMatcher, steps: list[list[int]]):
    """Feed the steps; (released tokens, matched index, kept, largest held-back count)."""
    released: list[int] = []
    pending: list[int] = []
    most_held = 0
    for number, step in enumerate(steps):
        final = number == len(steps) - 1
        check = matcher.feed(step, final=final)
        pending += step
        released += pending[: check.release]
        pending = pending[check.release :]
        if check.matched is not None:  # the rest of the step is dropped, not held
            return released, check.matched, check.kept, most_held
        most_held = max(most_held, len(pending))
    return released, None, len(released), most_held


def split(tokens: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(tokens) + 1) for c in cuts} | {0, len(tokens)})
    steps = [tokens[a:b] for a, b in zip(points, points[1:], strict=False)]
    return steps or [[]]


tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=40)
sequences_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=4)


@settings(max_examples=400, deadline=None)
@given(
    tokens_st,
    sequences_st,
    st.lists(st.integers(0, 40), max_size=8),
    st.booleans(),
    st.integers(0, 6),
)
def test_any_step_split_gives_the_one_shot_answer_and_never_retracts(
    tokens, sequences, cuts, include, min_tokens
):
    expected, expected_index = reference(tokens, sequences, include, min_tokens)
    matcher = StopMatcher(sequences, include=include, min_tokens=min_tokens)
    released, index, kept, most_held = run(matcher, split(tokens, cuts))
    assert index == expected_index
    assert kept == len(expected)
    # Held back: nothing sent is ever past the cut, so the client never retracts.
    assert released == expected
    assert most_held <= (0 if include else max(len(s) for s in sequences) - 1)


@settings(max_examples=200, deadline=None)
@given(tokens_st, sequences_st, st.lists(st.integers(0, 40), max_size=8))
def test_streaming_at_once_sends_everything_and_reports_the_cut(tokens, sequences, cuts):
    expected, expected_index = reference(tokens, sequences, False, 0)
    matcher = StopMatcher(sequences, hold_back=False)
    released, index, kept, most_held = run(matcher, split(tokens, cuts))
    assert index == expected_index and kept == len(expected)
    assert most_held == 0
    assert released[:kept] == expected  # the client keeps the first `kept` tokens


def test_overlapping_partial_matches_and_step_straddles():
    matcher = StopMatcher([[5, 5, 6]])
    assert matcher.feed([5]).release == 0  # could be the start
    assert matcher.feed([5]).release == 0
    check = matcher.feed([5])  # a, a, a: the first a can no longer start a match
    assert check.release == 1 and check.matched is None
    check = matcher.feed([6, 9])  # ... a, a, b completes; 9 is dropped
    assert (check.release, check.matched, check.kept) == (0, 0, 1)


def test_earliest_completion_wins_then_list_order():
    matcher = StopMatcher([[3, 4, 5], [4], [2, 3, 4]])
    check = matcher.feed([1, 2, 3, 4, 5], final=True)
    assert check.matched == 1 and check.kept == 3  # [4] and [2,3,4] end together: list order


def test_engine_stop_token_is_not_matched_unless_kept():
    check = StopMatcher([[7]]).feed([1, 7], engine_stopped=True, final=True)
    assert check.matched is None and check.release == 2
    check = StopMatcher([[7]], include=True).feed([1, 7], engine_stopped=True, final=True)
    assert check.matched == 0 and check.kept == 2


def test_min_tokens_lets_a_match_begin_but_not_end_inside_them():
    matcher = StopMatcher([[1, 2]], min_tokens=2)
    check = matcher.feed([1, 2, 1, 2], final=True)
    assert check.matched == 0 and check.kept == 2  # the first [1,2] ends at 2 <= min_tokens
    matcher = StopMatcher([[1, 2]], min_tokens=2)
    assert matcher.feed([9, 1, 2], final=True).kept == 1  # ends at 3 > 2, begins at 2


def test_flush_releases_what_was_held():
    matcher = StopMatcher([[1, 2, 3]])
    assert matcher.feed([7, 1, 2]).release == 1
    assert matcher.flush() == 2


def test_checks_name_the_bad_sequence():
    assert check_stop_sequences([[1], []], 10, 4, 4) == (
        "stop_token_sequences[1] is empty; each sequence needs at least one token."
    )
    assert "outside the vocabulary" in check_stop_sequences([[1, 10]], 10, 4, 4)
    assert "at most 4 allowed" in check_stop_sequences([[1]] * 5, 10, 4, 4)
    assert "has 5 tokens" in check_stop_sequences([[1] * 5], 10, 4, 4)
    assert check_stop_sequences([[0, 9]], 10, 4, 4) is None
