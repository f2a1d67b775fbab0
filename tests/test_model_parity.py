"""Our Transformer vs Hugging Face `transformers` on the same random weights (fp32, tiny configs)."""

import pytest
import torch
import transformers

from test_paged_attention import Pool, run_step

from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.checkpoint import from_hf_state_dict
from tokenmind.model.config import ModelConfig
from tokenmind.model.paged_attention import PagedKVCache
from tokenmind.model.transformer import Transformer

TOL = 1e-4
BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)

CASES = {
    "llama-gqa": dict(model_type="llama"),
    "llama-mha-tied": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=True),
    "llama-mqa-bias": dict(model_type="llama", num_key_value_heads=1, qkv_bias=True, o_bias=True),
    "mistral-window": dict(model_type="mistral", sliding_window=5),
    "qwen2-bias": dict(model_type="qwen2", qkv_bias=True),
    "qwen3-qknorm": dict(model_type="qwen3", qk_norm=True, head_dim=24),
    "mixtral-moe": dict(model_type="mixtral", num_experts=4, num_experts_per_tok=2),
    "qwen2-moe-shared": dict(model_type="qwen2_moe", qkv_bias=True, num_experts=6, num_experts_per_tok=3,
                             moe_intermediate_size=32, norm_topk_prob=False, shared_expert_intermediate_size=48,
                             mlp_only_layers=[1]),
    "qwen3-moe-sparse-step": dict(model_type="qwen3_moe", qk_norm=True, num_experts=5, num_experts_per_tok=2,
                                  moe_intermediate_size=40, norm_topk_prob=True, decoder_sparse_step=2,
                                  num_hidden_layers=3),
    "olmoe-clip": dict(model_type="olmoe", qk_norm=True, qk_norm_per_head=False, clip_qkv=0.8, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=False),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
                             routed_scaling_factor=1.5, kv_lora_rank=24, q_lora_rank=None, qk_nope_head_dim=16,
                             qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True),
    "deepseek-v2-groups": dict(model_type="deepseek_v2", num_key_value_heads=4, num_experts=8, num_experts_per_tok=3,
                               moe_intermediate_size=24, n_shared_experts=1, topk_method="group_limited_greedy",
                               n_group=4, topk_group=2, qkv_bias=True, o_bias=True, kv_lora_rank=20, q_lora_rank=28,
                               qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True),
    "deepseek-v3": dict(model_type="deepseek_v3", num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=24, n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3,
                        topk_method="noaux_tc", scoring_func="sigmoid", n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5, kv_lora_rank=24, q_lora_rank=32, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, rope_interleave=True),
    "deepseek-v3-yarn-plain-rope": dict(
        model_type="deepseek_v3", num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        n_shared_experts=1, topk_method="noaux_tc", scoring_func="sigmoid", kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_interleave=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0,
                      "mscale_all_dim": 1.0}),
    # Gemma: sandwich norms, GELU-tanh, scaled embeddings, query_pre_attn_scalar, local/global layers
    "gemma2": dict(model_type="gemma2", hidden_act="gelu_pytorch_tanh", head_dim=24, query_pre_attn_scalar=20,
                   sliding_window=4, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
                   attn_logit_softcapping=0.2, final_logit_softcapping=0.5),
    "gemma3": dict(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", qk_norm=True, query_pre_attn_scalar=12,
                   sliding_window=3, num_hidden_layers=3, tie_word_embeddings=True, final_logit_softcapping=4.0,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_local_theta=100.0,
                   rope_theta=50000.0, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "rope-linear": dict(model_type="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "rope-dynamic": dict(model_type="llama", max_position_embeddings=8,
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "rope-yarn": dict(model_type="llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 16}),
    "rope-llama3": dict(model_type="llama", rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


def make_pair(case: str, seed: int = 0):
    cfg = ModelConfig(**{**BASE, **CASES[case]})
    torch.manual_seed(seed)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    with torch.no_grad():  # make biases and norms non-trivial so they are really compared
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):  # routers: spread scores, so the top-k is never a near tie
                p.normal_(0.0, 1.0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3: a bias that really moves the choice
                b.normal_(0.0, 0.3)
    ours = Transformer(cfg).eval()
    ours.load_state_dict(from_hf_state_dict(hf.state_dict()), strict=True)
    return cfg, hf, ours


def left_padded_batch(cfg, lengths, generator):
    T = max(lengths)
    ids = torch.randint(0, cfg.vocab_size, (len(lengths), T), generator=generator)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, T - n:] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@pytest.mark.parametrize("case", list(CASES))
def test_full_forward_matches_hf(case):
    cfg, hf, ours = make_pair(case)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = hf(ids).logits, ours(ids)
    assert (ref - got).abs().max().item() <= TOL
    assert cfg.num_parameters == sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_padded_batch_matches_hf(case):
    cfg, hf, ours = make_pair(case)
    ids, mask, pos = left_padded_batch(cfg, [11, 7, 3], torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, pos, DenseAttentionMetadata(key_padding=mask.bool()))
    real = mask.bool()
    assert (ref[real] - got[real]).abs().max().item() <= TOL
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("case", list(CASES))
def test_paged_cache_decode_matches_hf_cache(case):
    """Two sequences through the block pool, batched in the same steps — a 6-token prefill chunk,
    then one token at a time — against HF running each alone with its own DynamicCache."""
    cfg, hf, ours = make_pair(case)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 9)]
    pool, cache = Pool(16), PagedKVCache(cfg, num_blocks=16, block_size=4)
    seqs = [(t, pool.table(len(t))) for t in tokens]
    got: list[list[torch.Tensor]] = [[], []]
    for step in range(12 - 5):
        chunks = [(0, 6) if step == 0 else (min(5 + step, len(t)), min(6 + step, len(t))) for t, _ in seqs]
        live = [i for i, (a, b) in enumerate(chunks) if b > a]
        for i, out in zip(live, run_step(ours, cache, [seqs[i] for i in live], [chunks[i] for i in live])):
            got[i].append(out)
    for t, mine in zip(tokens, got):
        ids = torch.tensor([t])
        with torch.no_grad():
            past = transformers.DynamicCache(config=hf.config)
            ref = torch.cat([hf(ids[:, a:b], past_key_values=past, use_cache=True).logits[0]
                             for a, b in [(0, 6)] + [(p, p + 1) for p in range(6, len(t))]])
        assert (ref - torch.cat(mine)).abs().max().item() <= TOL


def test_attention_softcapping_matches_manual_reference():
    """Soft-capping checked against the formula directly (Gemma 2's cases check it against HF)."""
    cfg = ModelConfig(**{**BASE, "model_type": "llama", "attn_logit_softcapping": 2.0,
                         "final_logit_softcapping": 3.0, "num_hidden_layers": 1})
    torch.manual_seed(0)
    ours = Transformer(cfg).eval()
    ours.init_weights(std=0.3)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    with torch.no_grad():
        got = ours(ids)
        attn, blk = ours.layers[0].self_attn, ours.layers[0]
        x = ours.embed_tokens(ids)
        h = blk.input_layernorm(x)
        pos = torch.arange(6)[:, None].float() * ours.rotary.inv_freq  # (T, D/2)
        cos, sin = pos.cos(), pos.sin()

        def rope(x):  # rotate-half RoPE written out: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
            x1, x2 = x[..., :8], x[..., 8:]
            c, s_ = cos[:, None], sin[:, None]
            return torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], -1)

        wq, wk, wv = attn.qkv_proj.weight.split([64, 32, 32])
        q = rope((h @ wq.T).view(1, 6, 4, 16)).transpose(1, 2)
        k = rope((h @ wk.T).view(1, 6, 2, 16)).transpose(1, 2).repeat_interleave(2, 1)
        v = (h @ wv.T).view(1, 6, 2, 16).transpose(1, 2).repeat_interleave(2, 1)
        s = q @ k.transpose(-1, -2) / 4.0
        s = 2.0 * torch.tanh(s / 2.0)
        s = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
        o = (s.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 64)
        x = x + attn.o_proj(o)
        x = x + blk.mlp(blk.post_attention_layernorm(x))
        logits = ours.lm_head(ours.norm(x))
        ref = 3.0 * torch.tanh(logits / 3.0)
    assert (ref - got).abs().max().item() <= 1e-5
    assert got.abs().max().item() <= 3.0


