"""Gemma 2 and Gemma 3 beyond logit parity (that is in test_model_parity.py): checkpoints that
transformers writes and reads, config.json as published (transformers' defaults for the keys it
leaves out), training through the pre-training loop, and the paged engine with local and global
layers in one model."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_engine_llm import assert_batched_greedy_equals_naive
from test_train_helpers import one_thread, tiny_config, write_shards  # noqa: F401 (one_thread: autouse)

from tokenmind.model.checkpoint import load_hf_dir, save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import SandwichBlock, Transformer
from tokenmind.train import pretrain

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
FAMILIES = {
    "gemma2": dict(model_type="gemma2", num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=6,
                   attn_logit_softcapping=0.5, final_logit_softcapping=2.0),
    "gemma3_text": dict(model_type="gemma3_text", num_hidden_layers=3, sliding_window=3, qk_norm=True,
                        query_pre_attn_scalar=8, rope_theta=40000.0, rope_local_theta=50.0,
                        rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def hf_gemma(model_type: str, seed: int = 0):
    """A random transformers Gemma (norm weights spread around 0, i.e. scales around 1)."""
    hf_dict = ModelConfig(**{**TINY, **FAMILIES[model_type], "hidden_act": "gelu_pytorch_tanh"}).to_hf()
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf_dict)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
            else:
                p.mul_(10)  # transformers' 0.02 init barely reaches the soft-caps and windows
    return hf


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_transformers_checkpoint_loads_and_saves_back_with_equal_logits(tmp_path, model_type):
    """transformers writes the v5 config.json (layer_types, per-layer-type rope_parameters); we
    load it, and what we save loads in transformers and in tokenmind with the same logits."""
    hf = hf_gemma(model_type)
    hf.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "layer_types" in saved and "rope_parameters" in saved
    ours = load_hf_dir(tmp_path / "hf")
    assert isinstance(ours.layers[0], SandwichBlock) and ours.cfg.layer_types == hf.config.layer_types
    assert [layer.self_attn.window for layer in ours.layers] == [
        hf.config.sliding_window if kind == "sliding_attention" else None for kind in hf.config.layer_types]
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=0)
        save_hf_dir(ours, tmp_path / "ours")
        again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
        torch.testing.assert_close(again(ids).logits, want, atol=1e-4, rtol=0)
        back = load_hf_dir(tmp_path / "ours")
        torch.testing.assert_close(back(ids), ours(ids), atol=0, rtol=0)
    assert back.cfg == ours.cfg


PUBLISHED = {  # config.json keys as the Hub's checkpoints spell them (transformers 4), trimmed to tiny sizes
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 64,
               "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "gelu_pytorch_tanh",
               "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 8, "rope_theta": 10000.0,
               "sliding_window": 4, "max_position_embeddings": 64, "rms_norm_eps": 1e-06},
    "gemma3_text": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 64,
                    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 7, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh",
                    "query_pre_attn_scalar": 8, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 4,
                    "sliding_window_pattern": 6, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "max_position_embeddings": 64, "rms_norm_eps": 1e-06},
}


@pytest.mark.parametrize("model_type", list(PUBLISHED))
def test_published_config_means_what_it_means_to_transformers(tmp_path, model_type):
    """Keys a published config.json leaves out take transformers' defaults (Gemma 2 soft-caps at
    50 and 30; the layer pattern; tied embeddings): the same logits from the same weights."""
    published = PUBLISHED[model_type]
    theirs = transformers.AutoConfig.for_model(**published)
    cfg = ModelConfig.from_hf(published)
    assert cfg.layer_types == theirs.layer_types
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (
        (50.0, 30.0) if model_type == "gemma2" else (None, None))
    assert cfg.tie_word_embeddings and cfg.hidden_act == "gelu_pytorch_tanh"
    if model_type == "gemma3_text":
        assert theirs.layer_types[5] == "full_attention" and cfg.layer_types.count("full_attention") == 1
        assert cfg.rope_local_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.rope_theta == 1e6
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(theirs).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(10) if p.ndim == 2 else p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(published))  # the published spelling, not v5's
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(load_hf_dir(tmp_path / "hf")(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="does not soft-cap attention"):
        ModelConfig(**{**TINY, "model_type": "gemma3_text", "num_hidden_layers": 2, "attn_logit_softcapping": 50.0})
    with pytest.raises(ValueError, match="layer_types must name one of"):
        ModelConfig(**{**TINY, "model_type": "gemma2", "num_hidden_layers": 2, "layer_types": ["sliding_attention"]})
    with pytest.raises(ValueError, match="layer_types .* is Gemma's"):
        ModelConfig(**{**TINY, "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'"):
        ModelConfig.from_hf({**PUBLISHED["gemma2"], "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf({**PUBLISHED["gemma3_text"], "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="multimodal.*gemma3_text"):
        ModelConfig.from_hf({"model_type": "gemma3", "text_config": PUBLISHED["gemma3_text"]})


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_paged_engine_decodes_gemma_batched_as_it_does_alone(model_type):
    """Local (windowed) and global layers share one block pool; sequences run past the window."""
    cfg = ModelConfig(**{**TINY, **FAMILIES[model_type], "hidden_act": "gelu_pytorch_tanh"})
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(std=0.3)
    assert_batched_greedy_equals_naive(model.eval(), max_tokens=10)


def test_gemma_pretrains_and_exports_a_checkpoint_transformers_reads(tmp_path: Path):
    shards = write_shards(tmp_path / "shards")
    cfg = tiny_config(shards, tmp_path / "run", "--model.model_type=gemma3_text", "--model.qk_norm=true",
                      "--model.hidden_act=gelu_pytorch_tanh", "--model.sliding_window=8",
                      "--model.layer_types=[sliding_attention,full_attention]", "--model.tie_word_embeddings=true",
                      "--model.query_pre_attn_scalar=16", "--train.steps=30", "--optim.lr=1e-2")
    result = pretrain(cfg)
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 1.0
    model = load_hf_dir(result.final_model_path)
    assert model.cfg.model_type == "gemma3_text" and model.cfg.layer_types == ["sliding_attention", "full_attention"]
    assert any(p.detach().any() for n, p in model.named_parameters() if n.endswith("norm.weight"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.final_model_path).eval()
    ids = torch.randint(1, 64, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_init_weights_starts_every_norm_at_scale_one():
    """Gemma's RMSNorm scales by 1 + weight: fresh weights are 0, as in transformers' init."""
    model = Transformer(ModelConfig(**{**TINY, **FAMILIES["gemma3_text"]}))
    model.init_weights()
    norms = {n: p for n, p in model.named_parameters() if n.endswith("norm.weight")}
    assert len(norms) == 3 * 6 + 1 and all(not p.any() for p in norms.values())
    x = torch.randn(2, 32)
    torch.testing.assert_close(model.norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def test_embeddings_are_scaled_by_sqrt_hidden_rounded_to_bf16_as_in_transformers():
    """sqrt(32) = 5.657 is 5.656 in bf16; HF multiplies by the rounded value, and so must we."""
    hf = hf_gemma("gemma2").to(torch.bfloat16)
    ours = Transformer(ModelConfig.from_hf(hf.config.to_dict())).to(torch.bfloat16).eval()
    ours.embed_tokens.weight.data.copy_(hf.model.embed_tokens.weight.data)
    seen = []
    ours.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours(ids)
        want = hf.model.embed_tokens(ids)
    assert seen[0].dtype == torch.bfloat16 and torch.equal(seen[0], want)
    assert not torch.equal(want, (hf.model.embed_tokens.weight[ids].float() * 32 ** 0.5).to(torch.bfloat16))
