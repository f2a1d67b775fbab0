"""Knowledge distillation: the divergences against TRL and the full-vocabulary KL, the teacher's
top-k cache (built once, reused, rebuilt on new inputs, refused when broken), a student cut from
the teacher's layers, offline KD and on-policy GKD through the one trainer (KL falls, exact
resume, samples from the live student), and the engine's prefix-cache reset they rely on."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_sft_helpers import conversations, tiny_model_dir, tiny_tokenizer, write_chats
from test_train_helpers import crash_in_step_5, one_thread  # noqa: F401 (one_thread: autouse fixture)

from tokenmind.chat import ChatSession
from tokenmind.data.loader import IGNORE_INDEX
from tokenmind.engine.llm import LLM
from tokenmind.engine.sampling import SamplingParams
from tokenmind.jsonl import read_jsonl
from tokenmind.model.checkpoint import load_hf_dir, save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.cpu import fastest_autocast
from tokenmind.model.load import Pretrained, load_model
from tokenmind.model.transformer import Transformer
from tokenmind.posttrain.data import prepare_chat_data
from tokenmind.posttrain.kd import (
    build_kd_trainer,
    generalized_jsd,
    kd_train,
    load_kd_config,
    student_from_layers,
    topk_kl,
)
from tokenmind.posttrain.kd_data import teacher_topk
from tokenmind.train.distributed import init_distributed

CONFIGS = Path(__file__).parents[1] / "src" / "tokenmind" / "configs"


def tiny_teacher(tokenizer, layers: int = 4) -> Transformer:
    """A random teacher with a large output layer, so its next-token distributions are peaked and
    differ from a fresh student's (a 0.02-std head gives near-uniform ones)."""
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = Transformer(cfg)
    generator = torch.Generator().manual_seed(0)
    model.init_weights(0.02, generator)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5, generator=generator)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The teacher (4 layers), a random 2-layer student with the same tokenizer, the planted chats."""
    root = tmp_path_factory.mktemp("kd")
    tokenizer = tiny_tokenizer()
    return {"teacher": save_hf_dir(tiny_teacher(tokenizer), root / "teacher", tokenizer=tokenizer),
            "student": tiny_model_dir(root / "student", tokenizer, seed=1),
            "chats": write_chats(root / "chats.jsonl", conversations())}


def kd_config(setup: dict[str, Path], out_dir: Path, *overrides: str):
    """4 rows × 96 tokens, fp32, lr 3e-3, 8 steps, the random student; `overrides` win."""
    base = [f"--distill.teacher={setup['teacher']}", f"--distill.student={setup['student']}",
            f"--data.files={setup['chats']}", "--data.batch_size=4", "--data.seq_len=96", "--data.val_fraction=0.1",
            "--optim.lr=3e-3", "--schedule.warmup_steps=2", "--train.steps=8", "--train.precision=fp32",
            "--train.eval_batches=2", f"--train.out_dir={out_dir}"]
    return load_kd_config(None, base + list(overrides))


def kd_trainer(cfg):
    return build_kd_trainer(cfg, init_distributed(cfg.train.distributed, cfg.train.device), progress=False)


def train_records(out_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(out_dir / "metrics.jsonl") if "loss" in r]


# ---- the divergences ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_equals_trl(beta: float, temperature: float) -> None:
    with warnings.catch_warnings():  # TRL warns that its experimental API may change
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer

    generator = torch.Generator().manual_seed(0)
    student, teacher = (3 * torch.randn(2, 6, 50, generator=generator) for _ in range(2))
    labels = torch.randint(0, 50, (2, 6), generator=generator)
    labels[0, :2] = IGNORE_INDEX
    trained = labels != IGNORE_INDEX
    ours_in, trl_in = student[trained].clone().requires_grad_(), student.clone().requires_grad_()
    ours = generalized_jsd(ours_in, teacher[trained], beta, temperature).sum()
    reference = GKDTrainer.generalized_jsd_loss(trl_in, teacher, labels, beta, temperature, reduction="sum")
    torch.testing.assert_close(ours, reference)
    ours.backward()
    reference.backward()
    torch.testing.assert_close(ours_in.grad, trl_in.grad[trained])


def full_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) per row, written out over the whole vocabulary."""
    p = torch.softmax(teacher / temperature, -1)
    return (p * (torch.log_softmax(teacher / temperature, -1) - torch.log_softmax(student / temperature, -1))).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_kl_over_the_whole_vocabulary_is_the_full_kl(temperature: float) -> None:
    generator = torch.Generator().manual_seed(0)
    student, teacher = (3 * torch.randn(10, 40, generator=generator) for _ in range(2))
    logprobs, ids = torch.log_softmax(teacher / temperature, -1).topk(40)
    ours_in, full_in = student.clone().requires_grad_(), student.clone().requires_grad_()
    ours, reference = topk_kl(ours_in, ids, logprobs, temperature), full_kl(full_in, teacher, temperature)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    ours.sum().backward()
    reference.sum().backward()
    torch.testing.assert_close(ours_in.grad, full_in.grad, atol=1e-5, rtol=1e-4)
    # fewer ids: the KL of the coarser (k + 1)-outcome view, never above the full KL, 0 for equal models
    for k in (1, 5, 20):
        logprobs, ids = torch.log_softmax(teacher, -1).topk(k)
        assert (topk_kl(student, ids, logprobs) <= full_kl(student, teacher, 1.0) + 1e-5).all()
        assert topk_kl(teacher, ids, logprobs).abs().max() < 1e-5
    # the cache keeps log-probs in fp16: a small absolute error on the KL
    logprobs, ids = torch.log_softmax(teacher, -1).topk(40)
    torch.testing.assert_close(topk_kl(student, ids, logprobs.half()), full_kl(student, teacher, 1.0), atol=2e-2,
                               rtol=0)


