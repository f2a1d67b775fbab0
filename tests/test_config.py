"""The one config loader (`tokenmind.config`) and the commands built on it: names checked with a
did-you-mean, values coerced by annotation, defaults ← YAML ← overrides for flat and sectioned
configs, resolved configs that load back equal, and what `tokenmind serve/eval/speedrun` build
from argv (the library call is replaced, so nothing is served, loaded or trained)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import yaml

import tokenmind.eval.runner
import tokenmind.serve
import tokenmind.speedrun
from tokenmind.cli import build_parser, main
from tokenmind.config import load_config, parse_overrides, save_resolved
from tokenmind.eval.runner import EvalConfig
from tokenmind.serve.config import ServeConfig
from tokenmind.serve.router import RouterConfig
from tokenmind.speedrun import SpeedrunConfig, load_speedrun_config
from tokenmind.train.config import RunConfig


@dataclass
class Inner:
    rate: float = 0.1
    names: list[str] = field(default_factory=list)
    limit: int | None = None
    pair: tuple[int, int] = (1, 2)


@dataclass
class Outer:
    title: str = "x"
    inner: Inner = field(default_factory=Inner)


@dataclass
class Needs:
    model: str
    port: int = 80


def test_values_are_coerced_by_annotation(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  rate: 1e-3\n  pair: [3, 4]\n  limit: 5\n")  # YAML 1.1 reads 1e-3 as a string
    cfg = load_config(Outer, path)
    assert cfg.inner.rate == 1e-3 and isinstance(cfg.inner.rate, float) and cfg.inner.pair == (3, 4)
    cfg = load_config(Outer, path, ["--inner.names=a.jsonl", "inner.limit=null", "--title", "2024"])
    assert cfg.inner.names == ["a.jsonl"] and cfg.inner.limit is None and cfg.title == "2024"
    assert load_config(Outer, None, ["inner.names=[a, b]", "inner.limit=7"]).inner == Inner(names=["a", "b"], limit=7)
    assert load_config(Outer, None, ["--inner={rate: 2, limit: 3}"]).inner == Inner(rate=2.0, limit=3)
    with pytest.raises(ValueError, match=r"inner.limit: 'many' is not a valid"):
        load_config(Outer, None, ["inner.limit=many"])
    with pytest.raises(ValueError, match=r"inner.pair: expected tuple"):
        load_config(Outer, None, ["inner.pair=[1, 2, 3]"])


@pytest.mark.parametrize("schema, overrides, message", [
    (Outer, ["inner.rat=1"], r"unknown key in section 'inner' 'rat' \(did you mean 'rate'\?\); valid: rate, names"),
    (Outer, ["innr.rate=1"], r"unknown config key 'innr' \(did you mean 'inner'\?\); valid: title, inner"),
    (Outer, ["inner=3"], r"inner is a section: set its keys as inner.KEY=value \(keys: rate, names"),
    (Outer, ["title.x=3"], r"override 'title.x' must be key: title is one value, not a section"),
    (RunConfig, ["--optimizer.lr=1"], r"unknown config section 'optimizer' \(did you mean 'optim'\?\)"),
    (ServeConfig, ["model=m", "prot=80"], r"unknown config key 'prot' \(did you mean 'port'\?\); valid: model, host"),
    (ServeConfig, ["model=m", "quantize=int4"], r"unknown config key 'quantize' \(did you mean 'quantization'\?\)"),
    (Needs, ["port=1"], r"model is not set: give it in the YAML config or on the command line"),
    (EvalConfig, ["tasks=arc_easy,trivia"], r"unknown or no tasks \['trivia'\]"),  # __post_init__ still checks
])
def test_errors_name_the_key_and_the_fix(schema: type, overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(schema, None, overrides)


def test_unknown_names_in_the_yaml_file_are_rejected_too(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  rate: 1\n  limt: 2\n")
    with pytest.raises(ValueError, match=r"unknown key in section 'inner' 'limt' \(did you mean 'limit'\?\)"):
        load_config(Outer, path)
    path.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match=r"must be a YAML mapping of config keys \(title, inner\)"):
        load_config(Outer, path)
    path.write_text("inner: 3\n")
    with pytest.raises(ValueError, match=r"inner is a section: give it a mapping"):
        load_config(Outer, path)


def test_parse_overrides_forms() -> None:
    assert parse_overrides(["--a.b=1e-3", "c", "[x, y]", "d=", "--e.f.g=null"]) == {
        "a.b": "1e-3", "c": ["x", "y"], "d": None, "e.f.g": None}
    with pytest.raises(ValueError, match="has no value"):
        parse_overrides(["--a.b"])


def test_flat_config_layers_defaults_yaml_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "eval.yaml"
    path.write_text("model: tiny\ntasks: [arc_easy, gsm8k]\nlimit: 50\nbatch_size: 4\n")
    cfg = load_config(EvalConfig, path, {"limit": 10, "seed": 3})  # argparse flags arrive as a mapping
    assert (cfg.model, cfg.tasks, cfg.limit, cfg.batch_size, cfg.seed) == ("tiny", ["arc_easy", "gsm8k"], 10, 4, 3)
    assert cfg.max_tokens == EvalConfig().max_tokens  # neither file nor override: the field's default
    assert load_config(EvalConfig, None, ["tasks=arc_easy, mmlu"]).tasks == ["arc_easy", "mmlu"]
    serve = load_config(ServeConfig, None, ["model=m"], defaults={"port": 1, "host": "0.0.0.0"})
    assert (serve.port, serve.host) == (1, "0.0.0.0")
    path.write_text("model: m\nport: 2\n")
    assert load_config(ServeConfig, path, ["host=::1"], defaults={"port": 1, "host": "x"}).port == 2


def test_sectioned_config_layers_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 1e-3\ntrain:\n  steps: 50\n  seed: 4\nschedule:\n")
    cfg = load_config(RunConfig, path, ["--train.steps=20", "--schedule.warmup_steps=5"])
    assert (cfg.optim.lr, cfg.train.steps, cfg.train.seed, cfg.schedule.warmup_steps) == (1e-3, 20, 4, 5)
    resolved = save_resolved(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(RunConfig, resolved) == cfg
    assert [p.name for p in resolved.parent.iterdir()] == ["config.yaml"]  # written via a temp file, renamed
    serve = load_config(ServeConfig, None, ["model=smollm2", "allowed_hosts=[a, b]", "max_queue_wait=null"])
    assert load_config(ServeConfig, save_resolved(serve, tmp_path / "serve.yaml")) == serve


def mini_speedrun(tmp_path: Path, **eval_section) -> Path:
    path = tmp_path / "mini.yaml"
    path.write_text(yaml.safe_dump({
        "name": "mini", "out_dir": str(tmp_path / "run"), "vocab_size": 400,
        "pretrain": {"data": {"seq_len": 64}, "schedule": {"warmup_steps": 2}, "train": {"steps": 12}},
        "sft": {"optim": {"lr": 0.003}}, "eval": eval_section}))
    return path


def test_speedrun_sections_are_typed_and_wired(tmp_path: Path) -> None:
    cfg = load_speedrun_config(str(mini_speedrun(tmp_path, limit=10)), ["--pretrain.train.steps=6", "data_dir=d"])
    run = tmp_path / "run"
    assert isinstance(cfg.pretrain, RunConfig) and cfg.pretrain.train.steps == 6
    assert (cfg.pretrain.data.shards, cfg.pretrain.train.out_dir) == (str(run / "shards"), str(run / "pretrain"))
    assert cfg.pretrain.model.vocab_size == 400 and cfg.sft.sft.init_from == str(run / "pretrain")
    assert cfg.sft.data.files == [str(Path("d") / "sft")] and cfg.sft.optim.lr == 0.003
    assert (cfg.eval.model, cfg.eval.shards_dir, cfg.eval.data_dir) == (str(run / "sft" / "final"),
                                                                        str(run / "shards"), str(Path("d") / "eval"))
    assert cfg.eval.limit == 10 and cfg.eval.seq_len == 64 and "val_loss" in cfg.eval.tasks
    # the resolved speedrun.yaml holds every stage's whole config and loads back to the same one
    assert load_speedrun_config(str(save_resolved(cfg, tmp_path / "speedrun.yaml"))) == cfg
    packaged = load_speedrun_config("cpu")
    assert packaged.pretrain.train.steps == 800 and packaged.eval.tasks == ["val_loss", "arc_easy", "hellaswag", "mmlu", "induction"]


@pytest.mark.parametrize("overrides, message", [
    (["--pretrain.train.stpes=10"], r"unknown key in section 'pretrain.train' 'stpes' \(did you mean 'steps'\?\)"),
    (["--pretrain.optimizer.lr=1"], r"unknown section in 'pretrain' 'optimizer' \(did you mean 'optim'\?\)"),
    (["--sft.sft.init=x"], r"unknown key in section 'sft.sft' 'init' \(did you mean 'init_from'\?\)"),
    (["--eval.limt=5"], r"unknown key in section 'eval' 'limt' \(did you mean 'limit'\?\)"),
    (["--pretrian.train.steps=5"], r"unknown config key 'pretrian' \(did you mean 'pretrain'\?\)"),
    (["--pretrain.train.steps=1"], r"schedule.warmup_steps=2 exceeds train.steps=1"),
    (["--eval.tasks=[arc_easy, trivia]"], r"unknown or no tasks \['trivia'\]"),
    (["--pretrain.train.out_dir=elsewhere"], r"out_dir='elsewhere': the speedrun sets it to .*; change out_dir"),
])
def test_speedrun_typos_fail_at_load_time(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_speedrun_config(str(mini_speedrun(tmp_path)), overrides)


def test_speedrun_typo_in_the_yaml_fails_at_load_time(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown key in section 'eval' 'batchsize' \(did you mean 'batch_size'"):
        load_speedrun_config(str(mini_speedrun(tmp_path, batchsize=8)))


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace the library call behind serve, eval and speedrun with one that records its config."""
    calls: list = []
    for module, name in [(tokenmind.serve, "run_server"), (tokenmind.eval.runner, "run_eval"),
                         (tokenmind.speedrun, "speedrun")]:
        monkeypatch.setattr(module, name, lambda cfg, *args, **kwargs: calls.append(cfg) or 0)
    monkeypatch.delenv("TOKENMIND_API_KEY", raising=False)
    return calls


