"""DeepSeek-V3 multi-token prediction: the depths against transformers' `MtpModel` on the same
weights, the checkpoint layout, the loss against a per-position reference over packed documents,
training through the objective and `pretrain`, and the engine's MTP drafter (greedy output equal
to plain decoding, drafts equal to the dense depths' distributions, acceptance on a trained model)."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from test_engine_llm import naive_greedy, pool_bytes, run
from test_train_helpers import one_thread, tiny_config, write_shards  # noqa: F401 (autouse fixture)

from tokenmind.data.loader import IGNORE_INDEX, TokenBatch
from tokenmind.engine.config import EngineConfig
from tokenmind.engine.llm import Engine
from tokenmind.engine.sampling import SamplingParams
from tokenmind.engine.speculative import SpeculativeConfig
from tokenmind.model.attention import DenseAttentionMetadata, DenseMask
from tokenmind.model.checkpoint import load_hf_dir, save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.train.objectives import NextTokenObjective, mtp_loss

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, model_type="deepseek_v3", num_experts=4, num_experts_per_tok=2,
            num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, rope_interleave=True, moe_intermediate_size=24, n_shared_experts=1,
            first_k_dense_replace=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=2, topk_group=1,
            routed_scaling_factor=2.5)


def tiny_mtp(depths: int, seed: int = 0, **extra) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**TINY, "num_nextn_predict_layers": depths, **extra}))
    model.init_weights(std=0.3)
    return model.eval()


# ----------------------------------------------------------------------------- the model and its checkpoint


def test_depths_equal_transformers_mtp_model_and_the_checkpoint_has_deepseek_v3s_layout(tmp_path):
    """Our saved directory loads in transformers (which skips the MTP layers) and in its generic
    `MtpModel` (the MTP weights, renamed from V3's layout); depth 1 and the chained depth 2 give
    the same logits as ours, and our loader reads the directory back exactly."""
    from transformers.modeling_layers import MtpModel

    model = tiny_mtp(2)
    save_hf_dir(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and config["num_hidden_layers"] == 2
    with safe_open(tmp_path / "m" / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.2.eh_proj.weight").shape == (32, 64)  # [enorm(embedding); hnorm(hidden)]
        torch.testing.assert_close(f.get_tensor("model.layers.3.shared_head.head.weight"), model.lm_head.weight)
    for layer in (2, 3):
        assert {f"model.layers.{layer}.{n}.weight" for n in ("enorm", "hnorm", "shared_head.norm", "embed_tokens",
                                                              "input_layernorm", "self_attn.kv_b_proj")} <= names
        assert f"model.layers.{layer}.mlp.gate.e_score_correction_bias" in names  # the depth's block is MoE
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\.", r"model\.layers\.3\."]  # V3's list names layer 61
    hf_mtp = MtpModel.from_pretrained(hf).eval()
    back = load_hf_dir(tmp_path / "m")
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    T, pos = ids.shape[1], torch.arange(12)[None]
    with torch.no_grad():
        logits, depths = model(ids, mtp=True)
        torch.testing.assert_close(hf(ids).logits, logits, atol=1e-4, rtol=0)
        h0 = hf(ids, output_hidden_states=True).hidden_states[-1]  # the final-normed hidden state feeds depth 1
        # transformers' indexing: depth k's j-th row pairs the previous depth's row j with token j + k
        h1 = hf_mtp.forward_layer(0, h0[:, :T - 1], pos[:, 1:], None, input_ids=ids[:, 1:])
        h2 = hf_mtp.forward_layer(1, h1[:, :T - 2], pos[:, 2:], None, input_ids=ids[:, 2:])
        torch.testing.assert_close(hf_mtp._project_to_logits(h1), depths[0][:, 1:], atol=1e-4, rtol=0)
        torch.testing.assert_close(hf_mtp._project_to_logits(h2), depths[1][:, 2:], atol=1e-4, rtol=0)
        again, again_depths = back(ids, mtp=True)
    torch.testing.assert_close(again, logits, atol=0, rtol=0)
    torch.testing.assert_close(again_depths, depths, atol=0, rtol=0)


def with_depths(model_dir, depths: int) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": depths}))


def test_checkpoints_without_mtp_weights_load_without_them(tmp_path):
    """transformers writes num_nextn_predict_layers (default 1) but saves no MTP layer: a directory
    whose config announces depths it has no weights for loads as a model without them; a config
    asking for fewer depths than the checkpoint holds loads the first ones."""
    assert transformers.AutoConfig.for_model("deepseek_v3").to_dict()["num_nextn_predict_layers"] == 1
    save_hf_dir(tiny_mtp(0), tmp_path / "none")
    with_depths(tmp_path / "none", 1)
    assert len(load_hf_dir(tmp_path / "none").mtp) == 0
    save_hf_dir(tiny_mtp(2), tmp_path / "two")
    with_depths(tmp_path / "two", 1)
    one = load_hf_dir(tmp_path / "two")
    assert len(one.mtp) == 1
    torch.testing.assert_close(one.mtp[0].eh_proj.weight, tiny_mtp(2).mtp[0].eh_proj.weight)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="model_type='deepseek_v3'"):
        ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_nextn_predict_layers=1)
    with pytest.raises(ValueError, match="must be >= 0"):
        ModelConfig(**{**TINY, "mtp_loss_weight": -0.1})
    hf = tiny_mtp(0).cfg.to_hf()
    del hf["num_nextn_predict_layers"]
    assert ModelConfig.from_hf(hf).num_nextn_predict_layers == 0  # absent: off (transformers' default is 1)
    assert ModelConfig.from_hf({**hf, "num_mtp_layers": 2}).num_nextn_predict_layers == 2  # its alias


# ----------------------------------------------------------------------------- training


def packed_batch(generator: torch.Generator) -> TokenBatch:
    """Two rows of 16: documents of 5, 7 and 4 tokens, and one document; one target ignored."""
    lengths = [[5, 7, 4], [16]]
    stream = torch.randint(0, 64, (2, 17), generator=generator)
    docs = torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in lengths])
    positions = torch.tensor([[i for n in row for i in range(n)] for row in lengths])
    targets = stream[:, 1:].clone()
    targets[0, 7] = IGNORE_INDEX
    return TokenBatch(stream[:, :-1], targets, docs, positions)


def reference_mtp_loss(model: Transformer, batch: TokenBatch) -> torch.Tensor:
    """The paper's formulation, one document at a time and one position at a time: the main model
    runs on the document alone, depth k on the rows j = 0..L-k-1 pairing the previous depth's row j
    with token j + k, and row j predicts the document's token j + k + 1 (the row's last slot
    predicts past the row, as the main loss does there). (1/D) Σ_k CE_k, CE_k = (1/T) Σ −log P
    with T the batch's trained tokens, as the paper divides by the sequence length."""
    T = batch.input_ids.shape[1]
    losses: dict[int, list[torch.Tensor]] = {k: [] for k in range(1, len(model.mtp) + 1)}
    for b in range(len(batch.input_ids)):
        docs = batch.document_ids[b].tolist()
        for d in sorted(set(docs)):
            a, L = docs.index(d), docs.count(d)
            u = batch.input_ids[b, a:a + L]
            h = model.hidden_states(u[None])
            for k in losses:
                cos, sin = model.rotary(torch.arange(k, L)[None], h.dtype)
                h = model.mtp[k - 1](model.embed_tokens(u[k:])[None], h[:, :L - k], cos, sin, DenseMask(None, True))
                for j in range(L - k):
                    slot = a + j + k
                    target = int(batch.targets[b, slot])
                    if target != IGNORE_INDEX and (slot + 1 < a + L or slot == T - 1):
                        losses[k].append(-model.logits(h[0, j]).log_softmax(-1)[target])
    trained = int((batch.targets != IGNORE_INDEX).sum())
    return torch.stack([torch.stack(v).sum() / trained for v in losses.values()]).mean()


