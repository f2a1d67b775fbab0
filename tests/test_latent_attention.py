"""Multi-head latent attention beyond logit parity (that is in test_model_parity.py): the paged cache
holds one latent per token, so it needs a fraction of the bytes and the engine runs more sequences
in the same memory. (Absorbed decode over the pool == the expanded attention: test_paged_attention.py.)"""

import torch

from tokenmind.engine.config import EngineConfig
from tokenmind.engine.llm import Engine
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.config import ModelConfig
from tokenmind.model.paged_attention import PagedKVCache
from tokenmind.model.transformer import Transformer

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)
LATENT = dict(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              rope_interleave=True)


def tiny(**extra) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**TINY, **extra}))
    model.init_weights(std=0.3)
    return model.eval()


def test_deepseek_v2_lite_caches_576_values_per_token_and_layer_instead_of_5120():
    """DeepSeek-V2-Lite's attention (16 heads, 128 + 64 query/key and 128 value dims per head,
    a 512 latent): the pool stores the latent and the RoPE key, 576 values; expanding keys and
    values per head, as a cache without the latent trick must, takes 16 · (192 + 128) = 5120."""
    lite = ModelConfig(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                       num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
                       qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=64,
                       num_experts_per_tok=6, moe_intermediate_size=1408, n_shared_experts=2, first_k_dense_replace=1)
    assert lite.kv_cache_entry() == (1, 576, 0)
    per_token = PagedKVCache.bytes_per_block(lite, 1, torch.bfloat16)
    assert per_token == 27 * 576 * 2  # 31 KB per token in bf16
    expanded = 27 * 16 * (192 + 128) * 2
    assert expanded / per_token > 8.8


def test_the_engine_runs_proportionally_more_sequences_in_the_same_cache_memory():
    """Same width, heads and per-head dims, same byte budget: a GQA model (4 query / 2 key-value
    heads of 16) needs 64 cached values per token and layer, the latent model 24 (16 + 8). The
    latent pool gets 64/24 times the blocks and keeps over twice the sequences running at once."""
    latent = tiny(model_type="deepseek_v3", **LATENT)
    gqa = tiny(model_type="llama", num_key_value_heads=2, head_dim=16)
    assert latent.cfg.kv_cache_entry() == (1, 24, 0) and gqa.cfg.kv_cache_entry() == (2, 16, 16)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (12,), generator=g).tolist() for _ in range(12)]
    budget = 16 * PagedKVCache.bytes_per_block(gqa.cfg, 4, torch.float32)  # 16 GQA blocks; a sequence needs 5
    peaks, blocks = {}, {}
    for name, model in (("latent", latent), ("gqa", gqa)):
        engine = Engine(model, config=EngineConfig(block_size=4, kv_cache_bytes=budget, max_num_seqs=12,
                                                   max_num_batched_tokens=64))
        for p in prompts:
            engine.add_request(p, params)
        peak, finished = 0, 0
        while engine.has_unfinished():
            finished += sum(out.finished for out in engine.step())
            peak = max(peak, engine.stats().num_running)
        assert finished == len(prompts)
        peaks[name], blocks[name] = peak, engine.block_manager.num_blocks
    assert blocks == {"latent": 16 * 64 // 24, "gqa": 16}
    assert peaks["latent"] >= 2 * peaks["gqa"]  # measured: 11 vs 5 (a 12-token prompt holds 3 blocks)