# ---- the student ----------------------------------------------------------------------------------


def test_student_from_layers_runs_the_kept_blocks_of_the_teacher() -> None:
    teacher = tiny_teacher(tiny_tokenizer(), layers=4)
    student = student_from_layers(teacher, [0, 2])
    assert student.cfg.num_hidden_layers == 2 and student.cfg.vocab_size == teacher.cfg.vocab_size
    assert torch.equal(student.layers[1].mlp.down_proj.weight, teacher.layers[2].mlp.down_proj.weight)
    assert student.embed_tokens.weight.data_ptr() != teacher.embed_tokens.weight.data_ptr()  # a copy
    x = torch.tensor([[1, 5, 9, 14, 30, 2]])
    teacher.layers = torch.nn.ModuleList([teacher.layers[0], teacher.layers[2]])  # what the student should be
    with torch.no_grad():
        torch.testing.assert_close(student(x), teacher(x))
    for bad in ([], [0, 4], [2, 0], [1, 1]):
        with pytest.raises(ValueError, match="increasing teacher layer indices"):
            student_from_layers(teacher, bad)


# ---- the teacher's top-k cache --------------------------------------------------------------------


def test_teacher_topk_cache_is_built_once_reused_and_rebuilt_on_new_inputs(setup, tmp_path: Path) -> None:
    teacher = load_model(setup["teacher"])
    examples = prepare_chat_data(teacher.tokenizer, conversations(2), 96).train
    args = (tmp_path, "train", 96, 8, 1.0, "fp32", 4, torch.device("cpu"))
    topk, path = teacher_topk(teacher, examples, *args, progress=False)
    stamp = path.stat().st_mtime_ns
    again, same = teacher_topk(teacher, examples, *args, progress=False)
    assert same == path and path.stat().st_mtime_ns == stamp and torch.equal(again.ids, topk.ids)

    # positions line up with each conversation run alone (packing keeps documents apart)
    for index in (0, len(examples) - 1):
        e = examples[index]
        with torch.no_grad():
            logits = teacher.model(torch.from_numpy(e.inputs)[None])[0][torch.from_numpy(e.targets != IGNORE_INDEX)]
        want_logprobs, want_ids = torch.log_softmax(logits, -1).topk(8)
        ids, logprobs = topk.of_examples([index])
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(logprobs.float(), want_logprobs, atol=1e-2, rtol=1e-3)

    _, other_k = teacher_topk(teacher, examples, tmp_path, "train", 96, 4, 1.0, "fp32", 4, torch.device("cpu"),
                              progress=False)
    fewer = examples[:-1]
    _, other_data = teacher_topk(teacher, fewer, *args, progress=False)
    assert len({path, other_k, other_data}) == 3 and len(list(tmp_path.glob("*.safetensors"))) == 3

    # a file of other inputs under this name, and a damaged file, are refused with the fix
    other_data.replace(path)
    with pytest.raises(ValueError, match="does not match this run.*delete"):
        teacher_topk(teacher, examples, *args, progress=False)
    path.write_bytes(b"\x00" * 40)
    with pytest.raises(ValueError, match="not a readable teacher top-k cache.*delete"):
        teacher_topk(teacher, examples, *args, progress=False)


# ---- offline KD -----------------------------------------------------------------------------------