def test_mtp_loss_equals_a_per_position_reference_over_packed_documents():
    model = tiny_mtp(2)
    batch = packed_batch(torch.Generator().manual_seed(3))
    attn = DenseAttentionMetadata(document_ids=batch.document_ids)
    with torch.no_grad():
        logits, depths = model(batch.input_ids, batch.positions, attn, mtp=True)
        torch.testing.assert_close(logits, model(batch.input_ids, batch.positions, attn), atol=0, rtol=0)
        count = (batch.targets != IGNORE_INDEX).sum()
        torch.testing.assert_close(mtp_loss(depths, batch.targets, batch.document_ids) / count,
                                   reference_mtp_loss(model, batch), atol=1e-5, rtol=0)


def test_the_objective_adds_the_weighted_mtp_loss_in_training_and_every_mtp_parameter_learns():
    model = tiny_mtp(2, mtp_loss_weight=0.25).train()
    batch = packed_batch(torch.Generator().manual_seed(4))
    count = int((batch.targets != IGNORE_INDEX).sum())
    terms = NextTokenObjective()(model, batch, "fp32")
    with torch.no_grad():
        logits, depths = model(batch.input_ids, batch.positions,
                               DenseAttentionMetadata(document_ids=batch.document_ids), mtp=True)
        main = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum")
        mtp = mtp_loss(depths, batch.targets, batch.document_ids)
    assert terms.count == count
    torch.testing.assert_close(terms.metrics["mtp"], mtp)
    torch.testing.assert_close(terms.loss, main + 0.25 * mtp)
    terms.loss.backward()
    for name, p in model.mtp.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    model.eval()  # evaluation: the main model's loss alone, the MTP loss still reported
    evaluated = NextTokenObjective()(model, batch, "fp32")
    torch.testing.assert_close(evaluated.loss, main)
    assert set(evaluated.metrics) == {"mtp"}


