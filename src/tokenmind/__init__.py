"""tokenmind: a full-stack LLM system in PyTorch, from text to a served, chatting model.

The front door, as vLLM's is:

    from tokenmind import LLM, SamplingParams, load_model

    llm = LLM("smollm2")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0].text)

Names are imported on first use, so `import tokenmind` (and the CLI's start-up) does not pay for
torch until something needs it. On AMD CPUs it first points MKL at its faster kernels
(`model/cpu.py:take_mkl_intel_kernels`), which only works before torch is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tokenmind.model.cpu import take_mkl_intel_kernels

__version__ = "0.1.0"

take_mkl_intel_kernels()  # before anything imports torch: MKL's fast fp32 kernels on AMD CPUs

_EXPORTS = {
    # models
    "load_model": "tokenmind.model.load",
    "load_tokenizer": "tokenmind.model.load",
    "save_model": "tokenmind.model.load",
    "Pretrained": "tokenmind.model.load",
    "ModelConfig": "tokenmind.model.config",
    "Transformer": "tokenmind.model.transformer",
    "Tokenizer": "tokenmind.tokenizer",
    # generation
    "LLM": "tokenmind.engine.llm",
    "Engine": "tokenmind.engine.llm",
    "AsyncEngine": "tokenmind.engine.async_engine",
    "EngineConfig": "tokenmind.engine.config",
    "SamplingParams": "tokenmind.engine.sampling",
    "SpeculativeConfig": "tokenmind.engine.speculative",
    "ChatSession": "tokenmind.chat",
    "complete": "tokenmind.chat",
    # training
    "pretrain": "tokenmind.train",
    "Trainer": "tokenmind.train",
    "sft": "tokenmind.posttrain",
    # evaluation and serving
    "EvalConfig": "tokenmind.eval.runner",
    "run_eval": "tokenmind.eval.runner",
    "ServeConfig": "tokenmind.serve",
    "run_server": "tokenmind.serve",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokenmind' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from tokenmind.chat import ChatSession, complete
    from tokenmind.engine.async_engine import AsyncEngine
    from tokenmind.engine.config import EngineConfig
    from tokenmind.engine.llm import LLM, Engine
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.engine.speculative import SpeculativeConfig
    from tokenmind.eval.runner import EvalConfig, run_eval
    from tokenmind.model.config import ModelConfig
    from tokenmind.model.load import Pretrained, load_model, load_tokenizer, save_model
    from tokenmind.model.transformer import Transformer
    from tokenmind.posttrain import sft
    from tokenmind.serve import ServeConfig, run_server
    from tokenmind.tokenizer import Tokenizer
    from tokenmind.train import Trainer, pretrain