def test_config_validation_names_the_fix():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ModelConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=48)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*llama"):
        ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 1})
    with pytest.raises(ValueError, match="rope_scaling type 'longrope'"):
        ModelConfig(rope_scaling={"rope_type": "longrope", "factor": 2.0})


def test_document_ids_isolate_packed_documents():
    """A packed row of two documents gives each the logits it gets alone (positions restart)."""
    _, _, ours = make_pair("llama-gqa")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 101, (1, 7), generator=g), torch.randint(0, 101, (1, 5), generator=g)
    packed = torch.cat([a, b], 1)
    docs = torch.tensor([[0] * 7 + [1] * 5])
    pos = torch.tensor([list(range(7)) + list(range(5))])
    with torch.no_grad():
        got = ours(packed, pos, DenseAttentionMetadata(document_ids=docs))
        alone = torch.cat([ours(a), ours(b)], 1)
        leaky = ours(packed)
    assert (got - alone).abs().max().item() <= TOL
    assert (leaky[:, 7:] - alone[:, 7:]).abs().max().item() > 1e-3  # without the mask, b would see a


def test_single_document_rows_take_the_plain_causal_path():
    """Rows that are one document each need no mask tensor (SDPA's causal kernel); mixed rows do."""
    pos = torch.arange(6).expand(2, 6)
    single = DenseAttentionMetadata(document_ids=torch.tensor([[3] * 6, [0] * 6])).resolve(pos, None)
    assert single.causal and single.tensor is None
    mixed = DenseAttentionMetadata(document_ids=torch.tensor([[0, 0, 0, 1, 1, 1], [0] * 6])).resolve(pos, None)
    assert not mixed.causal and mixed.tensor.shape == (2, 1, 6, 6) and not mixed.tensor[0, 0, 3, 2]