def test_serve_flags_keep_their_defaults_and_override_the_yaml(tmp_path: Path, captured: list,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["serve", "--model", "smollm2"]) == 0
    assert captured[-1] == ServeConfig(model="smollm2", kv_cache_bytes=512 << 20)  # the CLI's own KV budget
    path = tmp_path / "serve.yaml"
    path.write_text("model: smollm2\nport: 9000\nhost: 0.0.0.0\nmax_num_seqs: 8\nshutdown_timeout: 5\n"
                    "cors_origins: [http://a]\nkv_cache_bytes: null\n")
    assert main(["serve", "--config", str(path), "--port", "9100", "--kv-cache-mb", "64", "--max-queue-wait", "0",
                 "--max-body-mb", "2", "--allowed-hosts", "a.example, b.example", "--quantize", "int8"]) == 0
    cfg = captured[-1]
    assert (cfg.model, cfg.host, cfg.port, cfg.max_num_seqs, cfg.shutdown_timeout) == ("smollm2", "0.0.0.0", 9100, 8, 5)
    assert (cfg.kv_cache_bytes, cfg.max_queue_wait, cfg.max_body_bytes) == (64 << 20, None, 2 << 20)
    assert cfg.allowed_hosts == ["a.example", "b.example"] and cfg.cors_origins == ["http://a"]
    assert cfg.quantization == "int8"
    assert main(["serve", "--config", str(path)]) == 0 and captured[-1].kv_cache_bytes is None  # YAML null: auto
    monkeypatch.setenv("TOKENMIND_API_KEY", "from-env")
    assert main(["serve", "--model", "m"]) == 0 and captured[-1].api_key == "from-env"
    assert main(["serve", "--model", "m", "--api-key", "flag"]) == 0 and captured[-1].api_key == "flag"


