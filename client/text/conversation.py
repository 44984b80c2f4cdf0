"""A multi-turn conversation kept as token ids: each turn's prompt is the previous prompt,
the completion's ids exactly as sampled, and the ids of the messages added since, rendered
by the chat template as a delta. Earlier text is never tokenized again, so the ids a
trainer scores are the ids the sampler produced."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from codec import Logprobs

from .tokenizer import TextError, TextTokenizer

__all__ = ["Conversation", "Turn"]

Message = Mapping[str, Any]
# Stand-in messages the template renders before a delta; their text is cut off again.
_SENTINEL = "\ue000engine-gateway-sentinel\ue001"
_BASE = (
    {"role": "user", "content": "engine-gateway base message"},
    {"role": "assistant", "content": _SENTINEL},
)


@dataclass(frozen=True, slots=True)
class Turn:
    """Ids ``start:end`` of the conversation: template and messages (``sampled`` false)
    or a completion as sampled (``sampled`` true)."""

    start: int
    end: int
    sampled: bool
    messages: tuple[Message, ...] = ()


@dataclass(slots=True)
class Conversation:
    """A conversation's ids for one model's chat template.

    ``Conversation.start(tokenizer, messages)`` renders the first prompt
    (``apply_chat_template`` with the generation prompt). Then, per turn:
    ``add_completion(completion)`` with the completion as sampled, and
    ``add_messages([...])`` with the user, tool or observation messages that follow;
    ``prompt_ids`` is the next turn's prompt. ``token_ids``, ``sampled_mask`` and
    ``sampled_logprobs`` are what a trainer needs; ``turns`` the boundaries.
    """

    tokenizer: TextTokenizer
    token_ids: list[int] = field(default_factory=list)
    sampled_mask: list[bool] = field(default_factory=list)
    sampled_logprobs: list[float | None] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    _pending_text: str = ""  # the end of the last assistant turn, not yet added
    _awaiting_completion: bool = False
    _base_text: str | None = None  # the stand-in messages rendered (the same every turn)

    @classmethod
    def start(
        cls,
        tokenizer: TextTokenizer,
        messages: Sequence[Message],
        **template_kwargs: Any,
    ) -> Conversation:
        """The conversation's first prompt: ``messages`` rendered with the generation
        prompt. ``template_kwargs`` go to every rendering (``tools=...``, ...)."""
        conversation = cls(tokenizer, template_kwargs=dict(template_kwargs))
        messages = _checked(messages)
        ids = conversation._render(messages, add_generation_prompt=True, tokenize=True)
        conversation._append(ids, sampled=False, messages=messages)
        conversation._awaiting_completion = True
        return conversation

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
    ) -> None:
        """The completion of the current prompt, exactly as sampled: a TextCompletion (or
        the core client's Completion), or its token ids. ``logprobs``: a Logprobs (the
        sampled token's are kept) or one float per id; a completion's own by default.
        ``text``: the assistant message's text (default: the TextCompletion's, else the
        ids decoded without special tokens); it goes into ``messages`` only, never
        tokenized."""
        if not self._awaiting_completion:
            raise TextError("add_completion: the conversation has no prompt waiting")
        if hasattr(completion, "token_ids"):
            ids = list(completion.token_ids)
            logprobs = completion.logprobs if logprobs is None else logprobs
            text = getattr(completion, "text", None) if text is None else text
        else:
            ids = list(completion)
        values = _sampled_logprobs(logprobs, len(ids))
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.sampled_mask.extend([True] * len(ids))
        self.sampled_logprobs.extend(values)
        self.turns.append(Turn(start, len(self.token_ids), True, (message,)))
        self.messages.append(message)
        self._pending_text = self._end_of_turn(ids)
        self._awaiting_completion = False

    def add_messages(self, messages: Sequence[Message]) -> list[int]:
        """Messages after the last completion (user, tool, observation...); the ids
        added, ending with the generation prompt of the next completion."""
        if self._awaiting_completion:
            raise TextError("add_messages: the last prompt has no completion yet")
        messages = _checked(messages)
        before = self._rendered_base()
        after = self._render([*_BASE, *messages], add_generation_prompt=True)
        if not after.startswith(before):
            raise TextError(
                "the chat template does not render these messages as an extension of the "
                "conversation (it changes earlier text), so no delta of ids exists"
            )
        ids = self.tokenizer.encode(self._pending_text + after[len(before) :])
        self._append(ids, sampled=False, messages=messages)
        self._pending_text = ""
        self._awaiting_completion = True
        return ids

    def _end_of_turn(self, ids: list[int]) -> str:
        """The text the template puts after an assistant message's content, less the
        special token the completion already ends with (its EOS, as sampled)."""
        rendered = self._rendered_base()
        tail = rendered[rendered.rindex(_SENTINEL) + len(_SENTINEL) :]
        if ids and ids[-1] in self.tokenizer.all_special_ids:
            last = self.tokenizer.decode(ids[-1:], skip_special_tokens=False)
            if last and tail.startswith(last):
                tail = tail[len(last) :]
        return tail

    def _rendered_base(self) -> str:
        """The stand-in user and assistant messages, rendered once per conversation."""
        if self._base_text is None:
            self._base_text = self._render(list(_BASE), add_generation_prompt=False)
        return self._base_text

    def _render(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        try:
            return self.tokenizer.hf.apply_chat_template(
                messages, **{"tokenize": False, **kwargs}, **self.template_kwargs
            )
        except Exception as exc:  # jinja errors, a template that raises on these roles
            raise TextError(f"the chat template cannot render these messages: {exc}") from exc

    def _append(self, ids: Any, *, sampled: bool, messages: list[dict[str, Any]]) -> None:
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        ids = list(ids)
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.sampled_mask.extend([sampled] * len(ids))
        self.sampled_logprobs.extend([None] * len(ids))
        self.turns.append(Turn(start, len(self.token_ids), sampled, tuple(messages)))
        self.messages.extend(messages)


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
