"""GGUF mixtures of experts: Mixtral (a "llama" file with experts), Qwen2-MoE (shared expert) and
Qwen3-MoE written the way llama.cpp's convert_hf_to_gguf.py lays them out, from random
`transformers` models, must load into tokenmind with the logits of the model they were written from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from test_gguf import HEADS, HIDDEN, KV_HEADS, LAYERS, TOKENS, llamacpp_permute, tiny_meta, write_gguf

from tokenmind.model.config import ModelConfig
from tokenmind.model.gguf import GGUFError, read_gguf
from tokenmind.model.load import load_model
from tokenmind.model.quant import Int8Linear, quantize_model
from tokenmind.model.transformer import Experts, Router, Transformer

EXPERTS, TOP_K, INTER = 4, 2, 96
CASES = {  # GGUF arch -> our ModelConfig of the source model
    "mixtral": ("llama", dict(model_type="mixtral")),
    "qwen2moe": ("qwen2moe", dict(model_type="qwen2_moe", qkv_bias=True, moe_intermediate_size=32,
                                  shared_expert_intermediate_size=64, norm_topk_prob=False)),
    # llama.cpp always renormalises Qwen3-MoE's top-k; layer 1 dense exercises mlp_only_layers
    "qwen3moe": ("qwen3moe", dict(model_type="qwen3_moe", qk_norm=True, head_dim=32, moe_intermediate_size=32,
                                  norm_topk_prob=True, mlp_only_layers=[1])),
}
_NAMES = {  # HF module -> llama.cpp tensor (llama.cpp's constants.py TENSOR_NAMES)
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip


def hf_model(case: str, seed: int = 0):
    cfg = ModelConfig(vocab_size=len(TOKENS), hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                      rms_norm_eps=1e-5, rope_theta=500000.0, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                      **CASES[case][1])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf())).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):  # spread router scores: no near-tie top-k
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.1)
    return cfg, model


def llamacpp_tensors(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A transformers 5 state dict as llama.cpp's converter writes it: experts split into gate and up
    slabs (E, I, H) and down (E, H, I); q/k permuted for the llama family; the shared expert's
    (1, H) gate squeezed to (H,), as the converter's `squeeze()` leaves it."""
    out = {}
    for name, t in sd.items():
        w = t.detach().numpy()
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            out["output.weight"] = w
        elif name.endswith(".mlp.experts.gate_up_proj"):
            i = name.split(".")[2]
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = np.split(w, 2, axis=1)
        elif name.endswith(".mlp.experts.down_proj"):
            out[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = w
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if cfg.model_type == "mixtral" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                w = llamacpp_permute(w, HEADS if module == "self_attn.q_proj" else KV_HEADS)
            out[f"blk.{i}.{_NAMES[module]}.{kind}"] = w.squeeze() if module == "mlp.shared_expert_gate" else w
    return out


def llamacpp_meta(arch: str, cfg: ModelConfig) -> dict:
    meta = tiny_meta(arch) | {f"{arch}.feed_forward_length": INTER, f"{arch}.expert_count": EXPERTS,
                              f"{arch}.expert_used_count": TOP_K,
                              # byte-level tokens for printable ASCII, space (Ġ) and newline (Ċ), no merges
                              "tokenizer.ggml.tokens": [chr(33 + i) for i in range(len(TOKENS) - 2)] + ["Ġ", "Ċ"],
                              "tokenizer.ggml.token_type": [1] * len(TOKENS), "tokenizer.ggml.merges": []}
    if arch != "llama":  # Mixtral's experts are intermediate_size wide; Qwen's have their own size
        meta[f"{arch}.expert_feed_forward_length"] = cfg.moe_intermediate_size
    if cfg.shared_expert_intermediate_size:
        meta[f"{arch}.expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    if cfg.model_type == "qwen3_moe":
        meta[f"{arch}.attention.key_length"] = meta[f"{arch}.attention.value_length"] = cfg.head_dim
    return meta


def write_moe(path, case: str, qtypes=None, seed: int = 0, edit=None):
    """(path, HF model, the float arrays the file holds once dequantized). qtypes: GGUF name -> type;
    edit(meta, tensors): changes the file before it is written."""
    cfg, model = hf_model(case, seed)
    tensors, stored = {}, {}
    for name, w in llamacpp_tensors(cfg, model.state_dict()).items():
        qtype = (qtypes or {}).get(name, Q.F32)
        tensors[name] = w if qtype == Q.F32 else (quantize(w, qtype), qtype)
        stored[name] = w if qtype == Q.F32 else dequantize(quantize(w, qtype), qtype)
    arch = CASES[case][0]
    meta = llamacpp_meta(arch, cfg)
    if edit is not None:
        edit(meta, tensors)
    return write_gguf(path, arch, meta, tensors), model, stored


IDS = torch.tensor([[1, 5, 17, 42, 99, 3, 64, 8, 23]])


@pytest.mark.parametrize("case", list(CASES))
def test_moe_gguf_loads_with_the_logits_of_the_model_it_was_written_from(tmp_path, case):
    path, model, _ = write_moe(tmp_path / f"{case}.gguf", case)
    ckpt = read_gguf(path)
    assert ckpt.config["model_type"] == CASES[case][1]["model_type"]
    config, want = ModelConfig.from_hf(ckpt.config), ModelConfig.from_hf(model.config.to_dict())
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "shared_expert_intermediate_size", "mlp_only_layers", "qkv_bias", "qk_norm", "head_dim"):
        assert getattr(config, key) == getattr(want, key), key
    # the file's tensors, translated, are transformers' own state dict (names, shapes, values)
    theirs = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    loaded = ckpt.load_state_dict()
    assert set(loaded) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(loaded[name], t), name

    ours = load_model(path).model
    assert isinstance(ours.layers[0].mlp.experts, Experts)
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS), model(IDS).logits, atol=1e-4, rtol=0)