def test_serve_config_errors_exit_2_naming_the_key(tmp_path: Path, captured: list,
                                                  capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("model: m\nmax_num_seq: 4\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "unknown config key 'max_num_seq' (did you mean 'max_num_seqs'?)" in capsys.readouterr().err
    assert main(["serve"]) == 2 and "model is not set" in capsys.readouterr().err
    assert not captured


def test_every_serve_and_eval_flag_fills_a_config_field() -> None:
    parsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command, schemas in [("serve", (ServeConfig, RouterConfig)), ("eval", (EvalConfig,))]:
        dests = {a.dest for a in parsers[command]._actions} - {"help", "config"}
        assert dests <= {f.name for schema in schemas for f in fields(schema)}, command


def test_eval_config_file_and_flags(tmp_path: Path, captured: list, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "eval.yaml"
    path.write_text("model: tiny\ntasks: [arc_easy, hellaswag]\nlimit: 50\nseed: 2\nprogress: false\n")
    assert main(["eval", "--config", str(path), "--limit", "5", "--tasks", "gsm8k,mmlu", "--log-samples"]) == 0
    assert captured[-1] == EvalConfig(model="tiny", tasks=["gsm8k", "mmlu"], limit=5, seed=2, progress=False,
                                      log_samples=True)
    assert main(["eval", "--model", "m"]) == 0 and captured[-1] == EvalConfig(model="m")
    path.write_text("tasks: [arc_easy]\n")
    assert main(["eval", "--config", str(path)]) == 2  # nothing is evaluated by default
    assert "no model to evaluate: pass --model MODEL or set `model:`" in capsys.readouterr().err


def test_speedrun_command_line_overrides(tmp_path: Path, captured: list, capsys: pytest.CaptureFixture) -> None:
    path = mini_speedrun(tmp_path)
    assert main(["speedrun", "--config", str(path), "--pretrain.train.steps=6", "eval.limit=3",
                 "--out-dir", str(tmp_path / "other")]) == 0
    cfg = captured[-1]
    assert cfg.pretrain.train.steps == 6 and cfg.eval.limit == 3 and cfg.out_dir == str(tmp_path / "other")
    assert cfg.pretrain.train.out_dir == str(tmp_path / "other" / "pretrain")
    assert main(["speedrun"]) == 0 and captured[-1] == load_speedrun_config("cpu")
    assert main(["speedrun", "--pretrain.trian.steps=6"]) == 2
    assert "unknown section in 'pretrain' 'trian' (did you mean 'train'?)" in capsys.readouterr().err
    assert isinstance(captured[-1], SpeedrunConfig) and len(captured) == 2


@pytest.mark.parametrize("native, want", [(True, "bf16"), (False, "fp32")])
def test_auto_precision_is_bf16_only_where_the_cpu_computes_it(monkeypatch, native, want):
    """Emulated bf16 made a speedrun-sized training step 23x slower than fp32 on an AVX2 CPU."""
    import tokenmind.model.cpu as cpu
    from tokenmind.train.config import TrainSection

    monkeypatch.setattr(cpu, "cpu_has_native_bf16", lambda: native)
    assert TrainSection(device="cpu").precision == want  # the default is auto, saved resolved
    assert TrainSection(device="cpu", precision="bf16").precision == "bf16"  # a named precision stays
