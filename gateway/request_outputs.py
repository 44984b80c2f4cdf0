"""The per-request output path: engine steps in, each client's RequestOutputs out.

What a sample's outputs carry (its tokens, held back while they may start a stop sequence;
its logprobs; the weight version of its tokens), and its one terminal: a RequestOutput
with ``Finished`` (counts, timings, version spans) when the engine or a stop sequence ends
it, or when the table ends it early (``end_requests``: the one way requests end early).
Functions of the session table, which owns the state; ``on_step`` runs for every output of
every engine step, so its common case is inline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from codec import (
    Error,
    ErrorCode,
    Finished,
    FinishReason,
    Logprobs,
    Outputs,
    RequestOutput,
    RequestTimings,
    WeightVersionSpan,
)

from .engine import StepOutput
from .session_model import Effects, Request, Sample

if TYPE_CHECKING:
    from .sessions import SessionTable

__all__ = ["end_requests", "on_step"]


def on_step(
    table: SessionTable, outputs: Sequence[StepOutput], now: float, weight_version: str | None
) -> Effects:
    """One engine step: at most one Outputs frame per client, and the engine ids to
    abort (samples a stop sequence ended)."""
    effects = Effects()
    per_client: dict[bytes, list[RequestOutput]] = {}
    by_engine_id = table.by_engine_id
    plain_tokens = 0
    for out in outputs:
        entry = by_engine_id.get(out.request_id)
        if entry is None:  # aborted or timed out already: its terminal was sent
            table.stats.late_outputs += 1
            continue
        request, sample = entry
        new_token_ids = out.new_token_ids
        if (
            # The common case, inline (it is most of the gateway's work per token):
            # streamed tokens mid-sample, nothing else to note or to hold back.
            new_token_ids
            and out.finish_reason is None
            and request.stream
            and sample.matcher is None
            and sample.first_token_at is not None
            and (weight_version is None or weight_version == sample.sent_version)
            and sample.version == sample.sent_version
            and out.new_logprobs is None
            and out.new_prompt_logprobs_tensors is None
            and out.prefill_stats is None
            and not out.events
        ):
            request.last_output_at = now
            sample.output_tokens += len(new_token_ids)
            plain_tokens += len(new_token_ids)
            reply = RequestOutput(request.request_id, new_token_ids, index=sample.index)
        else:
            reply = _sample_output(table, request, sample, out, now, effects.abort, weight_version)
        if reply is not None:
            bucket = per_client.get(request.client_id)
            if bucket is None:
                per_client[request.client_id] = [reply]
            else:
                bucket.append(reply)
    table.stats.output_tokens += plain_tokens
    effects.replies = [(client_id, Outputs(batch)) for client_id, batch in per_client.items()]
    return effects


def _sample_output(
    table: SessionTable,
    request: Request,
    sample: Sample,
    out: StepOutput,
    now: float,
    abort: list[str],
    weight_version: str | None,
) -> RequestOutput | None:
    """One engine output of a sample, beyond the common case: what the client gets now
    (None: nothing, every token held back or a non-streaming sample not done)."""
    _note_progress(request, sample, out, now, weight_version)
    new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
    reason = out.finish_reason
    stop_reason = out.stop_reason if isinstance(out.stop_reason, int) else None
    cut_to = None
    matcher = sample.matcher
    if matcher is not None:
        new_token_ids, new_logprobs, matched, cut_to = _hold_back(
            sample, new_token_ids, new_logprobs, reason
        )
        if matched is not None:
            if reason is None:
                abort.append(sample.engine_request_id)  # the engine would go on
            reason, stop_reason = FinishReason.STOP, matched
            table.stats.stop_sequence_hits += 1
    sample.output_tokens += len(new_token_ids)
    table.stats.output_tokens += len(new_token_ids)
    finished = None
    if reason is not None:
        if cut_to is not None:
            sample.output_tokens = cut_to
        table.stats.finished[FinishReason(reason).name] += 1
        finished = _finished(
            request, sample, FinishReason(reason), stop_reason, now, out.kv_transfer_params
        )
    if request.stream:
        if finished is not None:
            table.retire(request, sample)
        elif not new_token_ids and out.new_prompt_logprobs_tensors is None:
            return None  # every new token held back (a new version is told later)
        version = _version_news(sample) if new_token_ids else None
        prompt_logprobs = out.new_prompt_logprobs_tensors
        return RequestOutput(
            request.request_id, new_token_ids, finished, new_logprobs, prompt_logprobs,
            sample.index, version,
        )  # fmt: skip
    return _collect(table, request, sample, out, new_token_ids, new_logprobs, finished, cut_to)


def _note_progress(
    request: Request, sample: Sample, out: StepOutput, now: float, weight_version: str | None
) -> None:
    """What an output tells of its sample besides tokens: its first token's time, a new
    weight version, its prefill's cache facts, the engine's queue and schedule events."""
    if out.new_token_ids:
        request.last_output_at = now
        if sample.first_token_at is None:
            sample.first_token_at = now
        if weight_version is not None and weight_version != sample.version:
            # Tokens produced before this output: sent (or cut) plus held back.
            produced = sample.output_tokens + len(sample.held_ids)
            sample.versions.append((weight_version, produced))
            sample.version = weight_version
    stats = out.prefill_stats
    if stats is not None:
        sample.cached_tokens = stats.num_cached_tokens
        sample.external_cached_tokens = stats.num_external_cached_tokens
    if out.events:
        _note_events(sample, out.events)


def _hold_back(
    sample: Sample,
    new_token_ids: list[int],
    new_logprobs: Logprobs | None,
    reason: int | None,
) -> tuple[list[int], Logprobs | None, list[int] | None, int | None]:
    """The sample's stop sequences on its new tokens: the tokens (and logprobs) to send
    now, the sequence that matched (None: none), and the output's length after the cut."""
    matcher = sample.matcher
    assert matcher is not None
    check = matcher.feed(
        new_token_ids, engine_stopped=reason == FinishReason.STOP, final=reason is not None
    )
    if sample.held_ids:
        new_token_ids = sample.held_ids + new_token_ids
        new_logprobs = Logprobs.concat(sample.held_logprobs, new_logprobs)
    release = check.release
    held_ids, held_logprobs = new_token_ids[release:], Logprobs.rows(new_logprobs, release)
    new_token_ids = new_token_ids[:release]
    new_logprobs = Logprobs.rows(new_logprobs, 0, release)
    if check.matched is None:
        sample.held_ids, sample.held_logprobs = held_ids, held_logprobs
        return new_token_ids, new_logprobs, None, None
    sample.held_ids, sample.held_logprobs = [], None
    return new_token_ids, new_logprobs, matcher.sequences[check.matched], check.kept