def test_offline_kd_lowers_the_kl_and_exports_a_student_that_generates(setup, tmp_path: Path) -> None:
    cfg = kd_config(setup, tmp_path, "--train.steps=40", "--schedule.name=constant", "--train.eval_every=20")
    trainer = kd_trainer(cfg)
    before = trainer.evaluate()
    result = trainer.train()
    after = [r for r in read_jsonl(result.metrics_path) if "val_kl" in r]
    assert [r["step"] for r in after] == [20, 40]
    assert after[-1]["val_kl"] < 0.5 * before["kl"], (before, after)
    assert after[-1]["val_loss"] == pytest.approx(after[-1]["val_kl"])  # alpha 0, temperature 1: the loss is the KL
    assert 0.5 < before["kl"] and all(np.isfinite(result.losses))
    files = list((tmp_path / "teacher_topk").glob("*.safetensors"))
    assert sorted(f.name.split("-")[0] for f in files) == ["train", "val"]

    student = load_model(result.final_model_path)
    assert student.model.cfg.num_hidden_layers == 2
    assert student.tokenizer.token_to_id("<|im_end|>") in student.tokenizer.eos_token_ids
    reply = "".join(ChatSession(student, SamplingParams(max_tokens=6, temperature=0)).send("What color is a lime?"))
    assert isinstance(reply, str)


