"""The native int4/int8 decode kernels (model/native_kernels.c): exact to int16 activations, on PyTorch's own packing."""

import shutil

import pytest
import torch

from tokenmind.model import native
from tokenmind.model.quant import Int4Linear, Int8Linear, int4_block_rows

needs_native = pytest.mark.skipif(not native.available(), reason="no AVX2 CPU or C compiler here")


@pytest.fixture
def fresh_native():
    """Forget the loaded library and the default decision, before and after (tests change their inputs)."""
    def clear():
        native.library.cache_clear()
        native.preferred.cache_clear()
    clear()
    yield
    clear()


RAGGED_PROMPTS = [[5, 9, 3], list(range(10, 40)), [7] * 11]


def _greedy(model, max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Tokens and their logprobs for RAGGED_PROMPTS decoded together (blocks of 4: contexts span several)."""
    from tokenmind.engine.config import EngineConfig
    from tokenmind.engine.llm import Engine
    from tokenmind.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    engine = Engine(model, config=EngineConfig(block_size=4, max_num_seqs=4))
    ids = [engine.add_request(p, params) for p in RAGGED_PROMPTS]
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [(finals[i].outputs[0].token_ids, [s.logprob for s in finals[i].outputs[0].logprobs]) for i in ids]


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return (x.double() @ weight.double().T)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst error relative to the output's scale (the bf16 kernels are ~1e-2 here)."""
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@needs_native
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_int4_kernel_matches_the_dequantized_weight(group_size, rows):
    torch.manual_seed(0)
    lin = Int4Linear.from_float(torch.randn(192, 256), group_size=group_size)
    x = torch.randn(rows, 256)
    y = native.int4_matmul(x, lin.weight, lin.scales_and_zeros, int4_block_rows(), group_size)
    assert _rel_err(y, _reference(x, lin.dequantize(torch.float32))) < 1e-4


def _pack_int4(codes: torch.Tensor, block_rows: int) -> torch.Tensor:
    """PyTorch's int4pack layout with `block_rows` rows per block, written from its description."""
    n, k = codes.shape
    half = block_rows // 2
    blocks = codes.view(n // block_rows, 2, half, k)  # [block, low/high, j, k]
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [block, j, k]
    return packed.transpose(1, 2).contiguous().view(n, k // 2)  # each block as (k, half) bytes


@needs_native
@pytest.mark.parametrize("block_rows", [32, 64])
def test_int4_kernel_reads_both_packings(block_rows):
    """AVX2 machines pack rows in blocks of 32, AVX-512 ones in 64: the kernel takes either."""
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (128, 96), dtype=torch.uint8)
    scales, zeros = torch.rand(3, 128) / 10 + 0.01, torch.randn(3, 128) / 10
    sz = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16)
    weight = (codes.float() - 8).view(128, 3, 32) * sz[..., 0].t().float()[..., None] + sz[..., 1].t().float()[..., None]
    x = torch.randn(2, 96)
    y = native.int4_matmul(x, _pack_int4(codes, block_rows), sz.contiguous(), block_rows, 32)
    assert _rel_err(y, _reference(x, weight.view(128, 96))) < 1e-4
    if block_rows == int4_block_rows():  # the helper agrees with PyTorch's packer on this machine
        assert torch.equal(_pack_int4(codes, block_rows), torch._convert_weight_to_int4pack_for_cpu(codes.int(), 1))


@needs_native
def test_a_rows_result_does_not_depend_on_its_batch_or_threads():
    """Batched decode must give each sequence its solo result bit for bit, whatever the thread count."""
    torch.manual_seed(2)
    lin = Int4Linear.from_float(torch.randn(1024, 512))
    head = Int8Linear.from_float(torch.randn(1000, 512))
    x = torch.randn(5, 512)
    x[3] = 0  # a zero row: scale 0, output exactly 0 for int8
    threads = torch.get_num_threads()
    for layer, kernel in ((lin, lin._native_kernel), (head, head._native_kernel)):
        batch = kernel(x)
        for i in range(5):
            assert torch.equal(kernel(x[i:i + 1]), batch[i:i + 1])
        torch.set_num_threads(2 if threads == 1 else 1)
        try:
            assert torch.equal(kernel(x), batch)
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(head._native_kernel(x)[3], torch.zeros(1000))


@needs_native
def test_int8_kernel_matches_the_dequantized_weight():
    torch.manual_seed(3)
    lin = Int8Linear.from_float(torch.randn(1001, 320))  # a row count that leaves a partial group of four
    x = torch.randn(7, 320) * 5
    assert _rel_err(native.int8_matmul(x, lin.weight, lin.scales), _reference(x, lin.dequantize())) < 1e-4


@needs_native
@pytest.mark.parametrize("make", [lambda w: Int4Linear.from_float(w), lambda w: Int8Linear.from_float(w)])
def test_quantized_linears_decode_on_the_native_kernel(make, monkeypatch, fresh_native):
    """A bf16-compute layer's few-row calls take float32 activations to the native kernel: ~100x closer
    to the float result than PyTorch's bf16 kernel, which it replaces."""
    monkeypatch.setenv("TOKENMIND_NATIVE", "1")  # the default on AVX2-only CPUs; asked for on AVX-512 ones
    torch.manual_seed(4)
    lin = make(torch.randn(256, 384))
    ref = _reference(x := torch.randn(2, 384), lin.dequantize(torch.float32))
    native_err = _rel_err(lin(x), ref)
    assert native_err < 1e-4
    lin.__dict__["_native_ok"] = False  # what a machine without the kernels runs
    bf16_err = _rel_err(lin(x), ref)
    assert bf16_err > 10 * native_err


def test_a_broken_compiler_warns_once_and_falls_back(monkeypatch, tmp_path, fresh_native):
    monkeypatch.setenv("TOKENMIND_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "find_compiler", lambda: shutil.which("false"))  # a "compiler" that exits 1
    if not native.usable_cpu():
        pytest.skip("the kernels need an x86-64 CPU with AVX2 and FMA")
    with pytest.warns(UserWarning, match="could not be built") as record:
        assert native.library() is None
    assert "false failed on native_kernels.c" in str(record[0].message)
    assert not list((tmp_path / "native").glob("*"))  # no half-written library left behind


def test_the_default_follows_pytorchs_own_kernels(monkeypatch, fresh_native):
    """Taken by default only where PyTorch runs its AVX2 kernels; TOKENMIND_NATIVE=1 asks for them anywhere."""
    monkeypatch.delenv("TOKENMIND_NATIVE", raising=False)
    for capability, forced, expected in (("AVX512", False, False), ("AVX2", False, True), ("AVX512", True, True)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        if forced:
            monkeypatch.setenv("TOKENMIND_NATIVE", "1")
        native.preferred.cache_clear()
        assert native.preferred() == (expected and native.available())


def test_tokenmind_native_0_turns_the_kernels_off(monkeypatch, fresh_native):
    monkeypatch.setenv("TOKENMIND_NATIVE", "0")
    assert not native.available() and not native.preferred()
    lin = Int4Linear.from_float(torch.randn(64, 64))
    assert not lin._native_ready()
    lin(torch.randn(1, 64))  # PyTorch's kernel runs instead


@needs_native
def test_rms_norm_matches_pytorchs():
    torch.manual_seed(5)
    x, w = torch.randn(3, 5, 576) * 4, torch.randn(576)
    ref = torch.nn.functional.rms_norm(x, (576,), w, 1e-6)
    assert torch.allclose(native.rms_norm(x, w, 1e-6), ref, rtol=1e-6, atol=1e-6)


@needs_native
def test_the_norm_layer_takes_the_native_kernel_only_outside_autograd(monkeypatch, fresh_native):
    from tokenmind.model.transformer import RMSNorm

    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    calls = []
    real = native.rms_norm
    monkeypatch.setattr(native, "rms_norm", lambda *a: calls.append(1) or real(*a))
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(2, 64, requires_grad=True)
    norm(x).sum().backward()  # training: PyTorch's op, which has a backward
    assert not calls and x.grad is not None
    with torch.inference_mode():
        y = norm(x.detach())
    assert calls and torch.allclose(y, torch.nn.functional.rms_norm(x.detach(), (64,), norm.weight.detach(), 1e-5),
                                    rtol=1e-6, atol=1e-6)


@needs_native
@pytest.mark.parametrize("window,first_key", [(None, 0), (5, 0), (None, 2)])
def test_decode_attention_reads_the_paged_pool_in_place(window, first_key):
    """Ragged sequences over shuffled blocks, GQA (3 query heads per key head): equal to softmax attention
    in float64 over the same gathered keys."""
    torch.manual_seed(6)
    blocks, bs, hkv, group, d = 12, 4, 2, 3, 16
    kp, vp = torch.randn(blocks, bs, hkv, d), torch.randn(blocks, bs, hkv, d)
    lens = [7, 1 + first_key, 13]
    tables = torch.randperm(blocks)[:12].view(3, 4)  # each sequence's blocks, in no particular order
    q = torch.randn(3, hkv * group, d)
    out = native.decode_attention(q, kp, vp, tables[:, :4], torch.tensor(lens), first_key, window, 0.25)
    for n, length in enumerate(lens):
        slots = (tables[n, :, None] * bs + torch.arange(bs)).flatten()[:length]
        keys = kp.view(-1, hkv, d)[slots].double()  # (L, Hkv, D)
        vals = vp.view(-1, hkv, d)[slots].double()
        lo = max(first_key, length - window) if window else first_key
        for h in range(hkv * group):
            s = keys[lo:, h // group] @ q[n, h].double() * 0.25
            ref = torch.softmax(s, 0) @ vals[lo:, h // group]
            assert torch.allclose(out[n, h].double(), ref, rtol=1e-5, atol=1e-6), (n, h)


@needs_native
def test_engine_decode_on_native_attention_equals_the_gathered_path(monkeypatch, fresh_native):
    """Greedy decoding of a batch of ragged prompts (blocks of 4, so contexts span several) gives the
    tokens and logprobs of PyTorch's gather + SDPA path."""
    from tokenmind.model import paged_attention
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.transformer import Transformer

    torch.manual_seed(7)
    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    model = Transformer(cfg).eval()
    for block in model.layers:  # module by module: a float model's all-decode steps otherwise take one native call
        block.__dict__["_native_layer"] = None
    calls = []
    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    got = _greedy(model, 12)
    assert calls
    monkeypatch.setattr(paged_attention, "_native_decode_ok", lambda q, cache: False)
    want = _greedy(model, 12)
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(got, want):
        assert tokens_a == tokens_b and lp_a == pytest.approx(lp_b, abs=1e-5)


@needs_native
def test_rotary_matches_the_operator_form_on_a_slice_of_fused_qkv():
    """q and k are a strided slice of the fused projection's output: the kernel reads them in place."""
    from tokenmind.model.rope import apply_rotary

    torch.manual_seed(8)
    qkv = torch.randn(1, 5, 9 + 2 * 3, 64)
    qk = qkv[:, :, :12]
    cos, sin = torch.randn(1, 5, 1, 64), torch.randn(1, 5, 1, 64)
    ref = qk * cos + qk.roll(32, dims=-1) * sin
    got = native.rotary(qk, cos, sin)
    assert got.is_contiguous() and torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    with torch.inference_mode():
        assert torch.equal(apply_rotary(qk, cos, sin), got) == native.preferred()


@needs_native
def test_silu_mul_matches_pytorch_across_the_sigmoids_range():
    torch.manual_seed(9)
    gate_up = torch.cat([torch.linspace(-90, 90, 4096).view(2, 2048), torch.randn(2, 2048)], dim=-1)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert torch.allclose(native.silu_mul(gate_up), ref, rtol=2e-6, atol=1e-7)


@needs_native
def test_the_native_decode_ops_leave_training_to_pytorch(monkeypatch, fresh_native):
    """With gradients on, a Transformer's forward calls no native op (they have no backward) and its loss
    still trains; under inference_mode the same forward calls them and gives the same logits."""
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.transformer import Transformer

    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    calls = []
    for name in ("rms_norm", "rotary", "silu_mul"):
        real = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    torch.manual_seed(10)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Transformer(cfg)
    ids = torch.randint(0, 64, (2, 9))
    logits = model.logits(model.hidden_states(ids))
    logits.float().logsumexp(-1).mean().backward()
    assert not calls and model.layers[0].mlp.gate_up_proj.weight.grad is not None
    with torch.inference_mode():
        again = model.logits(model.hidden_states(ids))
    assert {"rms_norm", "rotary", "silu_mul"} <= set(calls)
    assert torch.allclose(again, logits.detach(), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("scheme", ["int4", "int8", "mixed", "float32"])
def test_a_decode_step_in_one_call_gives_the_modules_result_bit_for_bit(scheme, monkeypatch, fresh_native):
    """An int4, int8, mixed (as GGUF files mix 4- and 8-bit tensors) or float32 Llama-family model decoding
    ragged prompts in a batch (prefill and mixed steps through the modules, all-decode steps through one
    `native.decode_layers` call for all layers) gives exactly the tokens and logprobs of the same steps run
    module by module on the same native kernels (float32: MKL's for the linears, so within rounding)."""
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.quant import quantize_model
    from tokenmind.model.transformer import Block, Transformer

    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    torch.manual_seed(11)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = Transformer(cfg).eval()
    if scheme != "float32":
        model = quantize_model(model, "int8" if scheme == "int8" else "int4", quantize_lm_head=False)
    if scheme == "mixed":
        for block in model.layers:
            block.mlp.down_proj = Int8Linear.from_float(block.mlp.down_proj.dequantize())
    calls = []
    real = native.decode_layers
    monkeypatch.setattr(native, "decode_layers", lambda x, layers, *a: calls.append(len(layers)) or real(x, layers, *a))
    fused = _greedy(model, 10)
    assert len(calls) >= 9 and set(calls) == {3}  # every all-decode step, all layers in its one call
    for block in model.modules():
        if isinstance(block, Block):
            assert block._native_linears() is not None
    model.layers[1].__dict__["_native_layer"] = None  # one block that cannot: the step runs module by module
    calls.clear()
    modules = _greedy(model, 10)
    assert not calls
    if scheme == "float32":  # the modules' linears are MKL's sgemm, the step's f32_matmul: rounding apart
        for (tokens_a, lp_a), (tokens_b, lp_b) in zip(modules, fused):
            assert tokens_a == tokens_b and lp_a == pytest.approx(lp_b, abs=1e-5)
    else:
        assert modules == fused


NATIVE_FAMILIES = {  # decoder shapes the one-call step takes beyond plain Llama
    "mixtral": dict(model_type="mixtral", num_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5),
    "mixtral-int4": dict(model_type="mixtral", num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", qkv_bias=True, num_experts=6, num_experts_per_tok=3,
                      moe_intermediate_size=32, shared_expert_intermediate_size=96, norm_topk_prob=False,
                      mlp_only_layers=[1]),
    "qwen2": dict(model_type="qwen2", qkv_bias=True),
}


@needs_native
@pytest.mark.parametrize("family", sorted(NATIVE_FAMILIES))
def test_mixtures_of_experts_and_qkv_biases_decode_in_one_call(family, monkeypatch, fresh_native):
    """A Mixtral-style mixture (the top k's softmax, a routed scaling factor; float32 or with int4 attention),
    a Qwen2-MoE one (the full softmax's top k, a sigmoid-gated shared expert, a dense layer between) and
    Qwen2's qkv bias decode every all-decode step of a ragged batch in one `native.decode_layers` call,
    with the tokens and logprobs of the same model run module by module (rounding apart: MKL there)."""
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.quant import quantize_model
    from tokenmind.model.transformer import MoE, Transformer

    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    torch.manual_seed(12)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      **NATIVE_FAMILIES[family].copy())
    model = Transformer(cfg).eval()
    model.init_weights(std=0.05)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoE):  # spread the router's scores (no near-ties that rounding could flip)
                module.gate.weight.normal_(0.0, 0.5)
            if getattr(module, "qkv_proj", None) is not None and module.qkv_proj.bias is not None:
                module.qkv_proj.bias.normal_(0.0, 0.5)
    if family.endswith("int4"):
        model = quantize_model(model, "int4", quantize_lm_head=False)
    assert any(isinstance(m, MoE) for m in model.modules()) == ("moe" in family or "mixtral" in family)
    calls = []
    real = native.decode_layers
    monkeypatch.setattr(native, "decode_layers", lambda x, layers, *a: calls.append(len(layers)) or real(x, layers, *a))
    fused = _greedy(model, 10)
    assert len(calls) >= 9 and set(calls) == {3}
    for block in model.layers:
        block.__dict__["_native_layer"] = None
    calls.clear()
    modules = _greedy(model, 10)
    assert not calls
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(modules, fused):
        assert tokens_a == tokens_b and lp_a == pytest.approx(lp_b, abs=1e-5)


@needs_native
def test_routers_the_kernel_cannot_run_keep_the_modules(monkeypatch, fresh_native):
    """DeepSeek-V3's sigmoid scores with a balancing bias and group-limited routing are not the kernel's:
    such a mixture decodes module by module (its attention is latent anyway; here a Mixtral block with
    the router switched, so only the router decides)."""
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.transformer import Transformer

    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, model_type="mixtral", num_experts=4,
                      num_experts_per_tok=2)
    moe = Transformer(cfg).eval().layers[0].mlp
    assert moe._native_mixture() is not None
    moe.gate.sigmoid = True
    assert moe._native_mixture() is None
    moe.gate.sigmoid, moe.gate.method = False, "group_limited_greedy"
    assert moe._native_mixture() is None
    moe.gate.method = "greedy"
    moe.experts.gate_up_proj.data = moe.experts.gate_up_proj.data.transpose(1, 2).contiguous().transpose(1, 2)
    assert moe._native_mixture() is None  # not contiguous: the kernel reads rows in place


@needs_native
def test_a_linear_replaced_after_decoding_is_seen(monkeypatch, fresh_native):
    """A block that decoded natively and then had a linear swapped (as adapters are wrapped around them)
    takes the module path with the new linear, not the cached int4 one."""
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.quant import quantize_model
    from tokenmind.model.transformer import Transformer

    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    block = quantize_model(Transformer(cfg).eval(), "int4").layers[0]
    assert block._native_linears() is not None
    block.self_attn.o_proj = plain = torch.nn.Linear(64, 64, bias=False)  # a float32 linear: still native
    assert block._native_linears()[1] is plain
    block.self_attn.o_proj = torch.nn.Linear(64, 64, bias=True)  # a bias the kernel does not add
    assert block._native_linears() is None


def test_the_native_checks_leave_a_compiled_forward_in_one_graph(monkeypatch, fresh_native):
    """`train.compile` traces the model: the native ops' checks must not break its graph (they answer
    no while tracing), with or without the kernels."""
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.transformer import Transformer

    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    torch._dynamo.reset()
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = Transformer(cfg)
    explained = torch._dynamo.explain(model.hidden_states)(torch.randint(0, 64, (2, 8)))
    assert explained.graph_break_count == 0, explained.break_reasons


@needs_native
@pytest.mark.parametrize("block_rows", [32, 64])
def test_native_dequantize_equals_the_float64_reference_bit_for_bit(block_rows, monkeypatch):
    """The prefill path's dequantized weight: native (one fused multiply-add) and PyTorch in float64 agree exactly."""
    torch.manual_seed(4)
    codes = torch.randint(0, 16, (128, 192), dtype=torch.uint8)
    scales, zeros = torch.rand(128, 3) / 10 + 0.01, torch.randn(128, 3) / 10
    lin = Int4Linear.from_codes(codes, scales.bfloat16(), zeros.bfloat16(), 64)
    packed = _pack_int4(codes, block_rows)
    fast = native.int4_dequantize(packed, lin.scales_and_zeros, block_rows, 64)
    s64, z64 = (t.bfloat16().double().repeat_interleave(64, 1) for t in (scales, zeros))
    assert torch.equal(fast, ((codes.double() - 8) * s64 + z64).float())
    monkeypatch.setattr(lin, "_native_ready", lambda: False)  # the module's own PyTorch path, for this machine's packing
    slow = lin.dequantize()
    monkeypatch.undo()
    assert torch.equal(slow, native.int4_dequantize(lin.weight, lin.scales_and_zeros, int4_block_rows(), 64))


@needs_native
def test_the_native_int8_kernel_takes_up_to_256_rows_and_an_override_wins(monkeypatch, fresh_native):
    """Native int8 beats dequantize + F.linear well past PyTorch's kernel's 32 rows (a batch of 64 sequences'
    LM head: 50 ms against 173 on SmolLM2), so it takes them; `kernel_max_rows` set on a layer still rules."""
    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    torch.manual_seed(5)
    lin = Int8Linear.from_float(torch.randn(96, 64))
    calls = []
    real = native.int8_matmul
    monkeypatch.setattr(native, "int8_matmul", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(64, 64)
    with torch.inference_mode():
        y = lin(x)
        assert calls == [64] and lin.kernel_max_rows == 256
        lin(torch.randn(257, 64))
        assert calls == [64]  # more rows: the dequantized path
        lin.kernel_max_rows = 0
        assert torch.allclose(lin(x), y, rtol=1e-3, atol=1e-3) and calls == [64]


@needs_native
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_f32_matmul_matches_a_float64_product(rows):
    torch.manual_seed(6)
    w = torch.randn(1003, 200)  # a partial group of four rows; K a multiple of 8, not of 32
    x = torch.randn(rows, 200)
    assert _rel_err(native.f32_matmul(x, w), _reference(x, w)) < 1e-6


@needs_native
def test_a_float_models_output_layer_takes_f32_matmul_for_the_engines_few_rows_only(monkeypatch, fresh_native):
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.transformer import Transformer

    monkeypatch.setenv("TOKENMIND_NATIVE", "1")
    cfg = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Transformer(cfg).eval()
    calls = []
    real = native.f32_matmul
    monkeypatch.setattr(native, "f32_matmul", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    few, many = torch.randn(5, 64), torch.randn(native.F32_MAX_ROWS + 1, 64)
    with torch.inference_mode():
        assert torch.allclose(model.decode_logits(few), model.lm_head(few), rtol=1e-5, atol=1e-5)
        model.decode_logits(many)
        model.logits(few)  # evaluations: the same kernel for any number of rows
    assert calls == [5]
    model.decode_logits(few).sum().backward()  # training: autograd's own matmul, with a gradient for the head
    assert calls == [5] and model.lm_head.weight.grad is not None
