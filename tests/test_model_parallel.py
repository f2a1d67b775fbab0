"""Tensor and pipeline parallelism on CPU: 2 gloo processes holding half of each matmul (tp) or half of
the layers (pp), both reading the whole batch, equal one process: logits, loss, every parameter's
gradient (gathered), the gradient norm, then a training run's loss curve, its checkpoint and a
crash + resume.

One spawn runs every scenario; the workers save what they computed and the single-process
references and comparisons run in the test process (as in test_expert_parallel.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tokenmind  # noqa: F401,I001  (before torch in the spawned ranks too: the same MKL kernels as this process)
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from test_train_distributed import free_port, gloo_rank, losses
from test_train_helpers import crash_then_resume, one_thread, tiny_config, write_shards  # noqa: F401 (one_thread: autouse)

from tokenmind.data.loader import TokenBatch
from tokenmind.model.attention import DenseAttentionMetadata
from tokenmind.model.checkpoint import load_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer
from tokenmind.train import pretrain
from tokenmind.train.checkpoint import load_checkpoint_weights
from tokenmind.train.distributed import DistContext, clip_grad_norm, wrap_model
from tokenmind.train.pipeline_parallel import PipelineParallel
from tokenmind.train.tensor_parallel import check_tensor_parallel, checkpoint_layout, rank_major

# GQA (4 query heads over 2 kv heads), biases on every split projection, per-head q/k norm
TP_MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, qkv_bias=True, o_bias=True, mlp_bias=True,
                qk_norm=True)
PP_MODEL = dict(TP_MODEL, num_hidden_layers=4, tie_word_embeddings=True)  # the tied head spans both stages
RUN = ["--train.steps=4", "--train.checkpoint_every=2"]
WORLD = 2


def model(kind: str) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**(TP_MODEL if kind == "tp" else PP_MODEL)))
    m.init_weights(std=0.3)
    with torch.no_grad():  # biases and norms away from their zero/one init, so a misplaced one shows
        for name, p in m.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return m


def batch() -> TokenBatch:
    """4 rows of 12 tokens, two packed documents in the first row."""
    ids = torch.randint(0, 64, (4, 13), generator=torch.Generator().manual_seed(0))
    docs = torch.zeros(4, 12, dtype=torch.long)
    docs[0, 5:] = 1
    positions = torch.arange(12).expand(4, 12).clone()
    positions[0, 5:] -= 5
    return TokenBatch(ids[:, :-1], ids[:, 1:].clone(), docs, positions)


def worker(rank: int, port: int, shards: Path, root: Path) -> None:
    with gloo_rank(rank, WORLD, port):
        tensor_parallel_step(rank, root)
        pipeline_step(rank, root)
        for kind in ("tp", "pp"):
            cfg = [f"--train.distributed={kind}", *RUN]
            pretrain(tiny_config(shards, root / kind, *cfg))
            crash_then_resume(tiny_config(shards, root / f"{kind}_resumed", *cfg), crash_in_step=4)
        pretrain(tiny_config(shards, root / "pp_gpipe", "--train.distributed=pp", "--train.pipeline_schedule=gpipe",
                             "--train.pipeline_microbatches=4", "--model.tie_word_embeddings=true", *RUN))


def full_grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in m.named_parameters()}
    return checkpoint_layout(m, grads)


def tensor_parallel_step(rank: int, root: Path) -> None:
    """The whole batch through the sharded model, backward of the summed loss."""
    m = model("tp")
    wrapped = wrap_model(m, DistContext("tp", torch.device("cpu"), rank, WORLD))
    b = batch()
    logits = wrapped(b.input_ids, b.positions, DenseAttentionMetadata(document_ids=b.document_ids))
    loss = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), reduction="sum")
    loss.backward()
    local = m.layers[0].self_attn.qkv_proj.weight.to_local().shape
    torch.save({"logits": logits.detach(), "loss": loss.detach(), "grads": full_grads(m), "local_qkv": local,
                "norm": clip_grad_norm(list(m.parameters()), 0.0)}, root / f"tp{rank}.pt")


def pipeline_step(rank: int, root: Path) -> None:
    """The batch in 2 micro-batches through the 2 stages (1F1B), then the logits (forward only)."""
    m = model("pp")
    pipe = PipelineParallel(m, torch.device("cpu"), microbatches=2, schedule="1f1b", batch_size=4)
    b = batch()
    terms = pipe.forward_backward(b, "fp32")
    shared = pipe.shared_parameters()
    params = list(m.parameters())
    norm = clip_grad_norm(params, 0.0, [p for p in params if all(p is not q for q in shared)], shared)
    with torch.no_grad():
        args = (b.input_ids, b.positions, b.document_ids) if rank == 0 else ()
        logits = pipe.schedule.eval(*args, target=b.targets)
    torch.save({"loss": terms.loss, "count": terms.count, "logits": logits, "norm": norm,
                "grads": {name: p.grad for name, p in m.named_parameters()}}, root / f"pp{rank}.pt")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mp")
    mp.spawn(worker, args=(free_port(), write_shards(root / "shards"), root), nprocs=WORLD)
    return root


def single(kind: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Logits, summed loss and gradients of the whole batch in one process."""
    m, b = model(kind), batch()
    logits = m(b.input_ids, b.positions, DenseAttentionMetadata(document_ids=b.document_ids))
    loss = F.cross_entropy(logits.flatten(0, 1), b.targets.flatten(), reduction="sum")
    loss.backward()
    return logits.detach(), loss.detach(), {name: p.grad for name, p in m.named_parameters()}