def retraces_after_a_crash(setup, tmp_path: Path, args: list[str]):
    """Train 8 steps straight, and again killed in step 5 then resumed: the logged numbers must be
    equal step for step. Returns the straight run's result."""
    straight = kd_train(kd_config(setup, tmp_path / "straight", *args))
    crashed = kd_config(setup, tmp_path / "crashed", *args)
    crash_in_step_5(kd_trainer(crashed))
    assert len(kd_train(crashed).losses) == 4
    a, b = train_records(tmp_path / "straight"), train_records(tmp_path / "crashed")
    for key in ("loss", "kl", "ce", "grad_norm"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    return straight


def test_offline_kd_resume_retraces_the_uninterrupted_run(setup, tmp_path: Path) -> None:
    args = ["--train.checkpoint_every=4", "--train.keep_last=0", "--distill.alpha=0.3", "--distill.temperature=2"]
    retraces_after_a_crash(setup, tmp_path, args)


def test_distill_layers_cut_the_student_from_the_teacher(setup, tmp_path: Path) -> None:
    random_student = kd_trainer(kd_config(setup, tmp_path / "random")).evaluate()["kl"]
    cut = kd_trainer(kd_config(setup, tmp_path / "cut", "--distill.student=''", "--distill.layers=[0,2]"))
    assert cut.model.cfg.num_hidden_layers == 2
    assert cut.evaluate()["kl"] < random_student  # half a random teacher is still closer than a random model


# ---- on-policy GKD --------------------------------------------------------------------------------


def naive_greedy(model: Transformer, prompt: list[int], max_tokens: int, stops: set[int]) -> list[int]:
    """Whole-sequence recompute per token: what the live student would answer greedily."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(token)
            if token in stops:
                break
    return ids[len(prompt):]


def test_gkd_samples_come_from_the_live_student(setup, tmp_path: Path) -> None:
    cfg = kd_config(setup, tmp_path, "--distill.mode=gkd", "--distill.lmbda=1", "--distill.sample_temperature=0",
                    "--distill.max_new_tokens=6")
    trainer = kd_trainer(cfg)
    loader, model = trainer.loader, trainer.model
    turn = loader.turns[0]
    stops = {loader.end_id}  # a plain eos is just another token of the sample

    def sampled() -> list[int]:
        return loader.sample([(0, 123)])[0].inputs[len(turn.prompt):].tolist()

    before = sampled()
    assert loader.llm.engine.model is model  # the engine runs the module the trainer updates
    assert before == naive_greedy(model, turn.prompt, 6, stops)
    with torch.no_grad():
        for p in model.parameters():  # a large update, so k/v of the cached prompt would be stale
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    after = sampled()
    assert after == naive_greedy(model, turn.prompt, 6, stops) and after != before

    batch = next(loader)  # every conversation answered by the student: trained tokens are its own
    assert (batch.targets != IGNORE_INDEX).sum() <= 4 * 6


def test_gkd_trains_and_resumes_exactly(setup, tmp_path: Path) -> None:
    args = ["--distill.mode=gkd", "--distill.lmbda=0.5", "--distill.beta=0.5", "--distill.max_new_tokens=8",
            "--train.checkpoint_every=4", "--train.keep_last=0"]
    straight = retraces_after_a_crash(setup, tmp_path, args)
    assert all(np.isfinite(straight.losses)) and straight.final_val_loss is not None


# ---- configuration --------------------------------------------------------------------------------


def test_demo_config_loads_and_bad_options_name_the_fix(setup, tmp_path: Path) -> None:
    cfg = load_kd_config(CONFIGS / "kd_smollm2.yaml")
    assert cfg.distill.teacher == "smollm2" and cfg.distill.layers == list(range(0, 30, 2))
    assert load_kd_config(CONFIGS / "kd_smollm2.yaml", ["--distill.mode=gkd"]).distill.mode == "gkd"
    for options, match in [(["--distill.mode=online"], "choose one of offline, gkd"),
                           (["--distill.layers=[0,1]"], "not both"),
                           (["--distill.beta=1.5"], r"distill.beta must be in \[0, 1\]"),
                           (["--distill.mode=gkd", "--train.distributed=fsdp"], "use --train.distributed=ddp"),
                           (["--distill.mode=gkd", "--train.distributed=ep"], "distributed=ep shards")]:
        with pytest.raises(ValueError, match=match):
            kd_config(setup, tmp_path, *options)
    other = ModelConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=4, max_position_embeddings=128)
    wrong = save_hf_dir(Transformer(other), tmp_path / "wrong", tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="does not share the teacher's tokenizer"):
        kd_trainer(kd_config(setup, tmp_path / "run", f"--distill.student={wrong}"))


# ---- the engine after a weight update -------------------------------------------------------------


def test_engine_prefix_cache_reset_serves_the_new_weights() -> None:
    tokenizer = tiny_tokenizer()
    model = tiny_teacher(tokenizer, layers=2)
    llm = LLM(Pretrained(model, tokenizer, Path("tiny")), block_size=4, max_num_seqs=4, kv_cache_bytes=1 << 20)
    prompt, params = list(range(3, 16)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    llm.generate(prompt, params)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
    assert llm.generate(prompt, params)[0].num_cached_tokens == 12  # stale k/v served without a reset
    llm.reset_prefix_cache()
    out = llm.generate(prompt, params)[0]
    fresh = LLM(Pretrained(model, tokenizer, Path("tiny")), block_size=4, max_num_seqs=4, kv_cache_bytes=1 << 20)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == fresh.generate(prompt, params)[0].outputs[0].token_ids
    with torch.no_grad():
        want = naive_greedy(model, prompt, 5, set())
    assert out.outputs[0].token_ids == want

    llm.engine.add_request(prompt, params)
    llm.engine.step()  # the request now holds blocks
    with pytest.raises(RuntimeError, match="unfinished"):
        llm.reset_prefix_cache()
    with pytest.raises(RuntimeError, match="still held"):
        llm.engine.block_manager.reset_prefix_cache()


# ---- the real model -------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_teacher_to_a_four_layer_student(tmp_path: Path) -> None:
    files = write_chats(tmp_path / "chats.jsonl", conversations(2))
    cfg = load_kd_config(None, ["--distill.teacher=smollm2", "--distill.layers=[0,10,20,29]", f"--data.files={files}",
                                "--data.seq_len=128", "--data.batch_size=4", "--data.val_fraction=0.1",
                                "--optim.lr=1e-3", "--schedule.name=constant", "--schedule.warmup_steps=0",
                                "--train.steps=6", f"--train.precision={fastest_autocast('cpu')}", "--train.eval_batches=2",
                                f"--train.out_dir={tmp_path / 'run'}"])
    trainer = kd_trainer(cfg)
    before = trainer.evaluate()["kl"]
    result = trainer.train()
    after = [r for r in read_jsonl(result.metrics_path) if "val_kl" in r][-1]["val_kl"]
    assert after < before
    student = load_model(result.final_model_path)
    assert student.model.cfg.num_hidden_layers == 4
    assert load_hf_dir(result.final_model_path).cfg.vocab_size == 49152
    reply = "".join(ChatSession(student, SamplingParams(max_tokens=8, temperature=0)).send("Hi"))
    assert isinstance(reply, str)


def test_posttrain_kd_and_gkd_commands(setup, tmp_path: Path, capsys) -> None:
    from tokenmind.cli import main

    for method, mode in (("kd", "offline"), ("gkd", "gkd")):
        out = tmp_path / method
        assert main(["posttrain", method, f"--distill.teacher={setup['teacher']}",
                     f"--distill.student={setup['student']}", f"--data.files={setup['chats']}", "--data.batch_size=4",
                     "--data.seq_len=96", "--data.val_fraction=0", "--train.steps=2", "--schedule.warmup_steps=0",
                     "--train.precision=fp32", "--distill.max_new_tokens=8", f"--train.out_dir={out}"]) == 0
        assert "done: 2 steps" in capsys.readouterr().out
        assert f"mode: {mode}" in (out / "config.yaml").read_text()
        assert (out / "final" / "config.json").is_file()
