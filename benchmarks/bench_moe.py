"""Decode speed of small mixtures of experts: tokenmind's paged engine vs `transformers`, same random weights.

Two MoE shapes with random weights (no checkpoint to fetch), each saved once as an HF directory
that both sides load:
- mixtral: 8 experts, top 2, each 2·hidden wide (Mixtral's renormalised top-k);
- qwen2_moe: 16 experts, top 4, each hidden/2 wide, plus a 2·hidden-wide shared expert behind its
  sigmoid gate (Qwen2-MoE), top-k weights not renormalised.
Both: hidden 256, 4 layers, 8 heads (4 KV heads), vocab 2048 by default.

tokenmind decodes through its `Engine` (continuous batching over the paged KV cache, prefix
caching off so repeats cannot reuse a prompt); transformers through `generate` with its KV cache.
Both fp32 and greedy, on the same `--batch`-many prompts of `--prompt-len` random tokens, `--new-tokens`
each, at batch 1 (the first prompt) and at `--batch`. decode_tok_s = generated tokens / wall time of
the whole generate call (the short prompt's prefill included). `same_tokens`: whether the two
sides' greedy tokens agree. `aten_calls_per_step`: how many ATen operators one decode step of
tokenmind's engine dispatches (counted with a dispatch mode, so independent of the machine's load:
per-op dispatch is what a batch-1 step of a model this small spends most of its time on). flops_per_token is a token's forward FLOPs counting only its top-k
experts (2 × active matmul parameters + attention at the mean context: `train.metrics.flops_per_token`
/ 3), and gflop_s = flops_per_token × decode_tok_s. Repeats alternate sides; medians. Prints JSON.

    python benchmarks/bench_moe.py [--threads 2] [--repeats 3] [--batch 4] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import aten_calls, emit, machine_info, timed  # noqa: E402


def moe_config(kind: str, hidden: int, layers: int, vocab: int):
    from tokenmind.model.config import ModelConfig

    shape = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6)
    if kind == "mixtral":
        return ModelConfig(**shape, model_type="mixtral", intermediate_size=2 * hidden, num_experts=8,
                           num_experts_per_tok=2)
    return ModelConfig(**shape, model_type="qwen2_moe", qkv_bias=True, intermediate_size=2 * hidden, num_experts=16,
                       num_experts_per_tok=4, moe_intermediate_size=hidden // 2,
                       shared_expert_intermediate_size=2 * hidden, norm_topk_prob=False)


def build_pair(cfg, model_dir: Path, seed: int):
    """Random weights saved as an HF directory, loaded by tokenmind and by transformers."""
    import transformers

    from tokenmind.model.checkpoint import load_hf_dir, save_hf_dir
    from tokenmind.model.transformer import Transformer

    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights(std=0.05)
    with torch.no_grad():  # spread the routers' scores, as trained routers do (no near-uniform top-k)
        for layer in model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    save_hf_dir(model, model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # generate exactly n tokens
    return load_hf_dir(model_dir), hf


def tokenmind_generate(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from tokenmind.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    return [finals[i] for i in ids]


def aten_calls_per_step(engine, prompts: list[list[int]]) -> int:
    """ATen operators dispatched by one engine step in which every prompt decodes one token."""
    from tokenmind.engine.sampling import SamplingParams

    ids = [engine.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in prompts]
    engine.step()  # the prompts
    calls = aten_calls(engine.step)
    for request_id in ids:
        engine.abort(request_id)
    return calls


def hf_generate(hf, prompts: list[list[int]], n: int) -> list[list[int]]:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    assert out.shape[1] == ids.shape[1] + n
    return out[:, ids.shape[1]:].tolist()


def bench_config(kind: str, args, work: Path) -> dict:
    from tokenmind.engine.config import EngineConfig
    from tokenmind.engine.llm import Engine
    from tokenmind.train.metrics import flops_per_token

    cfg = moe_config(kind, args.hidden_size, args.layers, args.vocab)
    ours, hf = build_pair(cfg, work / kind, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen).tolist()
    n = args.new_tokens
    flops = flops_per_token(cfg, args.prompt_len + n // 2) / 3  # forward only, mean context
    result = {"config": {k: getattr(cfg, k) for k in (
        "model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "shared_expert_intermediate_size")},
        "parameters": cfg.num_parameters, "active_parameters": cfg.num_active_parameters,
        "flops_per_token": round(flops)}
    for batch in sorted({1, args.batch}):
        engine = Engine(ours, config=EngineConfig(max_num_seqs=batch, kv_cache_bytes=64 * 2**20,
                                                  enable_prefix_caching=False))
        sides = {"tokenmind": lambda b=batch, e=engine: tokenmind_generate(e, prompts[:b], n),
                 "transformers": lambda b=batch: hf_generate(hf, prompts[:b], n)}
        tokens = {side: fn() for side, fn in sides.items()}  # warm-up, and the tokens compared
        times: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.repeats):
            for side, fn in sides.items():
                times[side].append(timed(fn))
        rates = {side: round(batch * n / statistics.median(t), 1) for side, t in times.items()}
        result[f"batch_{batch}"] = {
            "decode_tok_s": rates,
            # three significant digits, not two decimals: a tiny run under load is well under 0.01 GFLOP/s
            "gflop_s": {side: float(f"{rate * flops / 1e9:.3g}") for side, rate in rates.items()},
            "ratio_vs_transformers": round(rates["tokenmind"] / rates["transformers"], 2),
            "same_tokens": tokens["tokenmind"] == tokens["transformers"],
            "aten_calls_per_step": aten_calls_per_step(engine, prompts[:batch]),
        }
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="mixtral,qwen2_moe", help="comma-separated subset of mixtral,qwen2_moe")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="the small batch, beside batch 1")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"benchmark": "moe_decode", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "repeats": args.repeats, "machine": machine_info(threads=args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.configs.split(","):
            result[kind] = bench_config(kind, args, Path(tmp))
    result["machine"]["loadavg_1m_end"] = machine_info()["loadavg_1m"]
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
