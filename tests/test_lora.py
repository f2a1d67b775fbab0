"""LoRA on the Transformer against the `peft` library on the same `transformers` model and weights."""

import json

import peft
import pytest
import torch

from test_model_parity import make_pair

from tokenmind.model.lora import (
    LoRAConfig,
    LoRALinear,
    add_lora,
    adapter_parameters,
    adapter_state,
    load_adapter,
    lora_layers,
    merge_lora,
    routing_of,
    save_adapter,
)
from tokenmind.model.quant import quantize_model

TOL = 1e-4


def randomize_adapters(model, seed=1):
    """Non-zero B matrices, so the adapters really change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def ids(cfg, seed=0):
    return torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["k_proj", "o_proj", "up_proj", "down_proj"],
                                     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]])
def test_saved_adapter_loads_in_peft_with_equal_logits(tmp_path, targets):
    cfg, hf, ours = make_pair("llama-gqa")
    add_lora(ours, LoRAConfig(rank=4, alpha=8, targets=targets))
    randomize_adapters(ours)
    save_adapter(ours, tmp_path / "adapter", base_model="tiny")
    x = ids(cfg)
    with torch.no_grad():
        expected = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(x).logits
        got = ours.eval()(x)
    assert (got - expected).abs().max() < TOL
    base = make_pair("llama-gqa")[1](x).logits  # the adapter really moved the logits
    assert (got - base).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["llama-gqa", "qwen2-bias"])
def test_training_gradients_equal_peft(tmp_path, case):
    """The adapter's gradients (through the fused frozen-base + LoRA node, `_FrozenLinearWithLoRA`)
    equal PEFT's on the unfused transformers model: every slice's A and B, and through the
    input gradients of the blocks above, the lower blocks' too."""
    cfg, hf, ours = make_pair(case)
    add_lora(ours, LoRAConfig(rank=4, alpha=8, targets=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]))
    randomize_adapters(ours)
    save_adapter(ours, tmp_path / "adapter", base_model="tiny")
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True).train()
    x, g = ids(cfg), torch.Generator().manual_seed(3)
    probe = torch.randn(*x.shape, cfg.vocab_size, generator=g)
    (ours.train()(x) * probe).sum().backward()
    (reference(x).logits * probe).sum().backward()
    theirs = {n.replace(".default.weight", ".weight"): p.grad
              for n, p in reference.named_parameters() if p.requires_grad}
    mine = {n: p.grad for n, p in adapter_parameters(ours).items()}
    assert sorted(mine) == sorted(theirs)
    for name, grad in mine.items():
        torch.testing.assert_close(grad, theirs[name], atol=1e-4, rtol=1e-4, msg=name)


def test_q_and_v_alone_leave_k_untouched():
    _, _, ours = make_pair("llama-gqa")
    add_lora(ours, LoRAConfig(rank=2, targets=["q_proj", "v_proj"]))
    layer = ours.layers[0].self_attn.qkv_proj
    assert isinstance(layer, LoRALinear) and sorted(layer.adapters["default"].lora_A) == ["q_proj", "v_proj"]
    assert not isinstance(ours.layers[0].mlp.gate_up_proj, LoRALinear)
    trainable = sorted(n for n, p in ours.named_parameters() if p.requires_grad)
    assert trainable and all(".adapters.default.lora_" in n for n in trainable)
    assert len(trainable) == 2 * 2 * len(ours.layers)  # A and B for q and v in every block


def test_peft_adapter_loads_here_with_equal_logits(tmp_path):
    cfg, hf, ours = make_pair("llama-mqa-bias")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                             use_rslora=True)
    model = peft.get_peft_model(hf, config)
    randomize_adapters(model)
    model.save_pretrained(tmp_path / "from-peft")
    load_adapter(ours, tmp_path / "from-peft")
    x = ids(cfg, seed=3)
    with torch.no_grad():
        assert (ours.eval()(x) - model.eval()(x).logits).abs().max() < TOL


def test_merge_equals_adapter_and_unwraps(tmp_path):
    cfg, _, ours = make_pair("llama-mha-tied")
    add_lora(ours, LoRAConfig(rank=4))
    randomize_adapters(ours)
    x = ids(cfg)
    with torch.no_grad():
        unmerged = ours.eval()(x)
        merge_lora(ours)
        merged = ours(x)
    assert not lora_layers(ours)
    assert (merged - unmerged).abs().max() < TOL


