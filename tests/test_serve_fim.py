"""The completions endpoint's `suffix` (fill-in-the-middle) through the official `openai` client: a model
with FIM tokens completes the PSM prompt; one without them answers 400 naming `suffix`."""

from pathlib import Path

import openai
import pytest
import torch
from test_engine_llm import naive_greedy
from test_serve_fixtures import MODEL, LiveServer, TinyChatModel, byte_tokenizer, tiny_pretrained

from tokenmind.data.fim import FIM_TOKENS, find_fim_tokens, infill_prompt
from tokenmind.model.config import ModelConfig
from tokenmind.model.load import Pretrained

PREFIX, SUFFIX = "def area(w, h):\n    return ", "\n\nprint(area(2, 3))\n"


@pytest.fixture(scope="module")
def fim_pretrained() -> Pretrained:
    """The tiny printable-ASCII model over a byte tokenizer that also has the three FIM sentinels."""
    tokenizer = byte_tokenizer()
    tokenizer.backend.add_special_tokens(list(FIM_TOKENS))  # ids 259, 260, 261
    cfg = ModelConfig(vocab_size=262, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = TinyChatModel(cfg).eval()
    model.init_weights(std=0.5)
    return Pretrained(model, tokenizer, Path(MODEL))


def test_suffix_completes_the_middle_of_the_psm_prompt(fim_pretrained):
    tokenizer = fim_pretrained.tokenizer
    prompt = infill_prompt(tokenizer.encode(PREFIX), tokenizer.encode(SUFFIX), find_fim_tokens(tokenizer))
    assert prompt[0] == tokenizer.token_to_id("<fim_prefix>") and prompt[-1] == tokenizer.token_to_id("<fim_middle>")
    expected = tokenizer.decode(naive_greedy(fim_pretrained.model, prompt, 12))
    plain = tokenizer.decode(naive_greedy(fim_pretrained.model, tokenizer.encode(PREFIX), 12))
    assert expected != plain  # the suffix changes what the model writes
    with LiveServer(fim_pretrained) as server:
        client = server.openai()
        texts = [client.completions.create(model=MODEL, prompt=prompt_form, suffix=SUFFIX, max_tokens=12,
                                           temperature=0).choices[0].text
                 for prompt_form in (PREFIX, tokenizer.encode(PREFIX))]
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0, stream=True))
        no_suffix = client.completions.create(model=MODEL, prompt=PREFIX, suffix="", max_tokens=12, temperature=0)
    assert texts == [expected, expected] and streamed == expected
    assert no_suffix.choices[0].text == plain  # an empty suffix asks for a plain completion


def test_a_model_without_fim_tokens_refuses_suffix_with_a_400():
    with LiveServer(tiny_pretrained()) as server:
        client = server.openai()
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=4)
        assert "no fill-in-the-middle tokens" in str(refused.value) and refused.value.body["param"] == "suffix"
        with pytest.raises(openai.BadRequestError, match="echo cannot be combined with suffix"):
            client.completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, echo=True, max_tokens=4)
