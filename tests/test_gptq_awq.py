"""Calibrated int4 quantization (tokenmind.model.gptq, .awq, .calibrate): GPTQ and AWQ beat
round-to-nearest where they should, reduce to it where they should, AWQ's folding is exact in
float, and their models save, load back and generate through the one loader and the CLI."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from test_eval_fixtures import config
from test_serve_fixtures import byte_tokenizer
from test_train_helpers import one_thread  # noqa: F401 (autouse fixture)

from tokenmind.cli import main
from tokenmind.model.awq import _rules, awq_search_scales, fake_quantize_int4, fold_scales, output_error, quantize_awq
from tokenmind.model.calibrate import LinearStats, calibration_ids
from tokenmind.model.checkpoint import save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.gptq import gptq_quantize_weight, quantize_gptq
from tokenmind.model.load import load_model, quantize_pretrained
from tokenmind.model.quant import Int4Linear, quantize_model
from tokenmind.model.transformer import Transformer



def correlated_inputs(rows: int, cols: int, seed: int = 0, outliers: int = 0) -> torch.Tensor:
    """Calibration-like activations: correlated channels (so XᵀX is far from diagonal), and a few
    channels `outliers` with ~30x the magnitude of the rest, as LLM activations have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) @ (torch.eye(cols) + 0.3 * torch.randn(cols, cols, generator=g))
    x[:, :outliers] *= 30
    return x


def stats_of(x: torch.Tensor) -> LinearStats:
    st = LinearStats.empty(x.shape[1])
    st.add(x)
    return st


@pytest.mark.parametrize("in_f,group_size,act_order", [(128, 32, False), (128, 32, True), (96, 64, False)])
def test_gptq_beats_round_to_nearest_on_the_calibration_output_error(in_f, group_size, act_order):
    w = torch.randn(64, in_f, generator=torch.Generator().manual_seed(1))
    x = correlated_inputs(1024, in_f)
    xtx = stats_of(x).mean_xtx
    rtn = Int4Linear.from_float(w, group_size=group_size, compute_dtype=torch.float32)
    codes, s, z = gptq_quantize_weight(w, xtx, group_size, act_order=act_order, compute_dtype=torch.float32)
    gptq = Int4Linear.from_codes(codes, s, z, group_size, in_features=in_f)
    err_rtn, err_gptq = output_error(w, rtn.dequantize(), xtx), output_error(w, gptq.dequantize(), xtx)
    assert err_gptq < 0.6 * err_rtn, (err_gptq, err_rtn)
    # the same grid layout as RTN, so the kernel runs it: its output is X·Ŵᵀ for the dequantized Ŵ
    torch.testing.assert_close(gptq(x[:8]), x[:8] @ gptq.dequantize().t(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("in_f,group_size,dtype", [(128, 32, torch.float32), (80, 64, torch.bfloat16)])
def test_gptq_with_an_identity_hessian_is_round_to_nearest(in_f, group_size, dtype):
    """No correlation between inputs → no error moves to other columns → each weight rounds on its own."""
    w = torch.randn(48, in_f, generator=torch.Generator().manual_seed(2))
    codes, s, z = gptq_quantize_weight(w, torch.eye(in_f), group_size, compute_dtype=dtype)
    rtn = Int4Linear.from_float(w, group_size=group_size, compute_dtype=dtype)
    assert torch.equal(codes[:, :in_f], rtn.codes()[:, :in_f])
    assert torch.equal(torch.stack([s.t(), z.t()], dim=-1), rtn.scales_and_zeros)


def test_awq_search_runs_what_rtn_runs_and_beats_it_on_outlier_channels():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    x = correlated_inputs(1024, 128, outliers=4)
    st = stats_of(x)
    # the search scores exactly the weight Int4Linear would run
    assert torch.equal(fake_quantize_int4(w, 32), Int4Linear.from_float(w, group_size=32).dequantize())
    s, alpha = awq_search_scales(w, st, 32)
    err_rtn = output_error(w, fake_quantize_int4(w, 32), st.mean_xtx)
    err_awq = output_error(w, fake_quantize_int4(w * s, 32) / s, st.mean_xtx)
    assert alpha > 0 and err_awq < 0.7 * err_rtn, (alpha, err_awq, err_rtn)
    assert s[:4].min() > s[4:].max()  # the outlier channels are the ones scaled up


def tiny(**overrides) -> Transformer:
    cfg = ModelConfig(**{**dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), **overrides})
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    model.init_weights(std=0.2)
    if cfg.qkv_bias:
        for layer in model.layers:
            layer.self_attn.qkv_proj.bias.data.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("overrides", [dict(qkv_bias=True, tie_word_embeddings=True),
                                       dict(model_type="gemma2", head_dim=8, query_pre_attn_scalar=8)],
                         ids=["llama-qwen", "gemma-sandwich"])
def test_awq_scale_folding_leaves_the_float_model_unchanged(overrides):
    """Every fold AWQ makes (norms, v rows under GQA, up rows, the final norm for a tied head) is exact in float."""
    model = tiny(**overrides)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids)
        folded, g = copy.deepcopy(model), torch.Generator().manual_seed(1)
        for scope in [*folded.layers, folded]:
            for name in _rules(scope):
                s = torch.rand(scope.get_submodule(name).in_features, generator=g) * 4 + 0.25
                if name == "self_attn.o_proj":  # one scale per kv channel, shared by its 2 query heads
                    s = s.view(2, 2, -1)[:, :1].expand(-1, 2, -1).reshape(-1)
                fold_scales(scope, name, s)
        got = folded(ids)
    assert len(_rules(folded.layers[0])) == 4
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.equal(folded.layers[0].input_layernorm.weight, model.layers[0].input_layernorm.weight)
    assert torch.equal(folded.embed_tokens.weight, model.embed_tokens.weight)  # the tied head got its own copy


