"""A multi-turn conversation kept as token ids: each turn's prompt is the previous prompt,
the completion's ids exactly as sampled, and the ids of the messages added since, rendered
by the chat template as a delta. Earlier text is never tokenized again, so the ids a
trainer scores are the ids the sampler produced.

The delta. The messages after a completion are rendered after a fixed base the template
renders the same every turn: the conversation's system messages, a stand-in user message
and a stand-in assistant message whose text is a sentinel (``_BASE_*``), which is never
the last message (there, templates add think blocks or drop the end of turn). The delta
is the text after the sentinel: the template's end of turn, the new messages and the
generation prompt. A completion that ended on a special token (its stop token: ``<|im_end|>``,
``<|eot_id|>``, ``</s>``, GPT-OSS's ``<|return|>``) has ended its turn, so the special
token the template puts after a message is not added again; one that did not (a length
cut, a stop string) gets it. The delta is tokenized after a special token, as it sits in
the conversation (a Metaspace tokenizer adds no ``▁`` there).

History. Some templates render earlier turns differently once the conversation goes on:
Qwen3, QwQ and DeepSeek-R1 drop earlier turns' ``<think>`` text, Mistral v0.3 and Nemo move
the system prompt into the last user message, GPT-OSS renders a final answer's
``<|return|>`` as ``<|end|>``. A conversation keeps the ids as sampled (on-policy, what RL
needs) and records, in ``divergences``, each turn where the template's own rendering of the
whole conversation would differ, and how; with ``strict=True`` such a turn is refused
(``TextError``) instead. Every failure is a ``TextError`` naming the template, raised
before the conversation changes: a retry gives the same ids as a first try.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from codec import FinishReason, Logprobs

from .tokenizer import TextError, TextTokenizer

__all__ = ["Conversation", "Divergence", "Turn"]

Message = Mapping[str, Any]
# Stand-in messages the template renders before a delta; their text is cut off again.
_SENTINEL = "\ue000engine-gateway-sentinel\ue001"
_BASE_USER = {"role": "user", "content": "engine-gateway base message"}
_BASE_ASSISTANT = {"role": "assistant", "content": _SENTINEL}
_SNIPPET = 40  # characters either side of a divergence, in its description


@dataclass(frozen=True, slots=True)
class Turn:
    """Ids ``start:end`` of the conversation: template and messages (``sampled`` false)
    or a completion as sampled (``sampled`` true)."""

    start: int
    end: int
    sampled: bool
    messages: tuple[Message, ...] = ()


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where the chat template's rendering of the whole conversation differs from the
    conversation kept (found when ``at_turn`` was added): from turn ``turn`` on (an index
    of ``turns``), the conversation holds ``kept`` where the template renders
    ``rendered`` (each up to 40 characters from the first difference)."""

    at_turn: int
    turn: int
    kept: str
    rendered: str

    def describe(self) -> str:
        return f"turn {self.turn} holds {self.kept!r} where the template renders {self.rendered!r}"


