"""Released models' chat templates (scripts/chat_templates.py: TRL's, axolotl's and vLLM's
own), each run as a Conversation through a user turn, a reasoning turn and a tool turn.

A template gets a tokenizer of its own: the tests' byte-level BPE with every token the
template names (``<|im_end|>``, ``<end_of_turn>``, ...) added as special tokens. Each
completion is what the model would sample in place: the text the template itself renders
for the assistant message after the prompt, then the template's end-of-turn token.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from client.text import Conversation, TextError, TextTokenizer, load_tokenizer
from tests.text_models import ensure_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import chat_templates  # noqa: E402

_TOKENS = re.compile(
    r"<\|[^<>|\s]{1,40}\|>|</?[a-z_]{1,30}>|<[a-z_]{1,30}\||\|[a-z_]{1,30}>|<｜[^<>｜]{1,40}｜>"
)

SYSTEM = {"role": "system", "content": "You are terse."}
FIRST = {"role": "user", "content": "What is 2+2?"}
THINK_PROMPT = {"role": "user", "content": "And 3+3?"}
TOOL_PROMPT = {"role": "user", "content": "Add 5 and 6 with the tool."}
TOOL_CALL = {
    "id": "call12345",  # nine alphanumerics: Mistral's templates refuse other ids
    "type": "function",
    "function": {"name": "add", "arguments": {"a": 5, "b": 6}},
}
TOOL_RESULT = {"role": "tool", "content": "11", "tool_call_id": "call12345", "name": "add"}
REASONING = "Adding 3 and 3."
STEPS = ("user", "think", "tool")


def corpus(unique: bool = True) -> dict[str, str]:
    """``source/name`` -> template, downloaded on first use (scripts/chat_templates.py);
    ``unique``: identical templates once."""
    return chat_templates.templates(chat_templates.ensure(), unique)


def tokenizer_for(template: str) -> TextTokenizer:
    """The tests' BPE tokenizer with the template's tokens as special tokens."""
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    tokens = sorted(set(_TOKENS.findall(template)) | {"<s>", "</s>"})
    tokenizer.hf.add_special_tokens(
        {"additional_special_tokens": tokens, "bos_token": "<s>", "eos_token": "</s>"}
    )
    tokenizer.hf.chat_template = template
    return TextTokenizer(tokenizer.hf)


def end_of_turn(tokenizer: TextTokenizer) -> str | None:
    """The special token the template puts right after an assistant message's text."""
    probe = [FIRST, {"role": "assistant", "content": "XYZ"}, THINK_PROMPT]
    try:
        text = tokenizer.hf.apply_chat_template(probe, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that renders no such conversation
        return None
    if "XYZ" not in text:
        return None
    after = text[text.index("XYZ") + 3 :]
    found = [t for t in tokenizer.all_special_tokens if after.startswith(t)]
    return max(found, key=len) if found else None


@dataclass
class Run:
    """One template's conversation: each step's outcome ("extends", "diverges: ...",
    "refused: ..."), the completions' ids, and the conversation itself."""

    name: str
    outcomes: dict[str, str] = field(default_factory=dict)
    completions: list[list[int]] = field(default_factory=list)
    conversation: Conversation | None = None
    with_system: bool = True
    eot: str | None = None


TOOL_CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 6}}</tool_call>'