def test_awq_refuses_o_proj_scales_that_differ_within_a_kv_group():
    model = tiny()
    with pytest.raises(ValueError, match="equal across the query heads"):
        fold_scales(model.layers[0], "self_attn.o_proj", torch.rand(32) + 1)


def test_calibrated_models_run_int4_layers_and_match_or_beat_rtn_on_their_calibration_text():
    """Random weights have no outlier channels, so AWQ gains little here, but it never loses much
    (α = 0 is RTN; with a grid of one α it *is* RTN), and GPTQ gains on its calibration tokens."""
    model = tiny(hidden_size=64, intermediate_size=128)
    calib = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(calib)

        def error(q):
            return float((q(calib) - want).norm() / want.norm())

        rtn = error(quantize_model(copy.deepcopy(model), "int4", group_size=32))
        for quantize, source, bound in [(quantize_gptq, "gptq", 0.9), (quantize_awq, "awq", 1.05)]:
            q = quantize(copy.deepcopy(model), calib, group_size=32)
            int4 = [m for m in q.modules() if isinstance(m, Int4Linear)]
            assert len(int4) == 4 * 2 + 1 and {m.source for m in int4} == {source}
            assert not any(isinstance(m, torch.nn.Linear) for m in q.modules())
            assert error(q) < bound * rtn, (source, error(q), rtn)
        assert error(quantize_awq(copy.deepcopy(model), calib, group_size=32, grid=1)) == rtn


def test_calibration_text_too_short_names_the_fix():
    with pytest.raises(ValueError, match="fewer than the 2,048 asked for"):
        calibration_ids(["a short text"], byte_tokenizer(), num_sequences=8, seq_len=256)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = Transformer(config(vocab=272, hidden=64, context=256)).eval()
    model.init_weights(std=0.3)
    return save_hf_dir(model, tmp_path_factory.mktemp("models") / "float", tokenizer=byte_tokenizer())


@pytest.mark.parametrize("method,group_size", [("gptq", 32), ("awq", 64), ("int4", 128)])
def test_a_quantized_model_saves_and_loads_back_as_it_ran(tiny_dir, tmp_path, method, group_size):
    """The one loader reads back exactly the int4 codes, scales and zeros that ran before saving
    (group 128 over 64 inputs: padded groups)."""
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    pretrained = quantize_pretrained(load_model(tiny_dir), method, group_size=group_size, calibration=text,
                                     num_sequences=4, seq_len=64)
    out = save_hf_dir(pretrained.model, tmp_path / "q", tokenizer=pretrained.tokenizer)
    loaded = load_model(out)
    assert loaded.quantization == "int4"
    before = {n: m for n, m in pretrained.model.named_modules() if isinstance(m, Int4Linear)}
    after = {n: m for n, m in loaded.model.named_modules() if isinstance(m, Int4Linear)}
    assert before.keys() == after.keys() and len(after) == 4 * 2 + 1
    for name, m in after.items():
        k = m.in_features  # the padding columns' codes never matter (their inputs are zero)
        assert m.group_size == group_size and torch.equal(m.codes()[:, :k], before[name].codes()[:, :k])
        assert torch.equal(m.scales_and_zeros, before[name].scales_and_zeros)
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), pretrained.model(ids))
    with pytest.raises(ValueError, match="stores its linears in int4"):
        load_model(out, quantize="int8")


def test_cli_converts_with_gptq_and_generates_with_the_result(tiny_dir, tmp_path, capsys):
    text = tmp_path / "calib.jsonl"
    text.write_text("".join(f'{{"text": "Sentence number {i} of the calibration text."}}\n' for i in range(60)))
    out = tmp_path / "gptq"
    assert main(["convert", "--model", str(tiny_dir), "--quantize", "gptq", "--calibration", str(text),
                 "--calibration-samples", "4", "--calibration-seq-len", "64", "--out", str(out)]) == 0
    assert "wrote int4 model directory" in capsys.readouterr().out
    assert main(["generate", "--model", str(out), "--max-tokens", "8", "--stats", "abc"]) == 0
    err = capsys.readouterr().err
    assert "params, int4)" in err and re.search(r"\[[1-8] tokens in .*finish: (length|stop)", err)  # a random model may stop
    assert main(["convert", "--model", str(tiny_dir), "--quantize", "awq", "--out", str(tmp_path / "x")]) == 2
    assert "needs calibration text" in capsys.readouterr().err