@dataclass(slots=True)
class Conversation:
    """A conversation's ids for one model's chat template.

    ``Conversation.start(tokenizer, messages)`` renders the first prompt
    (``apply_chat_template`` with the generation prompt). Then, per turn:
    ``add_completion(completion)`` with the completion as sampled, and
    ``add_messages([...])`` with the user, tool or observation messages that follow;
    ``prompt_ids`` is the next turn's prompt. ``token_ids``, ``sampled_mask`` and
    ``sampled_logprobs`` are what a trainer needs; ``turns`` the boundaries;
    ``divergences`` where the template would render the history otherwise.
    """

    tokenizer: TextTokenizer
    token_ids: list[int] = field(default_factory=list)
    sampled_mask: list[bool] = field(default_factory=list)
    sampled_logprobs: list[float | None] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    strict: bool = False
    template_name: str = ""
    divergences: list[Divergence] = field(default_factory=list)
    _texts: list[str] = field(default_factory=list)  # each turn's text, as kept
    _awaiting_completion: bool = False
    _ended_on: str = ""  # the special token the last completion ended on (its turn), if any
    _message_end: str | None = None  # the special token the template ends a message with

    @classmethod
    def start(
        cls,
        tokenizer: TextTokenizer,
        messages: Sequence[Message],
        *,
        strict: bool = False,
        template_name: str | None = None,
        **template_kwargs: Any,
    ) -> Conversation:
        """The conversation's first prompt: ``messages`` rendered with the generation
        prompt. ``template_kwargs`` go to every rendering (``tools=...``,
        ``enable_thinking=...``, ``chat_template=...``). ``strict``: refuse a turn the
        template would render the history around differently (see the module docstring).
        ``template_name``: how errors name the template (default: the tokenizer's path)."""
        name = template_name or getattr(tokenizer.hf, "name_or_path", "") or "the tokenizer's"
        conversation = cls(
            tokenizer, template_kwargs=dict(template_kwargs), strict=strict, template_name=name
        )
        messages = _checked(messages)
        text = conversation._render(messages, add_generation_prompt=True)
        conversation._append(conversation._encode(text, first=True), text, False, messages)
        conversation._awaiting_completion = True
        return conversation

    @property
    def text(self) -> str:
        """The conversation's text as kept: the template's renderings and the completions'
        ids decoded with their special tokens (what ``divergences`` compares)."""
        return "".join(self._texts)

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt of the next completion."""
        if not self._awaiting_completion:
            raise TextError("the conversation awaits messages after its last completion")
        return list(self.token_ids)

    def add_completion(
        self,
        completion: Any,
        logprobs: Logprobs | Sequence[float] | None = None,
        *,
        text: str | None = None,
        message: Message | None = None,
    ) -> None:
        """The completion of the current prompt, exactly as sampled: a TextCompletion (or
        the core client's Completion), or its token ids. ``logprobs``: a Logprobs (the
        sampled token's are kept) or one float per id; a completion's own by default.
        ``text``: the assistant message's text (default: the TextCompletion's, else the
        ids decoded without special tokens); ``message``: the whole assistant message
        instead (e.g. with the ``tool_calls`` parsed from it, which templates render tool
        results after). Either goes into ``messages`` only, never tokenized."""
        if not self._awaiting_completion:
            raise TextError("add_completion: the conversation has no prompt waiting")
        if message is not None and (
            not isinstance(message, Mapping) or message.get("role") != "assistant"
        ):
            raise TextError(f"message must be an assistant message, got {message!r}")
        reason = getattr(completion, "finish_reason", None)
        if hasattr(completion, "token_ids"):
            ids = list(completion.token_ids)
            logprobs = completion.logprobs if logprobs is None else logprobs
            text = getattr(completion, "text", None) if text is None else text
        else:
            ids = list(completion)
        values = _sampled_logprobs(logprobs, len(ids))
        if message is None:
            if text is None:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            message = {"role": "assistant", "content": text}
        kept = self.tokenizer.decode(ids, skip_special_tokens=False)
        self._append(ids, kept, True, [dict(message)])
        self.sampled_logprobs[len(self.token_ids) - len(ids) :] = values
        # Ended on a special token (its stop token): its turn is over, as sampled.
        special = bool(ids) and ids[-1] in self.tokenizer.all_special_ids
        ended_turn = special and reason in (None, FinishReason.STOP)
        self._ended_on = (
            self.tokenizer.decode(ids[-1:], skip_special_tokens=False) if ended_turn else ""
        )
        self._awaiting_completion = False

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Messages after the last completion (user, tool, observation...); the ids
        added, ending with the generation prompt of the next completion. Nothing changes
        when it raises."""
        if self._awaiting_completion:
            raise TextError("add_messages: the last prompt has no completion yet")
        messages = _checked(messages)
        delta = self._delta_text(messages)
        ids = self._encode(delta, first=False)
        found = self._new_divergences(messages, delta)
        if found and self.strict:
            raise TextError(
                f"the chat template ({self.template_name}) renders this conversation's history"
                f" otherwise: {found[0].describe()}; a strict conversation keeps only"
                " templates whose rendering extends it"
            )
        self._append(ids, delta, False, messages)
        self.divergences.extend(found)
        self._awaiting_completion = True
        return ids

    # ------------------------------------------------------------ rendering

    def _delta_text(self, messages: list[dict[str, Any]]) -> str:
        """The text the template puts after an assistant message followed by ``messages``
        (its end of turn, the messages, the generation prompt), less the end-of-turn
        special token when the completion sampled its own."""
        last = self.messages[-1]
        system = [m for m in self.messages[:1] if m.get("role") in ("system", "developer")]
        listed = isinstance(last.get("content"), list)  # content as parts (VLM templates)
        user = {**_BASE_USER, "content": _as_parts(_BASE_USER["content"])} if listed else _BASE_USER
        if last.get("tool_calls"):  # printed after the text: the message is ended by them
            return self._delta_after_tool_call([*system, user, last], messages)
        # The last completion's message, its text the sentinel.
        assistant = {**last, "content": _as_parts(_SENTINEL) if listed else _SENTINEL}
        assistant.pop("reasoning_content", None)
        rendered = self._render([*system, user, assistant, *messages], add_generation_prompt=True)
        if rendered.count(_SENTINEL) == 1:
            return self._less_sampled_end(rendered[rendered.index(_SENTINEL) + len(_SENTINEL) :])
        raise TextError(
            f"the chat template ({self.template_name}) does not print an assistant"
            " message's text as given (it formats, repeats or drops it), so no delta of ids"
            " exists after a completion"
        )

    def _delta_after_tool_call(
        self, base: list[dict[str, Any]], messages: list[dict[str, Any]]
    ) -> str:
        """The delta after an assistant message with tool calls (which templates print
        after its text, or instead of it): the text after the completion as sampled, found
        in the base and the message rendered with ``messages`` after them; its end-of-turn
        token left out when the completion sampled its own."""
        rendered = self._render([*base, *messages], add_generation_prompt=True)
        sampled = self._texts[-1]
        if self._ended_on and sampled.endswith(self._ended_on):
            sampled = sampled[: len(sampled) - len(self._ended_on)]
        at = rendered.find(sampled) if sampled else -1
        if at < 0:
            raise TextError(
                f"the chat template ({self.template_name}) renders this tool call otherwise"
                f" than it was sampled ({sampled[:60]!r}): pass the assistant message as the"
                " template renders it, or its sampled text as the content without tool_calls"
            )
        return self._less_sampled_end(rendered[at + len(sampled) :])

    def _less_sampled_end(self, delta: str) -> str:
        """``delta`` less the end-of-turn token it starts with when the completion ended
        on a special token (its turn is over as sampled): the token sampled, or the one
        the template ends a message's text with (GPT-OSS renders <|end|> where <|return|>
        was sampled). Any other special token it starts with is the next turn's header
        (Metharme's <|user|>, where the template puts no end after an assistant message
        and a model ends on its EOS): the next prompt's, kept."""
        if not self._ended_on:
            return delta
        if delta.startswith(self._ended_on):
            return delta[len(self._ended_on) :]
        token = self._leading_special(delta)
        if token is not None and token == self._end_of_message():
            return delta[len(token) :]
        return delta

    def _end_of_message(self) -> str:
        """The special token the template prints right after a user message's text (its
        end of turn: ChatML's <|im_end|>, GPT-OSS's <|end|>), or "" where it prints none
        there (Metharme and GLM-4 go on with the next header)."""
        if self._message_end is None:
            try:
                rendered = self._render(
                    [{"role": "user", "content": _SENTINEL}], add_generation_prompt=True
                )
            except TextError:
                rendered = ""
            after = rendered.split(_SENTINEL, 1)[1] if rendered.count(_SENTINEL) == 1 else ""
            self._message_end = self._leading_special(after) or ""
        return self._message_end

    def _special_texts(self) -> set[str]:
        """The special and added tokens' texts."""
        tokenizer = self.tokenizer
        texts = tokenizer.all_special_tokens | {*tokenizer.added_token_text.values()}
        return {text for text in texts if text}

    def _leading_special(self, text: str) -> str | None:
        """The special (or added) token ``text`` starts with, the longest, if any."""
        return max(filter(text.startswith, self._special_texts()), key=len, default=None)

    def _new_divergences(self, messages: list[dict[str, Any]], delta: str) -> list[Divergence]:
        """Where the template's rendering of the whole conversation with ``messages``
        differs from the text kept, at turns not reported before (none: it extends it)."""
        kept = "".join(self._texts) + delta
        whole = self._render([*self.messages, *messages], add_generation_prompt=True)
        if whole == kept:
            return []
        ends = list(itertools.accumulate(len(text) for text in self._texts))
        reported = {(d.turn, d.kept) for d in self.divergences}
        found = []
        for at, rendered_at in _differences(kept, whole):
            turn = bisect.bisect_right(ends, at)
            divergence = Divergence(
                len(self.turns),
                turn,
                kept[at : at + _SNIPPET],
                whole[rendered_at : rendered_at + _SNIPPET],
            )
            if (divergence.turn, divergence.kept) not in reported:
                reported.add((divergence.turn, divergence.kept))
                found.append(divergence)
        return found

    def _render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        try:
            text = self.tokenizer.hf.apply_chat_template(
                messages, **{"tokenize": False, **kwargs}, **self.template_kwargs
            )
        except Exception as exc:  # jinja errors, a template that raises on these roles
            raise TextError(
                f"the chat template ({self.template_name}) cannot render these messages: {exc}"
            ) from exc
        if not isinstance(text, str):
            raise TextError(f"the chat template ({self.template_name}) rendered no text")
        return text

    def _encode(self, text: str, *, first: bool) -> list[int]:
        """``text``'s ids as they sit in the conversation: the whole first prompt as the
        template's own tokenization gives it (special tokens in its text included, no BOS
        added twice), or a delta after a special token (no Metaspace ``▁`` added)."""
        hf = self.tokenizer.hf
        try:
            if first:
                return list(hf.encode(text, add_special_tokens=False))
            anchor = _anchor(self.tokenizer)
            if anchor is None:
                return list(hf.encode(text, add_special_tokens=False))
            anchored = list(hf.encode(anchor[0] + text, add_special_tokens=False))
        except Exception as exc:  # a tokenizer that cannot read the text
            raise TextError(
                f"the chat template's ({self.template_name}) text cannot be tokenized: {exc}"
            ) from exc
        if anchored[:1] != [anchor[1]]:
            return list(hf.encode(text, add_special_tokens=False))
        return anchored[1:]

    def _append(
        self, ids: list[int], text: str, sampled: bool, messages: list[dict[str, Any]]
    ) -> None:
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.sampled_mask.extend([sampled] * len(ids))
        self.sampled_logprobs.extend([None] * len(ids))
        self.turns.append(Turn(start, len(self.token_ids), sampled, tuple(messages)))
        self.messages.extend(messages)
        self._texts.append(text)