def test_fused_rows_are_reordered_rank_major() -> None:
    # q has 4 rows, k and v 2 each: rank 0 gets q rows 0-1, k row 4, v row 6; rank 1 the rest
    assert rank_major([4, 2, 2], 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    with pytest.raises(ValueError, match="num_key_value_heads=3 does not divide by 2 ranks"):
        odd = {**TP_MODEL, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8}
        check_tensor_parallel(ModelConfig(**odd), 2)
    with pytest.raises(ValueError, match="mixture of experts; use --train.distributed=ep"):
        check_tensor_parallel(ModelConfig(**{**TP_MODEL, "num_experts": 4}), 2)


def test_tensor_parallel_matches_one_process(spawned) -> None:
    logits, loss, grads = single("tp")
    for rank in range(WORLD):
        got = torch.load(spawned / f"tp{rank}.pt")
        assert got["local_qkv"] == (grads["layers.0.self_attn.qkv_proj.weight"].shape[0] // 2, 32)  # half the rows
        torch.testing.assert_close(got["logits"], logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["loss"], loss, atol=1e-4, rtol=1e-6)
        assert got["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(got["norm"], torch.nn.utils.get_total_norm(list(grads.values())),
                                   atol=1e-5, rtol=1e-5)


def test_pipeline_parallel_matches_one_process(spawned) -> None:
    logits, loss, grads = single("pp")
    first, last = (torch.load(spawned / f"pp{rank}.pt") for rank in range(WORLD))
    torch.testing.assert_close(last["logits"], logits, atol=1e-5, rtol=1e-5)
    for got in (first, last):  # the summed loss reaches every stage
        torch.testing.assert_close(got["loss"], loss, atol=1e-4, rtol=1e-6)
        assert got["count"] == 48
    def stage(got):  # which layers (and ends of the model) a stage holds
        return {".".join(k.split(".")[:2]) if k.startswith("layers.") else k for k in got["grads"]}

    assert stage(first) == {"embed_tokens.weight", "layers.0", "layers.1"}
    assert stage(last) == {"embed_tokens.weight", "layers.2", "layers.3", "norm.weight"}  # lm_head: the tied embedding
    for name, grad in grads.items():
        for got in (first, last):
            if name in got["grads"]:  # the tied embedding on both stages, with the sum of both uses
                # gradients of the summed loss reach ~30: 1e-4 is a few millionths of that, float32 summation
                # order (MKL's AVX2 kernels sum a call's last rows in another order than its full blocks)
                torch.testing.assert_close(got["grads"][name], grad, atol=1e-4, rtol=1e-4, msg=name)
    assert first["grads"].keys() | last["grads"].keys() == grads.keys()
    norm = torch.nn.utils.get_total_norm(list(grads.values()))
    for got in (first, last):
        torch.testing.assert_close(got["norm"], norm, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["tp", "pp"])
def test_training_follows_one_process_and_resumes(spawned, tmp_path: Path, kind: str) -> None:
    shards = spawned / "shards"
    one = pretrain(tiny_config(shards, tmp_path / "single", *RUN))  # 4 rows, as each of the 2 ranks reads
    assert losses(spawned / kind) == pytest.approx(one.losses, abs=1e-5)
    assert losses(spawned / f"{kind}_resumed") == pytest.approx(losses(spawned / kind), abs=1e-6)
    saved = load_checkpoint_weights(spawned / kind / "checkpoints" / "step_000004")
    want = load_checkpoint_weights(one.checkpoint_path)
    assert saved.keys() == want.keys()
    # the usual layout: fused rows in checkpoint order, every stage. Adam divides by sqrt(v), so where a
    # gradient is ~0 float noise from another summation order is a whole step (measured under tp: one of
    # the embedding's 19,200 entries off by 8e-5 after 4 steps)
    for name, tensor in want.items():
        torch.testing.assert_close(saved[name], tensor, atol=2e-4, rtol=1e-4, msg=name)
    exported = load_hf_dir(spawned / kind / "final")
    ids = torch.randint(1, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    reference = load_hf_dir(tmp_path / "single" / "final")
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(ids), reference.eval()(ids), atol=1e-4, rtol=1e-4)


def test_gpipe_with_four_microbatches_and_a_tied_head_follows_one_process(spawned, tmp_path: Path) -> None:
    one = pretrain(tiny_config(spawned / "shards", tmp_path / "single", "--model.tie_word_embeddings=true", *RUN))
    assert losses(spawned / "pp_gpipe") == pytest.approx(one.losses, abs=1e-5)
