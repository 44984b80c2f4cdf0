"""Conversation over released models' chat templates (tests/chat_template_corpus.py): every
template either extends the conversation exactly (its ids are the template's own
tokenization of the whole conversation), or renders the history otherwise where the
conversation says so (``divergences``; a strict conversation refuses there), or is refused
by name; the sampled ids are kept verbatim and no end-of-turn token is doubled or lost.
Then the families RL users train, each on purpose."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from client.text import Conversation, TextError, load_tokenizer
from tests import chat_template_corpus as corpus_runs
from tests.text_models import ensure_tokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def corpus() -> dict[str, str]:
    return corpus_runs.corpus()


@pytest.fixture(scope="module")
def runs(corpus) -> dict[str, corpus_runs.Run]:  # noqa: ANN001
    return {name: corpus_runs.run(name, template) for name, template in corpus.items()}


def _kept_text(conversation: Conversation) -> str:
    return conversation.text


def test_every_template_extends_diverges_where_reported_or_is_refused_by_name(corpus, runs):  # noqa: ANN001
    assert len(corpus) >= 80  # TRL's, axolotl's and vLLM's, each once
    for name, result in runs.items():
        conversation = result.conversation
        assert conversation is not None
        sampled = [t for t in conversation.turns if t.sampled]
        for turn, ids in zip(sampled, result.completions, strict=False):
            assert conversation.token_ids[turn.start : turn.end] == ids, name  # as sampled
        if result.eot is not None:
            assert result.eot * 2 not in conversation.text, name  # never doubled
        reported = [(d.turn, d.kept) for d in conversation.divergences]
        assert len(set(reported)) == len(reported), name  # each turn's difference once
        said = corpus_runs.outcome(result)
        if said == "extends":  # the template's own ids for the whole conversation
            whole = conversation.tokenizer.hf.apply_chat_template(
                conversation.messages, tokenize=False, add_generation_prompt=True
            )
            assert whole == conversation.text, name
            assert conversation.token_ids == conversation.tokenizer.hf.encode(
                whole, add_special_tokens=False
            ), name
        elif said == "diverges":
            assert conversation.divergences, name
            step = next(s for s, o in result.outcomes.items() if o.startswith("diverges"))
            strict = corpus_runs.run(name, corpus[name], strict=True)
            assert strict.outcomes[step].startswith("refused: "), (name, strict.outcomes)
            assert f"({name})" in strict.outcomes[step] and "strict" in strict.outcomes[step]
        else:
            step = said.removeprefix("refused at ")
            assert f"({name})" in result.outcomes[step], (name, result.outcomes)


def test_the_counts_in_text_md_are_the_corpus_runs(runs):  # noqa: ANN001
    counts = collections.Counter(corpus_runs.outcome(r).split(" at ")[0] for r in runs.values())
    doc = (ROOT / "docs" / "TEXT.md").read_text()
    line = re.search(r"<!-- corpus: (.*?) -->", doc)
    assert line is not None, "docs/TEXT.md lacks the corpus counts"
    written = dict(item.split("=") for item in line.group(1).split(", "))
    assert {k: int(v) for k, v in written.items()} == {
        "templates": len(runs),
        "extends": counts["extends"],
        "diverges": counts["diverges"],
        "refused": counts["refused"],
    }


# ---------------------------------------------------------------- the families, by name


def _family(corpus, name: str, **kwargs) -> corpus_runs.Run:  # noqa: ANN001
    return corpus_runs.run(name, corpus_runs.corpus(unique=False)[name], **kwargs)


@pytest.mark.parametrize(
    "name", ["trl/llama3_1", "trl/llama3_2", "trl/qwen2_5", "trl/phi3", "vllm/template_chatml"]
)
def test_append_only_families_extend_exactly(corpus, name):  # noqa: ANN001
    """Llama 3.1/3.2, Qwen2.5, Phi-3 (whose EOS after a last message once read as a rewrite)
    and vLLM's ChatML (which leaves the end of turn out after a last message: a sampled
    <|im_end|> was once followed by a second one)."""
    result = _family(corpus, name)
    assert corpus_runs.outcome(result) == "extends", result.outcomes
    kept = result.conversation.text
    assert result.eot and kept.count(result.eot * 2) == 0
    assert not result.conversation.divergences


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_keeps_the_sampled_reasoning_and_says_where_the_template_drops_it(corpus, thinking):  # noqa: ANN001
    """Qwen3 drops earlier turns' <think> text (and, without thinking, the empty think block
    of the generation prompt) from the history it renders: the conversation keeps what was
    sampled and prompted, and says which turn differs."""
    result = _family(corpus, "trl/qwen3", enable_thinking=thinking)
    conversation = result.conversation
    assert not any(o.startswith("refused") for o in result.outcomes.values()), result.outcomes
    assert corpus_runs.REASONING in conversation.text
    dropped = [d for d in conversation.divergences if "<think>" in d.kept]
    assert dropped and all("<think>" not in d.rendered for d in dropped)
    assert "<|im_end|><|im_end|>" not in conversation.text


def test_deepseek_r1_and_glm4_keep_the_reasoning_the_template_drops(corpus):  # noqa: ANN001
    for name in ("trl/deepseek_r1_distill", "trl/glm4moe"):
        result = _family(corpus, name)
        assert corpus_runs.REASONING in result.conversation.text, name
        think = [d for d in result.conversation.divergences if "think" in d.kept]
        assert think, (name, result.outcomes)


def test_mistral_v03_moves_the_system_prompt_into_the_last_user_message(corpus):  # noqa: ANN001
    """The delta renders the new last user message as the template does (with the system
    prompt); the first turn keeps it too (as it was prompted), and that is reported."""
    result = _family(corpus, "axolotl/mistral_v2v3")
    conversation = result.conversation
    second_prompt = conversation.turns[2]  # the delta after the first completion
    ids = conversation.token_ids[second_prompt.start : second_prompt.end]
    assert "You are terse." in conversation.tokenizer.decode(ids)
    assert conversation.divergences[0].turn == 0
    assert "You are terse." in conversation.divergences[0].kept
    strict = _family(corpus, "axolotl/mistral_v2v3", strict=True)
    assert "strict" in strict.outcomes["user"]


def test_gemma_serves_user_and_reasoning_turns_and_refuses_tool_messages_by_name(corpus):  # noqa: ANN001
    result = _family(corpus, "trl/gemma")
    assert result.outcomes["user"] == result.outcomes["think"] == "extends"
    assert "(trl/gemma)" in result.outcomes["tool"] and "alternate" in result.outcomes["tool"]
    assert not result.with_system  # Gemma's template takes no system message: started without


def test_gpt_oss_keeps_a_sampled_return_and_adds_no_end(corpus):  # noqa: ANN001
    """GPT-OSS samples <|return|> to end a final answer, and renders history with <|end|>:
    the conversation keeps <|return|> and adds no <|end|> after it; tool results need a
    structured tool call (its own message), given as ``message``."""
    tokenizer = corpus_runs.tokenizer_for(corpus_runs.corpus(unique=False)["trl/gptoss"])
    ret = tokenizer.hf.convert_tokens_to_ids("<|return|>")
    conversation = Conversation.start(tokenizer, [corpus_runs.FIRST], template_name="gptoss")
    answer = tokenizer.encode("<|channel|>final<|message|>It is 4.") + [ret]
    conversation.add_completion(answer)
    added = conversation.add_messages([corpus_runs.THINK_PROMPT])
    text = tokenizer.decode(added, skip_special_tokens=False)
    assert not text.startswith("<|end|>") and text.startswith("<|start|>user")
    assert "<|return|><|end|>" not in conversation.text
    call = tokenizer.encode(
        '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 5, "b": 6}'
    ) + [tokenizer.hf.convert_tokens_to_ids("<|call|>")]
    message = {"role": "assistant", "content": "", "tool_calls": [corpus_runs.TOOL_CALL]}
    conversation.add_completion(call, message=message)
    with pytest.raises(TextError, match=r"\(gptoss\) renders this tool call otherwise"):
        conversation.add_messages([corpus_runs.TOOL_RESULT])
    before = list(conversation.token_ids)
    with pytest.raises(TextError):  # the same again: nothing changed
        conversation.add_messages([corpus_runs.TOOL_RESULT])
    assert conversation.token_ids == before


def test_a_template_that_does_not_print_text_verbatim_is_refused_unchanged() -> None:
    """Item 5: refused by name before anything changes; a retry raises the same."""
    tokenizer = load_tokenizer(ensure_tokenizer("bpe"))
    tokenizer.hf.chat_template = "{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}"
    conversation = Conversation.start(
        tokenizer, [{"role": "user", "content": "hi"}], template_name="upper"
    )
    conversation.add_completion(tokenizer.encode("HELLO"))
    before = (list(conversation.token_ids), len(conversation.turns), len(conversation.messages))
    for _ in range(2):
        with pytest.raises(TextError, match=r"\(upper\) does not print"):
            conversation.add_messages([{"role": "user", "content": "again"}])
        after = (list(conversation.token_ids), len(conversation.turns), len(conversation.messages))
        assert after == before


def test_a_metaspace_first_tokenizer_gets_no_extra_word_start_in_a_delta() -> None:
    """Item 6: a delta is tokenized after a special token, as it sits in the conversation:
    SentencePiece's Metaspace with prepend_scheme "first" adds no ▁ there."""
    tokenizer = load_tokenizer(ensure_tokenizer("sp-fast"))
    assert "prepend_scheme=first" in repr(tokenizer.backend.pre_tokenizer)
    tokenizer.hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer = type(tokenizer)(tokenizer.hf)
    tokenizer.hf.chat_template = corpus_runs.corpus()["vllm/template_chatml"]
    conversation = Conversation.start(tokenizer, [corpus_runs.FIRST])
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    conversation.add_completion(tokenizer.encode("It is 4.") + [im_end])
    added = conversation.add_messages([corpus_runs.THINK_PROMPT])
    assert tokenizer.hf.convert_ids_to_tokens(added[:1]) != ["▁"]
    whole = tokenizer.hf.apply_chat_template(
        conversation.messages, tokenize=False, add_generation_prompt=True
    )
    assert whole == conversation.text
    assert (
        conversation.token_ids[-len(added) :]
        == tokenizer.hf.encode(whole, add_special_tokens=False)[-len(added) :]
    )


