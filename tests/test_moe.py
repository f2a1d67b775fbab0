"""Mixture of experts beyond logit parity (that is in test_model_parity.py): the load-balancing loss
against transformers', training through the objective seam, HF round trips and the paged engine."""

import pytest
import torch
import transformers
from test_engine_llm import assert_batched_greedy_equals_naive

from tokenmind.data.loader import TokenBatch
from tokenmind.model.checkpoint import load_hf_dir, save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import (
    MoE,
    Transformer,
    balance_experts,
    load_balancing_loss,
    router_aux_loss,
    router_z_loss,
)
from tokenmind.train.objectives import NextTokenObjective

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
           rope_interleave=True, moe_intermediate_size=24, n_shared_experts=1)
DEEPSEEK_V3 = dict(MLA, topk_method="noaux_tc", scoring_func="sigmoid", n_group=2, topk_group=1,
                   routed_scaling_factor=2.5)


def tiny_moe(model_type="mixtral", seed=0, **extra) -> Transformer:
    cfg = ModelConfig(**{**TINY, "model_type": model_type, "num_experts": 4, "num_experts_per_tok": 2, **extra})
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights(std=0.3)
    return model.eval()


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_load_balancing_loss_equals_transformers(top_k):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(top_k)
    layers = tuple(torch.randn(40, 6, generator=g) * 2 for _ in range(3))
    want = load_balancing_loss_func(layers, num_experts=6, top_k=top_k)
    torch.testing.assert_close(load_balancing_loss(torch.cat(layers), top_k), want)
    even = torch.zeros(60, 6)  # every expert equally likely: the loss is its minimum, k (ties pick evenly here)
    even[torch.arange(60), torch.arange(60) % 6] = 1e-3
    assert abs(float(load_balancing_loss(even, 1)) - 1.0) < 1e-3


def test_moe_trains_through_the_objective_and_the_aux_loss_spreads_a_crowded_router():
    model = tiny_moe(router_aux_loss_coef=0.5)
    with torch.no_grad():  # every token's hidden state gets a large first component that experts 0 and 1 favour
        model.embed_tokens.weight[:, 0] = 5.0
        for layer in model.layers:
            layer.mlp.gate.weight.zero_()
            layer.mlp.gate.weight[:2, 0] = 1.5
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (4, 17), generator=g)
    batch = TokenBatch(ids[:, :-1], ids[:, 1:], torch.zeros(4, 16, dtype=torch.long),
                       torch.arange(16).expand(4, 16))
    objective = NextTokenObjective()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    history = []
    for _ in range(40):
        terms = objective(model, batch, "fp32")
        assert set(terms.metrics) == {"router_aux"}
        n = int(terms.count)  # loss = cross-entropy sum + coef · aux · n; the metric holds coef · aux · n
        history.append(((float(terms.loss.detach()) - float(terms.metrics["router_aux"])) / n,
                        float(terms.metrics["router_aux"]) / n / 0.5))
        opt.zero_grad()
        (terms.loss / terms.count).backward()
        assert model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router learns
        assert model.layers[0].mlp.experts.down_proj.grad.abs().sum() > 0
        opt.step()
    (ce0, aux0), (ce1, aux1) = history[0], history[-1]
    assert aux0 > 3.0  # crowded: two of 4 experts take every token, E · Σ f·P ≈ 4 (even load: k = 2)
    assert aux1 < aux0 * 0.7 and ce1 < ce0  # spread out, and the model learned the batch
    model.eval()
    model(ids)
    assert router_aux_loss(model) is None  # nothing is kept outside training


def test_no_aux_loss_without_a_coefficient_and_dense_models_are_untouched():
    model = tiny_moe().train()  # router_aux_loss_coef 0
    model(torch.randint(0, 64, (2, 5)))
    assert all(m.router_logits is None for m in model.modules() if isinstance(m, MoE))
    assert router_aux_loss(model) is None


