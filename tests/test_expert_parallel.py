"""Expert parallelism on CPU: 2 gloo processes, each holding 2 of a mixture's 4 experts and feeding
its own rows, equal one process holding all 4 on the whole batch: logits, loss, gradients,
gradient norm and the gathered state, then a training run's loss curve and its checkpoint.

The workers save what they computed; the single-process references and the comparisons run in
the test process (as in test_train_distributed.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from test_train_distributed import free_port, gloo_rank, losses
from test_train_helpers import crash_then_resume, one_thread, tiny_config, write_shards  # noqa: F401 (one_thread: autouse)

from tokenmind.jsonl import read_jsonl
from tokenmind.model.checkpoint import load_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.train import pretrain
from tokenmind.train.checkpoint import load_checkpoint_weights
from tokenmind.train.distributed import DistContext, clip_grad_norm, model_state, wrap_model
from tokenmind.train.expert_parallel import shard_experts, sharded_parameters

TINY = dict(model_type="mixtral", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
            num_experts_per_tok=2)
MOE = ["--model.model_type=mixtral", "--model.num_experts=4", "--model.num_experts_per_tok=2",
       "--train.steps=4", "--train.checkpoint_every=2"]
WORLD = 2


def moe_model() -> Transformer:
    """4 experts, top 2; layer 0's router never picks expert 3 (owned by rank 1), so one rank's
    expert receives no rows from anyone while the other experts get uneven shares."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**TINY))
    model.init_weights(std=0.3)
    with torch.no_grad():
        model.embed_tokens.weight[:, 0] = 5.0  # a large first feature in every token's hidden state
        model.layers[0].mlp.gate.weight[3, 0] = -20.0
    return model


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 13), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def worker(rank: int, port: int, shards: Path, root: Path) -> None:
    """Each rank: join the group the way torchrun would; one forward and backward; training runs."""
    with gloo_rank(rank, WORLD, port):
        forward_backward(rank, root)
        train_runs(shards, root)