def test_a_completion_ended_on_eos_keeps_the_next_turns_header(corpus):  # noqa: ANN001
    """Issue 77 item 6: a model that ends its answer on its EOS (</s> here) where the
    template puts no end of turn after an assistant message but the next turn's header
    (axolotl's Metharme, TRL's GLM-4 MoE: <|user|>): the next prompt starts with that
    header, as the template renders it. Where the template does end a message with a
    special token (ChatML's <|im_end|>, Llama 3's <|eot_id|>), the turn is over as sampled
    and that end is not added after the EOS."""
    kept_headers, ended = [], []
    for name, template in corpus.items():
        tokenizer = corpus_runs.tokenizer_for(template)
        eos = tokenizer.hf.convert_tokens_to_ids("</s>")
        try:
            conversation = Conversation.start(tokenizer, [corpus_runs.FIRST], template_name=name)
        except TextError:
            continue
        conversation.add_completion(tokenizer.encode("It is 4.") + [eos])
        before = conversation.text
        try:
            conversation.add_messages([corpus_runs.THINK_PROMPT])
        except TextError:
            continue
        delta = conversation.text[len(before) :]
        rendered = tokenizer.hf.apply_chat_template(
            [corpus_runs.FIRST, {"role": "assistant", "content": "It is 4."},
             corpus_runs.THINK_PROMPT],
            tokenize=False, add_generation_prompt=True,
        )  # fmt: skip
        if "It is 4." not in rendered:
            continue
        after = rendered[rendered.index("It is 4.") + len("It is 4.") :].removeprefix("</s>")
        lead = max(
            (t for t in tokenizer.all_special_tokens if after.startswith(t)), key=len, default=None
        )
        if lead is None or lead == "</s>":
            continue
        user_only = tokenizer.hf.apply_chat_template(
            [{"role": "user", "content": "QQQ"}], tokenize=False, add_generation_prompt=True
        )
        if user_only.split("QQQ", 1)[1].startswith(lead):  # the template's end of a message
            assert not delta.startswith(lead), (name, delta[:40])
            ended.append(name)
        else:  # the next turn's header
            assert delta.startswith(lead), (name, lead, delta[:40])
            kept_headers.append(name)
    assert {"axolotl/metharme", "trl/glm4moe"} <= set(kept_headers), kept_headers
    assert len(ended) >= 20, ended
