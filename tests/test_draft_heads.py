"""Medusa heads and the EAGLE head: greedy speculation with them equals plain decoding, heads trained
on a tiny model's own generations are accepted more often than untrained ones, the EAGLE feature
regression learns, and a saved head loads back exactly (and refuses the wrong model)."""

import json
from pathlib import Path

import pytest
import torch
from test_engine_llm import assert_batched_greedy_equals_naive, assert_no_leaks, pool_bytes, run, tiny_model
from test_sft_helpers import tiny_tokenizer
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.engine.config import EngineConfig
from tokenmind.engine.llm import Engine
from tokenmind.engine.sampling import SamplingParams
from tokenmind.engine.speculative import SpeculativeConfig, parse_speculative
from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.draft_heads import MedusaHeads, build_draft_head, load_draft_head, save_draft_head
from tokenmind.model.transformer import Transformer
from tokenmind.posttrain.draft_heads import build_draft_head_trainer, load_draft_head_config
from tokenmind.train.distributed import init_distributed


def random_head(method: str, cfg: ModelConfig, path: Path, seed: int = 0) -> Path:
    """A head with random weights everywhere (not Medusa's identity start), so it drafts wrong tokens too."""
    torch.manual_seed(seed)
    head = build_draft_head(method, cfg, num_heads=3)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
    return save_draft_head(head, cfg, path)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("method", ["medusa", "eagle"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_with_a_head_equals_plain_decoding(model, method, k, tmp_path):
    """Chunked prefill beside drafting sequences; k = 5 asks Medusa's 3 heads for more than they have
    (the draft is cut to 3) and runs the EAGLE head on its own features for 5 steps."""
    head = random_head(method, model.cfg, tmp_path / method)
    engine = assert_batched_greedy_equals_naive(model, 24, speculative=SpeculativeConfig(method, k, head=str(head)))
    assert engine.stats().num_drafted_tokens > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_preemption_penalties_and_forked_siblings_beside_drafting_sequences(model, method, tmp_path):
    """A pool so small that sequences are preempted (their hidden states restart), a penalised
    request that never drafts, n = 3 sampled siblings; greedy ones still equal plain decoding."""
    head = random_head(method, model.cfg, tmp_path / method)
    engine = assert_batched_greedy_equals_naive(model, 24, kv_cache_bytes=pool_bytes(model, 12),
                                                speculative=SpeculativeConfig(method, 3, head=str(head)))
    assert engine.stats().num_preemptions > 0
    spec = SpeculativeConfig(method, 3, head=str(head))
    penalised = SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    plain, drafting = Engine(model, config=EngineConfig(block_size=4)), Engine(model, config=EngineConfig(
        block_size=4, speculative=spec))
    ids = [e.add_request([3, 14, 15, 9], penalised) for e in (plain, drafting)]
    siblings = drafting.add_request([7, 1, 5], SamplingParams(max_tokens=16, temperature=1.0, n=3, seed=7,
                                                              ignore_eos=True))
    finals = [run(e)[0] for e in (plain, drafting)]
    assert finals[0][ids[0]].token_ids == finals[1][ids[1]].token_ids
    assert [len(c.token_ids) for c in finals[1][siblings].outputs] == [16] * 3
    assert drafting.stats().num_drafted_tokens > 0
    assert_no_leaks(drafting)


def test_a_head_saves_and_loads_back_and_refuses_the_wrong_model(model, tmp_path):
    cfg = model.cfg
    for method in ("medusa", "eagle"):
        head = build_draft_head(method, cfg, num_heads=3)
        torch.nn.init.normal_(next(head.parameters()))
        path = save_draft_head(head, cfg, tmp_path / method, {"steps": 7})
        assert sorted(p.name for p in path.iterdir()) == ["head.json", "head.safetensors"]
        meta = json.loads((path / "head.json").read_text())
        assert meta["method"] == method and meta["steps"] == 7 and meta["hidden_size"] == cfg.hidden_size
        back = load_draft_head(path, cfg, method=method)
        assert type(back) is type(head) and not any(p.requires_grad for p in back.parameters())
        for (name, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert isinstance(load_draft_head(tmp_path / "medusa", cfg), MedusaHeads) and back.fc.in_features == 64
    wider = ModelConfig(**{**cfg.__dict__, "hidden_size": 48})
    with pytest.raises(ValueError, match="hidden_size=32, this model has 48"):
        load_draft_head(tmp_path / "medusa", wider)
    with pytest.raises(ValueError, match="--speculative medusa:"):
        load_draft_head(tmp_path / "medusa", cfg, method="eagle")
    with pytest.raises(FileNotFoundError, match="no head.json"):
        load_draft_head(tmp_path, cfg)


def test_the_speculative_flag_names_a_head():
    assert parse_speculative("medusa:runs/m/head", 4) == SpeculativeConfig("medusa", 4, head="runs/m/head")
    assert parse_speculative("eagle:/x").head == "/x" and parse_speculative("ngram").method == "ngram"
    assert parse_speculative("runs/draft/final") is None  # a draft model
    with pytest.raises(ValueError, match="medusa:PATH"):
        parse_speculative("medusa")
    with pytest.raises(ValueError, match="'medusa' or 'eagle'"):
        SpeculativeConfig("lookahead")


# ----------------------------------------------------------------------------- training on the model's own text


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny model whose text an untrained head cannot guess but a trained one can learn: its blocks
    are near zero and its (untied) LM head holds permuted copies of the embeddings, so its next token
    is a fixed function of the last one, a walk around a 24-token cycle that starts at the chat
    template's last prompt token. An untrained Medusa head repeats the model's next token, an
    untrained EAGLE head says anything; both must learn the walk from the model's own text."""
    tokenizer = tiny_tokenizer()
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    model.init_weights(0.02, g)
    start = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)[-1]
    others = [t for t in torch.randperm(cfg.vocab_size, generator=g).tolist() if t != start]
    cycle = [start, *others[:23]]
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0.0, 1.0, generator=g)
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            model.lm_head.weight[b] = 0.1 * model.embed_tokens.weight[a]
    return save_hf_dir(model, tmp_path_factory.mktemp("draft") / "base", tokenizer=tokenizer)


def train_head(base_dir: Path, out_dir: Path, method: str, *overrides: str):
    cfg = load_draft_head_config(None, [
        f"--draft.method={method}", f"--draft.base={base_dir}", "--draft.num_heads=3", "--draft.num_prompts=40",
        "--draft.max_new_tokens=40", f"--draft.cache_dir={base_dir.parent / 'cache'}", "--data.batch_size=4",
        "--data.val_fraction=0.1", "--optim.lr=1e-2", "--schedule.warmup_steps=2", "--train.steps=60",
        "--train.eval_every=30", "--train.eval_batches=1", f"--train.out_dir={out_dir}", *overrides])
    trainer = build_draft_head_trainer(cfg, init_distributed("none", "cpu"))
    return trainer, trainer.train()


def acceptance(base, method: str, head: Path) -> float:
    """Accepted / drafted over greedy answers to chat prompts unseen in training, 3 drafts a step."""
    engine = Engine(base.model, config=EngineConfig(block_size=4, speculative=SpeculativeConfig(
        method, 3, adaptive=False, head=str(head))))
    for text in ("what is a cat", "tell me a story", "name three birds"):
        ids = base.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        engine.add_request(ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    run(engine)
    return engine.stats().acceptance_rate


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_a_head_trained_on_the_models_generations_is_accepted_more_often(base_dir, method, tmp_path):
    from tokenmind.model.load import load_model

    trainer, result = train_head(base_dir, tmp_path / "run", method)
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"]
    if method == "eagle":  # the feature regression itself learns, not only the token loss
        assert train[-1]["feature_loss"] < 0.7 * train[0]["feature_loss"]
        val = [r["val_feature_loss"] for r in records if "val_feature_loss" in r]
        assert val[-1] < val[0]
    assert result.final_model_path == tmp_path / "run" / "head"
    assert json.loads((result.final_model_path / "head.json").read_text())["steps"] == 60
    untrained = save_draft_head(build_draft_head(method, trainer.model.cfg, 3), trainer.model.cfg, tmp_path / "fresh")
    base = load_model(base_dir)
    trained_rate = acceptance(base, method, result.final_model_path)
    untrained_rate = acceptance(base, method, untrained)
    assert trained_rate > 0.8 and untrained_rate < 0.2, (trained_rate, untrained_rate)