def test_layout_is_the_one_llama_cpp_loads(tmp_path):
    """The file's dimensions (GGUF order, fastest first) are those llama.cpp's loader asks for
    (llama-model.cpp create_tensor): {n_embd, n_ff_exp, n_expert} for gate/up, and so on."""
    path, _, _ = write_moe(tmp_path / "m.gguf", "qwen2moe")
    dims = {t.name: tuple(int(d) for d in t.shape) for t in gguf.GGUFReader(path).tensors}
    cfg = CASES["qwen2moe"][1]
    h, ff, shared = HIDDEN, cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    expected = {"ffn_gate_inp": (h, EXPERTS), "ffn_gate_exps": (h, ff, EXPERTS), "ffn_up_exps": (h, ff, EXPERTS),
                "ffn_down_exps": (ff, h, EXPERTS), "ffn_gate_shexp": (h, shared), "ffn_up_shexp": (h, shared),
                "ffn_down_shexp": (shared, h), "ffn_gate_inp_shexp": (h,)}
    for base, ne in expected.items():
        assert dims[f"blk.0.{base}.weight"] == ne, base


@pytest.mark.filterwarnings("ignore:int4 needs out_features divisible by 16")  # the 100-token LM head
def test_q8_0_experts_dequantize_and_load(tmp_path):
    slabs = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
             "attn_q", "attn_k", "attn_v", "attn_output")
    qtypes = {f"blk.{i}.{s}.weight": Q.Q8_0 for i in range(LAYERS) for s in slabs}
    qtypes["blk.1.ffn_up_exps.weight"] = Q.Q4_0  # gate and up of one layer in different types
    path, model, stored = write_moe(tmp_path / "q8.gguf", "qwen2moe", qtypes)
    ckpt = read_gguf(path)

    data, qtype, shape = ckpt.raw_tensor("model.layers.0.mlp.experts.gate_up_proj")
    assert qtype == Q.Q8_0 and shape == (EXPERTS, 64, HIDDEN) and data.shape == (EXPERTS, 64, HIDDEN // 32 * 34)
    np.testing.assert_array_equal(dequantize(data, qtype).reshape(shape),
                                  ckpt.tensor("model.layers.0.mlp.experts.gate_up_proj").numpy())
    mixed = r"joins blk.1.ffn_gate_exps.weight \(Q8_0\) and blk.1.ffn_up_exps.weight \(Q4_0\)"
    with pytest.raises(GGUFError, match=mixed):
        ckpt.raw_tensor("model.layers.1.mlp.experts.gate_up_proj")
    gate_up = ckpt.tensor("model.layers.1.mlp.experts.gate_up_proj").numpy()
    np.testing.assert_array_equal(gate_up, np.concatenate([stored["blk.1.ffn_gate_exps.weight"],
                                                           stored["blk.1.ffn_up_exps.weight"]], axis=1))

    # the reference: transformers with the weights the file holds, dequantized
    model.load_state_dict(ckpt.load_state_dict(), strict=True)
    with torch.no_grad():
        want = model(IDS).logits
        torch.testing.assert_close(load_model(path).model(IDS), want, atol=1e-4, rtol=0)
        for quant in ("auto", "int8", "int4"):  # the quantized-kernel paths leave the expert slabs float
            pre = load_model(path, quantize=quant)
            mlp = pre.model.layers[0].mlp
            assert isinstance(mlp.shared_expert.gate_up_proj, Int8Linear)  # Q8_0 blocks -> int8 kernel
            assert type(mlp.gate) is Router and type(mlp.shared_expert_gate) is torch.nn.Linear
            assert mlp.experts.gate_up_proj.dtype == torch.float32
            got = pre.model(IDS)
            assert (got - want).abs().max() < 0.05 * want.abs().max(), quant
            assert torch.equal(got.argmax(-1), want.argmax(-1)), quant


def test_quantize_model_keeps_routers_float():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      model_type="qwen2_moe", num_experts=16, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32)
    model = quantize_model(Transformer(cfg), "int8")
    mlp = model.layers[0].mlp
    assert type(mlp.gate) is Router and type(mlp.shared_expert_gate) is torch.nn.Linear
    assert isinstance(mlp.shared_expert.down_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def edited(tmp_path, case="qwen3moe", **changes):
    """A file with metadata keys set (`meta`), tensors dropped (`drop`) or renamed (`rename`)."""
    def edit(meta, tensors):
        meta.update(changes.get("meta", {}))
        for name in changes.get("drop", ()):
            del tensors[name]
        for old, new in changes.get("rename", {}).items():
            tensors[new] = tensors.pop(old)

    return write_moe(tmp_path / "edited.gguf", case, edit=edit)[0]


def test_unsupported_moe_architecture(tmp_path):
    path = write_gguf(tmp_path / "ds.gguf", "deepseek2", {"deepseek2.expert_count": 64}, {})
    with pytest.raises(ValueError, match=r"unsupported mixture-of-experts GGUF architecture 'deepseek2' \(64 "
                                         r"experts\); supported: Mixtral \(written as 'llama'\), qwen2moe, qwen3moe"):
        read_gguf(path)


def test_experts_in_a_dense_architecture(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen2", {"qwen2.expert_count": 8}, {})
    with pytest.raises(ValueError, match=r"a 'qwen2' file with 8 experts has no Hugging Face equivalent"):
        read_gguf(path)


def test_sigmoid_routing_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"expert_gating_func is 2 \(sigmoid routing\)"):
        read_gguf(edited(tmp_path, meta={"qwen3moe.expert_gating_func": 2}))


def test_up_slab_without_its_gate(tmp_path):
    with pytest.raises(ValueError, match=r"joins a layer's ffn_gate_exps and ffn_up_exps, but the file has only "
                                         r"'blk.0.ffn_up_exps.weight'"):
        read_gguf(edited(tmp_path, drop=["blk.0.ffn_gate_exps.weight"]))


def test_pre_2024_per_expert_tensors_name_the_fix(tmp_path):
    path = edited(tmp_path, rename={"blk.0.ffn_down_exps.weight": "blk.0.ffn_down.3.weight"})
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.3.weight' is one expert's matrix.*re-convert"):
        read_gguf(path)


def test_mixtral_without_renormalisation_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"expert_weights_norm is false, but Mixtral always renormalises"):
        read_gguf(edited(tmp_path, "mixtral", meta={"llama.expert_weights_norm": False}))