def _collect(
    table: SessionTable,
    request: Request,
    sample: Sample,
    out: StepOutput,
    new_token_ids: list[int],
    new_logprobs: Logprobs | None,
    finished: Finished | None,
    cut_to: int | None,
) -> RequestOutput | None:
    """A non-streaming sample keeps everything until its terminal, its one output."""
    assert sample.token_ids is not None
    sample.token_ids.extend(new_token_ids)
    sample.logprobs = Logprobs.concat(sample.logprobs, new_logprobs)
    sample.prompt_logprobs = Logprobs.concat(
        sample.prompt_logprobs, out.new_prompt_logprobs_tensors
    )
    if finished is None:
        return None
    if cut_to is not None and len(sample.token_ids) > cut_to:
        del sample.token_ids[cut_to:]
        sample.logprobs = Logprobs.rows(sample.logprobs, 0, cut_to)
    table.retire(request, sample)
    return _final_output(request, sample, finished)


def _finished(
    request: Request,
    sample: Sample,
    reason: FinishReason,
    stop_reason: int | list[int] | None,
    now: float,
    kv_transfer_params: dict | None = None,
) -> Finished:
    def since(t: float | None) -> float | None:
        return None if t is None else t - request.accepted_at

    timings = RequestTimings(
        since(sample.queued_at),
        since(sample.scheduled_at),
        since(sample.first_token_at),
        now - request.accepted_at,
    )
    return Finished(
        reason,
        stop_reason,
        request.prompt_tokens,
        sample.output_tokens,
        sample.cached_tokens,
        kv_transfer_params,
        sample.external_cached_tokens,
        timings,
        _spans(sample.versions, sample.output_tokens) if sample.versions else None,
    )