def forward_backward(rank: int, root: Path) -> None:
    """This rank's half of the batch through the sharded model, backward, the gradients scaled as
    the trainer scales them (divided by the per-rank mean of the global batch's target count)."""
    ctx = DistContext("ep", torch.device("cpu"), rank, WORLD)
    with pytest.raises(ValueError, match="num_experts divisible by 2, got 3"):
        shard_experts(Transformer(ModelConfig(**{**TINY, "num_experts": 3})), dist.group.WORLD)
    model = moe_model()
    wrapped = wrap_model(model, ctx)
    inputs, targets = (t[2 * rank:2 * rank + 2] for t in batch())
    logits = wrapped(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    per_rank = batch()[1].numel() / WORLD
    for p in model.parameters():
        p.grad /= per_rank
    sharded = [p for name, p in model.named_parameters() if name in sharded_parameters(model)]
    torch.save({"logits": logits.detach(), "loss": loss.detach(),
                "grads": {name: p.grad for name, p in model.named_parameters()},
                "norm": clip_grad_norm(list(model.parameters()), 0.0, sharded),
                "state": model_state(model, ctx)}, root / f"rank{rank}.pt")


def train_runs(shards: Path, root: Path) -> None:
    """A run under ep, and the same run crashed in step 4 and resumed from step 2."""
    half = ["--data.batch_size=2", "--train.distributed=ep", *MOE]
    pretrain(tiny_config(shards, root / "ep", *half))
    crash_then_resume(tiny_config(shards, root / "ep_resumed", *half), crash_in_step=4)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    """One spawn of 2 gloo ranks for every test here (a spawn costs seconds); returns its folder."""
    root = tmp_path_factory.mktemp("ep")
    mp.spawn(worker, args=(free_port(), write_shards(root / "shards"), root), nprocs=WORLD)
    return root


@pytest.fixture(scope="module")
def ranks(spawned) -> list[dict]:
    return [torch.load(spawned / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def single() -> tuple[Transformer, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The whole batch in one process: logits, the mean loss, its gradients, and each MoE
    layer's rows per expert sent from each half of the batch (counts[layer][half, expert])."""
    model = moe_model()
    counts = []
    for layer in model.layers:
        def count(module, args, logits):
            chosen = logits.topk(2, dim=-1).indices.view(2, -1)  # (half of the batch, its token · k)
            counts.append(torch.stack([torch.bincount(c, minlength=4) for c in chosen]))
        layer.mlp.gate.register_forward_hook(count)
    inputs, targets = batch()
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return model, logits.detach(), torch.stack(counts), {n: p.grad for n, p in model.named_parameters()}


def test_a_dense_model_has_no_experts_to_shard() -> None:
    dense = {k: v for k, v in TINY.items() if k not in ("model_type", "num_experts", "num_experts_per_tok")}
    with pytest.raises(ValueError, match="no MoE layer; set model.num_experts, or use --train.distributed=ddp"):
        shard_experts(Transformer(ModelConfig(**dense)), dist.group.WORLD)


def test_sharded_experts_give_the_single_process_logits_and_loss(ranks, single):
    _, logits, counts, _ = single
    assert counts[0, :, 3].sum() == 0  # layer 0: expert 3, on rank 1, receives no rows at all
    assert (counts[:, :, :2] > 0).all() and (counts[:, :, 2:].sum(-1) > 0).all()  # rows cross both ways
    assert len(set(counts.flatten().tolist())) > 3  # unevenly
    _, targets = batch()
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["logits"], logits[2 * rank:2 * rank + 2], atol=1e-5, rtol=1e-5)
    whole = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    torch.testing.assert_close(ranks[0]["loss"] + ranks[1]["loss"], whole, atol=1e-4, rtol=1e-5)


def test_expert_slices_and_replicated_parameters_get_the_global_batch_gradients(ranks, single):
    model, _, _, grads = single
    for rank, got in enumerate(ranks):
        assert got["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            want = grad[2 * rank:2 * rank + 2] if ".experts." in name else grad
            assert got["grads"][name].shape == want.shape, name
            torch.testing.assert_close(got["grads"][name], want, atol=1e-6, rtol=1e-4, msg=name)
        norm = torch.nn.utils.get_total_norm(list(grads.values()))
        torch.testing.assert_close(got["norm"], norm, atol=1e-6, rtol=1e-5)
    full = model.state_dict()  # rank 0's gathered state: full expert tensors under their own names
    assert ranks[0]["state"].keys() == full.keys()
    for name, tensor in full.items():
        torch.testing.assert_close(ranks[0]["state"][name], tensor, atol=0, rtol=0, msg=name)


def grad_norms(out_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in read_jsonl(out_dir / "metrics.jsonl") if "grad_norm" in r]


def test_training_under_expert_parallelism_follows_one_process_and_loads_in_one(spawned, tmp_path: Path) -> None:
    shards = spawned / "shards"
    one = pretrain(tiny_config(shards, tmp_path / "single", "--data.batch_size=4", *MOE))

    assert losses(spawned / "ep") == pytest.approx(one.losses, abs=1e-5)
    assert grad_norms(spawned / "ep") == pytest.approx(grad_norms(tmp_path / "single"), rel=1e-5)
    assert min(grad_norms(spawned / "ep")) > 1.0  # optim.grad_clip=1 clips every step: the norm matters
    assert losses(spawned / "ep_resumed") == pytest.approx(losses(spawned / "ep"), abs=1e-6)
    saved = load_checkpoint_weights(spawned / "ep" / "checkpoints" / "step_000004")
    want = load_checkpoint_weights(one.checkpoint_path)
    assert saved["layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # all experts, gathered
    model = Transformer(tiny_config(shards, tmp_path, *MOE).model)
    model.load_state_dict(saved)  # strict: every name and shape of the one-process model
    for name, tensor in want.items():
        torch.testing.assert_close(saved[name], tensor, atol=1e-5, rtol=1e-4, msg=name)
    exported = load_hf_dir(spawned / "ep" / "final")  # the export, also gathered, loads as well
    ids = torch.randint(1, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(ids), model.eval()(ids), atol=1e-5, rtol=1e-5)