@pytest.mark.parametrize("model_type,extra", [
    ("mixtral", {}),
    ("qwen2_moe", dict(qkv_bias=True, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       norm_topk_prob=False, mlp_only_layers=[0])),
    ("qwen3_moe", dict(qk_norm=True, moe_intermediate_size=24, decoder_sparse_step=2)),
    ("olmoe", dict(qk_norm=True, qk_norm_per_head=False, clip_qkv=1.0, norm_topk_prob=False)),
    ("deepseek_v2", dict(MLA, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1)),
    ("deepseek_v3", DEEPSEEK_V3),
])
def test_hf_round_trip_loads_in_transformers_and_back_with_equal_logits(tmp_path, model_type, extra):
    model = tiny_moe(model_type, **extra)
    save_hf_dir(model, tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    back = load_hf_dir(tmp_path / "m")
    assert back.cfg.num_experts == 4 and back.cfg.is_moe_layer(0) == model.cfg.is_moe_layer(0)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
        torch.testing.assert_close(hf(ids).logits, want, atol=1e-4, rtol=0)
        torch.testing.assert_close(back(ids), want, atol=0, rtol=0)


@pytest.mark.parametrize("model_type,extra", [
    ("qwen2_moe", dict(moe_intermediate_size=24, shared_expert_intermediate_size=40)),
    ("olmoe", dict(qk_norm=True, qk_norm_per_head=False, clip_qkv=1.0)),
    ("deepseek_v2", dict(MLA, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=2, topk_group=1)),
    ("deepseek_v3", DEEPSEEK_V3),  # latent attention: the pool holds latents, decode absorbs kv_b_proj
])
def test_the_paged_engine_decodes_a_moe_model_batched_as_it_does_alone(model_type, extra):
    assert_batched_greedy_equals_naive(tiny_moe(model_type, **extra))


def test_one_token_runs_its_experts_directly_with_the_grouped_result():
    experts = tiny_moe(num_experts=6, num_experts_per_tok=3).layers[0].mlp.experts
    g = torch.Generator().manual_seed(4)
    x, weight = torch.randn(5, 32, generator=g), torch.rand(5, 3, generator=g)
    expert = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(5)])
    with torch.no_grad():
        grouped = experts(x, expert, weight)  # 5 tokens: sorted by expert
        alone = torch.cat([experts(x[i:i + 1], expert[i:i + 1], weight[i:i + 1]) for i in range(5)])
    torch.testing.assert_close(alone, grouped, atol=1e-5, rtol=0)  # fp32 rounding: outputs are O(1)


def test_active_parameters_count_only_the_chosen_experts():
    from tokenmind.train.metrics import flops_per_token

    model = tiny_moe(num_experts=8, num_experts_per_tok=2)
    cfg = model.cfg
    assert cfg.num_parameters == sum(p.numel() for p in model.parameters())
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert cfg.num_active_parameters == cfg.num_parameters - 2 * 6 * expert  # 2 MoE layers, 6 idle experts each
    dense = ModelConfig(**{**TINY, "intermediate_size": 2 * cfg.moe_intermediate_size})  # same active MLP width
    extra = 2 * (cfg.hidden_size * 8)  # the routers
    assert flops_per_token(cfg, 16) - flops_per_token(dense, 16) == 6 * extra