def _final_output(request: Request, sample: Sample, finished: Finished) -> RequestOutput:
    """A non-streaming sample's one output: its tokens, named with the version of the
    last of them (Finished.weight_versions has every span)."""
    return RequestOutput(
        request.request_id,
        sample.token_ids if sample.token_ids is not None else [],
        finished,
        sample.logprobs,
        sample.prompt_logprobs,
        sample.index,
        _version_of_tokens(sample, len(sample.token_ids)) if sample.token_ids else None,
    )


def end_requests(
    table: SessionTable,
    requests: Sequence[Request],
    ending: FinishReason | tuple[ErrorCode, str],
    effects: Effects,
    *,
    now: float,
    tell_engine: bool = True,
    samples: set[int] | None = None,
) -> None:
    """End every live sample of ``requests`` now (only those of index in ``samples``,
    when given): the one way requests end early.

    ``ending`` is a FinishReason (each live sample gets a terminal
    RequestOutput with its tokens so far, one Outputs frame per client) or
    ``(code, message)`` (one terminal Error per request). The engine is told
    to stop every sample that was still live, unless ``tell_engine`` is off.
    Streamed tokens held back for stop sequences go out with the terminal.
    """
    terminals: dict[bytes, list[RequestOutput]] = {}
    for request in requests:
        live = [
            sample
            for sample in request.samples
            if not sample.done and (samples is None or sample.index in samples)
        ]
        if not live:
            continue
        for sample in live:
            if tell_engine:
                effects.abort.append(sample.engine_request_id)
            table.retire(request, sample)
        if isinstance(ending, tuple):
            code, message = ending
            effects.replies.append((request.client_id, Error(request.request_id, code, message)))
            continue
        table.stats.finished[ending.name] += len(live)
        bucket = terminals.setdefault(request.client_id, [])
        bucket.extend(_early_terminal(table, request, sample, ending, now) for sample in live)
    for client_id, outputs in terminals.items():
        effects.replies.append((client_id, Outputs(outputs)))


def _early_terminal(
    table: SessionTable, request: Request, sample: Sample, ending: FinishReason, now: float
) -> RequestOutput:
    """The terminal of a sample ended early, with the tokens it held back."""
    held, held_logprobs = sample.held_ids, sample.held_logprobs
    if sample.matcher is not None:
        sample.matcher.flush()
        sample.output_tokens += len(held)
        table.stats.output_tokens += len(held)
        sample.held_ids, sample.held_logprobs = [], None
    finished = _finished(request, sample, ending, None, now)
    if not request.stream:
        return _final_output(request, sample, finished)
    version = _version_news(sample) if held else None
    return RequestOutput(
        request.request_id, held, finished, held_logprobs, None, sample.index, version
    )


def _version_news(sample: Sample) -> str | None:
    """The weight version to name on an output of ``sample`` that carries tokens: the
    version of its last token when the client has not been told it yet, else None
    (unchanged). Not always the latest: a stop sequence may cut the tokens of a newer one."""
    version = _version_of_tokens(sample, sample.output_tokens)
    if version == sample.sent_version:
        return None
    sample.sent_version = version
    return version


def _version_of_tokens(sample: Sample, count: int) -> str | None:
    """The version of the last of ``sample``'s first ``count`` tokens (None: not known)."""
    version = None
    for name, first in sample.versions:
        if first >= count:
            break
        version = name
    return version


def _spans(starts: list[tuple[str, int]], output_tokens: int) -> list[WeightVersionSpan]:
    """Spans from where each version began, covering the first ``output_tokens`` tokens
    (after any stop-sequence cut)."""
    ends = [first for _, first in starts[1:]] + [output_tokens]
    return [
        WeightVersionSpan(version, first, min(end, output_tokens) - first)
        for (version, first), end in zip(starts, ends, strict=True)
        if first < output_tokens
    ]


def _note_events(sample: Sample, events: Sequence) -> None:
    """The engine's QUEUED (1) and first SCHEDULED (2) event times (vLLM EngineCoreEvent)."""
    for event in events:
        kind = int(event.type)
        if kind == 1 and sample.queued_at is None:
            sample.queued_at = event.timestamp
        elif kind == 2 and sample.scheduled_at is None:
            sample.scheduled_at = event.timestamp