def completion_for(
    conversation: Conversation,
    message: dict,
    following: list[dict],
    eot: str | None,
    eot_id: int | None,
) -> list[int]:
    """The ids a model trained on the template would sample for ``message``: the text the
    template renders for it after the generation prompt, with ``following`` after it (as
    in training, where something follows every assistant turn), up to its end-of-turn
    token, then that token; the content as given where the template renders the history
    otherwise then."""
    tokenizer = conversation.tokenizer
    kwargs = conversation.template_kwargs
    history = conversation.messages
    content = _text_of(message.get("content")) or TOOL_CALL_TEXT
    try:
        prompt = tokenizer.hf.apply_chat_template(
            history, tokenize=False, add_generation_prompt=True, **kwargs
        )
        placed = tokenizer.hf.apply_chat_template(
            [*history, message, *following], tokenize=False, **kwargs
        )
    except Exception:  # noqa: BLE001
        prompt = placed = ""
    body = placed[len(prompt) :] if prompt and placed.startswith(prompt) else ""
    if eot and eot in body:
        return tokenizer.encode(body[: body.index(eot)]) + [eot_id]
    return tokenizer.encode(content) + ([eot_id] if eot_id is not None else [])


def _text_of(content: object) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _parts(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, str) and content:
        return {**message, "content": [{"type": "text", "text": content}]}
    return message


def run(name: str, template: str, *, strict: bool = False, **kwargs) -> Run:
    """The user, reasoning and tool turns through one template (``kwargs`` to it); again
    with content as lists of parts where the template takes only that form."""
    first = _run(name, template, strict=strict, parts=False, **kwargs)
    said = first.outcomes.get("user", "")
    if "does not print" in said or "'text'" in said:  # the template reads parts only
        return _run(name, template, strict=strict, parts=True, **kwargs)
    return first


def _run(name: str, template: str, *, strict: bool, parts: bool, **kwargs) -> Run:
    tokenizer = tokenizer_for(template)
    form = _parts if parts else (lambda message: message)
    result = Run(name)
    result.eot = end_of_turn(tokenizer)
    eot_id = tokenizer.hf.convert_tokens_to_ids(result.eot) if result.eot else None
    try:
        conversation = Conversation.start(
            tokenizer, [form(SYSTEM), form(FIRST)], strict=strict, template_name=name, **kwargs
        )
    except TextError:
        result.with_system = False
        conversation = Conversation.start(
            tokenizer, [form(FIRST)], strict=strict, template_name=name, **kwargs
        )
    result.conversation = conversation
    think_prefix = "" if conversation.text.endswith("<think>\n") else "<think>\n"
    replies = {
        "user": ({"role": "assistant", "content": "It is 4."}, [THINK_PROMPT]),
        "think": (
            {"role": "assistant", "content": f"{think_prefix}{REASONING}\n</think>\n\nIt is 6."},
            [TOOL_PROMPT],
        ),
        # The call as the text sampled (as RL rollouts keep it); structured tool_calls are
        # the named tests' (test_chat_templates.py).
        "tool": ({"role": "assistant", "content": TOOL_CALL_TEXT}, [TOOL_RESULT]),
    }
    replies = {
        step: (form(message), [form(m) for m in following])
        for step, (message, following) in replies.items()
    }
    for step in STEPS:
        message, following = replies[step]
        if step == "think":  # what a reasoning model samples, whatever history keeps of it
            text = _text_of(message["content"])
            ids = tokenizer.encode(text) + ([eot_id] if eot_id is not None else [])
        else:
            ids = completion_for(conversation, message, following, result.eot, eot_id)
        before = len(conversation.divergences)
        conversation.add_completion(ids, message=message)
        result.completions.append(ids)
        try:
            conversation.add_messages(following)
        except TextError as exc:
            result.outcomes[step] = f"refused: {exc}"
            break
        new = conversation.divergences[before:]
        result.outcomes[step] = (
            "diverges: " + "; ".join(d.describe() for d in new) if new else "extends"
        )
    return result


def outcome(result: Run) -> str:
    """A template's outcome: ``extends`` (every step's text is the template's rendering of
    the whole conversation), ``diverges`` (the history differs where reported), or
    ``refused at STEP`` (a TextError naming the template)."""
    for step, said in result.outcomes.items():
        if said.startswith("refused"):
            return f"refused at {step}"
    if any(said.startswith("diverges") for said in result.outcomes.values()):
        return "diverges"
    return "extends"