_RESYNC_WINDOW = 4096  # characters either text may run ahead of the other at a difference
_RESYNC_ANCHOR = 48  # characters that must agree again after a difference


def _differences(kept: str, whole: str) -> list[tuple[int, int]]:
    """Where ``kept`` and ``whole`` differ: (position in each) of every stretch that
    differs, found by walking both and, after each difference, finding the next place
    where they agree again (within a window: a template drops or adds spans, such as
    think text or a moved system prompt; past the window, the rest counts as one)."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while True:
        i, j = _agree(kept, whole, i, j)
        if i >= len(kept) and j >= len(whole):
            return out
        out.append((i, j))
        resync = _resync(kept, whole, i, j)
        if resync is None:
            return out
        i, j = resync


def _agree(a: str, b: str, i: int, j: int) -> tuple[int, int]:
    """Past the stretch where ``a`` from ``i`` and ``b`` from ``j`` are equal."""
    step = 1024
    while a[i : i + step] == b[j : j + step] and i < len(a) and j < len(b):
        i, j = i + step, j + step
    while i < len(a) and j < len(b) and a[i] == b[j]:
        i, j = i + 1, j + 1
    return min(i, len(a)), min(j, len(b))


def _resync(a: str, b: str, i: int, j: int) -> tuple[int, int] | None:
    """The first place after a difference where ``a`` and ``b`` agree again."""
    for q in range(i, min(len(a), i + _RESYNC_WINDOW) + 1):
        anchor = a[q : q + _RESYNC_ANCHOR]
        if not anchor:
            return (len(a), len(b)) if len(b) - j <= _RESYNC_WINDOW else None
        k = b.find(anchor, j, j + _RESYNC_WINDOW + len(anchor))
        if k >= 0 and (len(anchor) == _RESYNC_ANCHOR or k + len(anchor) == len(b)):
            return q, k
    return None


def _anchor(tokenizer: TextTokenizer) -> tuple[str, int] | None:
    """A special token (text, id) that tokenizes alone, to tokenize a delta after."""
    for token_id in sorted(tokenizer.all_special_ids):
        token = tokenizer.added_token_text.get(token_id)
        if token:
            return token, token_id
    return None


def _as_parts(text: str) -> list[dict[str, str]]:
    """``text`` as a content list of one text part (vision-language templates' form)."""
    return [{"type": "text", "text": text}]


def _checked(messages: Sequence[Message]) -> list[dict[str, Any]]:
    if isinstance(messages, Mapping) or not messages:
        raise TextError("messages must be a non-empty list of {'role': ..., ...} maps")
    out = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TextError(f"a message must be a map with a 'role' string, got {message!r}")
        out.append(dict(message))
    return out


def _sampled_logprobs(logprobs: Logprobs | Sequence[float] | None, count: int) -> list:
    if logprobs is None:
        return [None] * count
    if isinstance(logprobs, Logprobs):
        values = [row[0] for row in logprobs.logprobs]
    else:
        values = [float(value) for value in logprobs]
    if len(values) != count:
        raise TextError(f"{len(values)} logprobs for {count} completion ids")
    return values