def test_a_shared_prefix_serves_several_continuations_in_one_row():
    """context + continuation a + continuation b in one row: each continuation sees the context and
    itself (positions restart after the context), exactly as when it runs alone after the context."""
    _, _, ours = make_pair("mistral-window")  # a sliding window must follow positions, not row order
    g = torch.Generator().manual_seed(6)
    ctx, a, b = (torch.randint(0, 101, (1, n), generator=g) for n in (6, 4, 3))
    row = torch.cat([ctx, a, b], 1)
    docs = torch.tensor([[0] * 6 + [1] * 4 + [2] * 3])
    pos = torch.tensor([list(range(6)) + list(range(6, 10)) + list(range(6, 9))])
    meta = DenseAttentionMetadata(document_ids=docs, prefix_len=torch.tensor([6]))
    with torch.no_grad():
        got = ours(row, pos, meta)
        alone_a, alone_b = ours(torch.cat([ctx, a], 1)), ours(torch.cat([ctx, b], 1))
    assert (got[:, :10] - alone_a).abs().max().item() <= TOL
    assert (got[:, 10:] - alone_b[:, 6:]).abs().max().item() <= TOL


def test_the_causal_mask_hides_later_tokens():
    """Changing token 5 leaves the logits of positions 0–4 exactly as they were and changes 5 onward."""
    _, _, ours = make_pair("llama-gqa")
    ids = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 101
    with torch.no_grad():
        before, after = ours(ids), ours(changed)
    assert torch.equal(before[:, :5], after[:, :5])
    assert (before[:, 5:] - after[:, 5:]).abs().amax(-1).min().item() > 1e-4