def progressions(n: int, length: int, seed: int) -> list[list[int]]:
    """Prompts from test_train_helpers' corpus: arithmetic progressions over 1..299."""
    rng = np.random.default_rng(seed)
    return [((rng.integers(1, 300) + rng.integers(1, 4) * np.arange(length)) % 299 + 1).tolist() for _ in range(n)]


def test_a_deepseek_v3_model_pretrains_with_mtp_and_its_depth_drafts_for_the_engine(tmp_path):
    """60 steps of `pretrain` on arithmetic progressions: both losses fall, the export loads in
    transformers and back, and the engine drafting with the trained depth gives plain decoding's
    greedy text with most drafts accepted (measured: 72% at k=1, 64% at k=2)."""
    from tokenmind.jsonl import read_jsonl
    from tokenmind.train import pretrain

    flags = ["--model.model_type=deepseek_v3", "--model.num_experts=4", "--model.num_experts_per_tok=2",
             "--model.moe_intermediate_size=32", "--model.n_shared_experts=1", "--model.first_k_dense_replace=1",
             "--model.topk_method=noaux_tc", "--model.scoring_func=sigmoid", "--model.num_key_value_heads=4",
             "--model.kv_lora_rank=16", "--model.q_lora_rank=24", "--model.qk_nope_head_dim=16",
             "--model.qk_rope_head_dim=8", "--model.v_head_dim=16", "--model.num_nextn_predict_layers=1",
             "--train.steps=60", "--train.eval_every=20"]
    result = pretrain(tiny_config(write_shards(tmp_path / "shards"), tmp_path / "run", *flags))
    records = list(read_jsonl(result.metrics_path))
    train = [r for r in records if "mtp" in r]
    val = [r for r in records if "val_mtp" in r]
    mtp = [r["mtp"] for r in train]
    main = [r["loss"] - 0.3 * r["mtp"] for r in train]
    assert len(mtp) == 60 and np.mean(mtp[-5:]) < mtp[0] - 1.0 and np.mean(main[-5:]) < main[0] - 0.5
    assert val[-1]["val_mtp"] < val[0]["val_mtp"] - 0.5
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.final_model_path).eval()
    model = load_hf_dir(result.final_model_path).eval()
    assert len(model.mtp) == 1 and model.cfg.mtp_loss_weight == 0.3
    ids = torch.tensor(progressions(2, 9, seed=1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=0)
    prompts = progressions(4, 5, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [naive_greedy(model, p, 20) for p in prompts]
    for k in (1, 2):
        engine = Engine(model, config=EngineConfig(block_size=4, speculative=SpeculativeConfig("mtp", k)))
        outs = [engine.add_request(p, params) for p in prompts]
        finals, _ = run(engine)
        assert [finals[i].token_ids for i in outs] == want
        assert engine.stats().acceptance_rate > 0.5, engine.stats()


# ----------------------------------------------------------------------------- the engine's drafter


PROMPTS = [[3, 14, 15, 9, 2, 6], [7, 1], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(20, 39))]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("depths,k", [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5)])
def test_greedy_mtp_speculation_equals_plain_decoding(depths, k):
    model = tiny_mtp(depths)
    engine = Engine(model, config=EngineConfig(block_size=4, speculative=SpeculativeConfig("mtp", k)))
    outs = [engine.add_request(p, GREEDY) for p in PROMPTS]
    finals, _ = run(engine)
    assert [finals[i].token_ids for i in outs] == [naive_greedy(model, p, 24) for p in PROMPTS]
    assert engine.stats().num_drafted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_greedy_equal_under_preemption_chunked_prefill_and_shared_prefixes():
    """A small pool (preemptions recompute, and the MTP state restarts), prompts prefilled in chunks,
    and prompts sharing prefix blocks (MTP entries of a block depend on its tokens and prefix only)."""
    model = tiny_mtp(2)
    prompts = PROMPTS + [PROMPTS[3] + [1, 2, 3], PROMPTS[3][:12] + [60, 61]]
    engine = Engine(model, config=EngineConfig(block_size=4, kv_cache_bytes=pool_bytes(model, 24),
                                               max_num_batched_tokens=8, max_num_seqs=6,
                                               speculative=SpeculativeConfig("mtp", 3)))
    outs = [engine.add_request(p, GREEDY) for p in prompts]
    finals, _ = run(engine)
    assert [finals[i].token_ids for i in outs] == [naive_greedy(model, p, 24) for p in prompts]
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.num_drafted_tokens > 0 and stats.prefix_cache_hit_rate > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_penalised_requests_and_forked_siblings_beside_drafting_ones():
    """A penalised request never drafts (its hidden states still pile up, in a buffer that grows by
    doubling) and decodes as without speculation; n = 3 sampled siblings fork from one prompt and
    share its blocks (copy-on-write copies the MTP pool too)."""
    model = tiny_mtp(1)
    penalised = SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    siblings = SamplingParams(max_tokens=16, temperature=1.0, n=3, seed=7, ignore_eos=True)
    plain = Engine(model, config=EngineConfig(block_size=4))
    engine = Engine(model, config=EngineConfig(block_size=4, speculative=SpeculativeConfig("mtp", 2)))
    ids = [engine.add_request(PROMPTS[0], penalised), engine.add_request(PROMPTS[2], siblings),
           engine.add_request(PROMPTS[1], GREEDY)]
    finals, _ = run(engine)
    plain_ids = [plain.add_request(PROMPTS[0], penalised)]
    plain_finals, _ = run(plain)
    assert finals[ids[0]].outputs[0].token_ids == plain_finals[plain_ids[0]].outputs[0].token_ids
    assert finals[ids[2]].outputs[0].token_ids == naive_greedy(model, PROMPTS[1], 24)
    assert [len(c.token_ids) for c in finals[ids[1]].outputs] == [16] * 3
    assert engine.stats().num_drafted_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_drafts_follow_the_dense_depths_distributions():
    """Sampled drafts carry q, the depth's distribution over the paged MTP pool: it equals the dense
    forward's depth logits over the same tokens — depth 1 at the last token for the first draft,
    depth 2 one slot later, fed the first draft, for the second."""
    model = tiny_mtp(2)
    engine = Engine(model, config=EngineConfig(block_size=4, speculative=SpeculativeConfig("mtp", 2,
                                                                                          adaptive=False)))
    seen = []
    propose = engine.proposer.propose

    def recording(seqs, ks):
        drafts = propose(seqs, ks)
        seen.extend((list(seq.token_ids), draft) for seq, draft in zip(seqs, drafts))
        return drafts

    engine.proposer.propose = recording
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=0, ignore_eos=True)
    for p in PROMPTS[:3]:
        engine.add_request(p, params)
    run(engine)
    assert sum(len(d.tokens) == 2 for _, d in seen) >= 10  # (near max_tokens fewer slots are offered)
    with torch.no_grad():
        for tokens, draft in seen:
            N = len(tokens)
            _, depths = model(torch.tensor([tokens + draft.tokens[:1]]), mtp=True)
            q = torch.stack([depths[0][0, N - 1], depths[1][0, N]]).softmax(-1)
            torch.testing.assert_close(draft.probs, q[:len(draft.tokens)], atol=1e-5, rtol=0)


def test_mtp_needs_the_models_depths():
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        Engine(tiny_mtp(0), config=EngineConfig(speculative=SpeculativeConfig("mtp")))
    with pytest.raises(ValueError, match="'mtp'"):
        SpeculativeConfig("lookahead")