def test_routing_runs_two_adapters_in_one_batch_like_each_alone():
    cfg, _, ours = make_pair("llama-gqa")
    add_lora(ours, LoRAConfig(rank=4, targets=["q_proj", "v_proj", "down_proj"]), name="a", seed=1)
    add_lora(ours, LoRAConfig(rank=2, targets=["o_proj", "up_proj"]), name="b", seed=2)
    randomize_adapters(ours)
    routing, x = routing_of(ours), ids(cfg)
    alone = {}
    with torch.no_grad():
        for name in ("a", "b", None):
            routing.active = name
            alone[name] = ours.eval()(x)
        routing.set_rows(["a"] * 9 + ["b"] * 9)  # batch row 0 → a, batch row 1 → b
        mixed = ours(x.reshape(1, -1).reshape(2, 9))
    assert (mixed[0] - alone["a"][0]).abs().max() < TOL
    assert (mixed[1] - alone["b"][1]).abs().max() < TOL
    assert (alone["a"] - alone[None]).abs().max() > 1e-2


def test_qlora_base_stays_quantized_and_frozen_while_the_adapter_learns():
    cfg, _, ours = make_pair("llama-gqa")
    quantize_model(ours, "int8")
    add_lora(ours, LoRAConfig(rank=4))
    trainable = [p for p in ours.parameters() if p.requires_grad]
    frozen_before = {k: v.clone() for k, v in ours.state_dict().items() if "adapters" not in k}
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    x = ids(cfg)
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(ours.train()(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in frozen_before.items())
    assert any(p.abs().sum() > 0 for n, p in ours.named_parameters() if "lora_B" in n)
    with pytest.raises(ValueError, match="quantized"):
        merge_lora(ours)


def test_bad_adapters_are_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="not adaptable"):
        LoRAConfig(targets=["embed_tokens"])
    cfg, _, ours = make_pair("llama-gqa")
    add_lora(ours, LoRAConfig(rank=4, targets=["q_proj"]))
    save_adapter(ours, tmp_path / "a", base_model="tiny")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        load_adapter(make_pair("llama-gqa")[2], tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(ValueError, match="shape"):
        load_adapter(make_pair("llama-gqa")[2], tmp_path / "a")
    assert set(adapter_state(ours)) == {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{m}.weight"
                                        for i in range(2) for m in "AB"}


def test_engine_mixes_adapters_in_one_batch_like_each_merged_model_alone():
    import copy

    from test_engine_llm import naive_greedy, run, tiny_model

    from tokenmind.engine.config import EngineConfig
    from tokenmind.engine.llm import Engine
    from tokenmind.engine.sampling import SamplingParams

    model = tiny_model()
    add_lora(model, LoRAConfig(rank=4, targets=["q_proj", "v_proj", "down_proj"]), name="a", seed=1)
    add_lora(model, LoRAConfig(rank=4, targets=["o_proj", "gate_proj"]), name="b", seed=2)
    randomize_adapters(model, seed=5)
    with torch.no_grad():  # big enough updates that the adapters change greedy choices
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    routing_of(model).active = None
    merged = {name: merge_lora(copy.deepcopy(model), name) for name in ("a", "b")}
    routing_of(model).active = None
    engine = Engine(model, config=EngineConfig(block_size=4, enable_prefix_caching=True))
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], SamplingParams(max_tokens=12, temperature=0)
    rids = {adapter: engine.add_request(prompt, params, adapter=adapter) for adapter in ("a", None, "b")}
    finals = run(engine)[0]
    base = copy.deepcopy(model)
    routing_of(base).active = None
    want = {"a": naive_greedy(merged["a"], prompt, 12), "b": naive_greedy(merged["b"], prompt, 12),
            None: naive_greedy(base, prompt, 12)}
    for adapter, rid in rids.items():
        assert finals[rid].token_ids == want[adapter], adapter
    assert len({tuple(v) for v in want.values()}) == 3  # the adapters really differ
    # the same prompt again under adapter b: its cached blocks are b's, never a's (cached first) or the base's
    again = engine.add_request(prompt, params, adapter="b")
    assert run(engine)[0][again].token_ids == want["b"]
    assert engine.block_manager.prefix_hit_rate > 0
    with pytest.raises(ValueError, match="unknown LoRA adapter 'c'"):
        engine.add_request(prompt, params, adapter="c")