def test_router_z_loss_equals_switch_transformers_and_shrinks_the_router_logits():
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    logits = torch.randn(3, 10, 4, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(router_z_loss(logits.flatten(0, 1)), router_z_loss_func(logits))
    model = tiny_moe(router_z_loss_coef=1.0).train()  # z-loss only: no load-balancing term
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.gate.weight.mul_(20)  # large router logits
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")], lr=1e-3)
    losses = []
    for _ in range(8):
        model(ids)
        loss = router_aux_loss(model)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.85 * losses[0]
    assert ModelConfig.from_hf(model.cfg.to_hf()).router_z_loss_coef == 1.0  # kept in config.json


def test_aux_loss_free_balancing_spreads_a_crowded_router_without_touching_the_weights():
    """DeepSeek-V3's bias only steers which experts are chosen: with every token crowding onto
    experts 0 and 1, stepping the bias by γ·sign(mean load − load) after each batch evens the load
    out, while each chosen expert's weight stays its raw sigmoid score."""
    model = tiny_moe("deepseek_v3", **{**DEEPSEEK_V3, "n_group": 1, "router_bias_update_rate": 0.01})
    with torch.no_grad():
        model.embed_tokens.weight[:, 0] = 5.0
        for layer in model.layers:  # tokens' scores differ, but all prefer experts 0 and 1
            layer.mlp.gate.weight[:2, 0] = 0.5
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    imbalance = []
    for _ in range(60):
        with torch.no_grad():
            model(ids)
        loads = balance_experts(model)
        assert all(abs(float(load.sum()) - 1.0) < 1e-6 for load in loads)  # shares of the routed pairs
        imbalance.append(max(float(load.max()) * 4 for load in loads))
    assert imbalance[0] > 1.85  # two of 4 experts take (nearly) every token: twice the even share
    assert sum(imbalance[-10:]) / 10 < 1.3
    router = model.layers[0].mlp.gate
    bias = router.e_score_correction_bias
    assert bias[:2].max() < 0 and bias[:2].mean() < bias[2:].mean()  # the crowded experts were pushed down
    x = torch.randn(5, 32)
    weight, expert = router.route(router(x))
    want = torch.sigmoid(router(x)).gather(1, expert)
    torch.testing.assert_close(weight, want / want.sum(-1, keepdim=True) * 2.5)
    assert all(float(m.expert_load.sum()) == 0 for m in model.modules() if isinstance(m, MoE))  # read and reset


def test_a_deepseek_v3_model_pretrains_with_expert_load_logged_and_plotted(tmp_path):
    from test_train_helpers import tiny_config, write_shards

    torch.set_num_threads(1)  # tiny models: one intra-op thread (see test_train_helpers.one_thread)
    from tokenmind.jsonl import read_jsonl
    from tokenmind.train import pretrain

    moe = ["--model.model_type=deepseek_v3", "--model.num_experts=4", "--model.num_experts_per_tok=2",
           "--model.moe_intermediate_size=32", "--model.n_shared_experts=1", "--model.first_k_dense_replace=1",
           "--model.topk_method=noaux_tc", "--model.scoring_func=sigmoid", "--model.router_bias_update_rate=0.01",
           "--model.num_key_value_heads=4", "--model.kv_lora_rank=16", "--model.q_lora_rank=24",
           "--model.qk_nope_head_dim=16", "--model.qk_rope_head_dim=8", "--model.v_head_dim=16", "--train.steps=40"]
    result = pretrain(tiny_config(write_shards(tmp_path / "shards"), tmp_path / "run", *moe))
    assert result.losses[-1] < result.losses[0] - 0.5
    records = [r for r in read_jsonl(result.metrics_path) if "expert_load" in r]
    assert records and all(len(r["expert_load"]) == 1 and len(r["expert_load"][0]) == 4 for r in records)
    assert all(r["expert_load_max"] >= 1.0 for r in records)
    assert (tmp_path / "run" / "expert_load.png").stat().st_size > 10_000
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.final_model_path)
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0  # the balancing bias was trained and exported
    back = load_hf_dir(result.final_model_path).eval()
    ids = torch.randint(0, back.cfg.vocab_size, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, back(ids), atol=1e-4, rtol=0)
def test_a_config_saved_by_transformers_5_keeps_its_expert_count():
    saved = [transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2),  # saved as num_local_experts
             transformers.Qwen2MoeConfig(num_experts=6), transformers.MixtralConfig(num_local_experts=5)]
    assert [ModelConfig.from_hf(c.to_dict()).num_experts for c in saved] == [4, 6, 5]
