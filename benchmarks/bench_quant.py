"""Weight-only quantization on SmolLM2-135M: speed, perplexity and weight memory, fp32 vs int8 vs int4.

Variants (all from the same Q4_1 GGUF file):
  fp32       the file dequantized to float32 (tokenmind's default load)
  bf16       the same, whole model cast to bfloat16 (a reference for "is it the bf16 kernels?")
  int8       quantize_model(fp32, "int8"): per-channel int8, bf16 activations
  int4_g32   quantize_model(fp32, "int4", group_size=32)
  int4_g128  quantize_model(fp32, "int4", group_size=128)  (in_features 576 → zero-padded to 640)
  gguf_int4  quantize_from_gguf: the file's Q4_1 blocks copied into the int4 kernel (group 32, no
             requantization); the tied Q8_0 LM head requantized to per-channel int8
  gguf_int4_exact  the same in exact mode (fp32 activations and scales, LM head left fp32):
             perplexity only; it must equal fp32's, which checks the bit-exact Q4_1 mapping end to end
Every other quantized variant quantizes the LM head (the embedding itself stays fp32).

Measures, as medians of interleaved repeats: batch-1 greedy decode tok/s (`engine.generate`, 128
new tokens after a short prompt) and 512-token prefill tok/s (last-position logits only); once:
perplexity on a held-out English text and the bytes held by the weights. `--kernels` also times
one matmul over the whole SmolLM2 weight set at batch 1 for each kernel/dtype pair, and
`--crossover` the fused kernel against dequantize + bf16 F.linear as the row count grows, and
`--native` PyTorch's int4/int8 kernels (bf16 activations) against tokenmind's native ones
(model/native_kernels.c, float32 activations) over the whole weight set, as the row count grows:
what each layer's `native_max_rows` is set from.

    python benchmarks/bench_quant.py [--repeats 3] [--kernels] [--crossover 1,16,64,128] [--native 1,2,4,16,64]
                                     [--out f.json]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info, timed  # noqa: E402

VARIANTS = ("fp32", "bf16", "int8", "int4_g32", "int4_g128", "gguf_int4", "gguf_int4_exact")
PPL_ONLY = {"gguf_int4_exact"}  # its fp32 int4 kernel is far too slow to be worth timing


def default_text() -> Path:
    # CPython's LICENSE.txt: ~14 KB of English prose (the history of Python, then the license texts),
    # present in every CPython install and not part of the benchmark's inputs anywhere else.
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


@torch.inference_mode()
def perplexity(model, token_ids: list[int], seq_len: int = 512, stride: int = 512) -> float:
    """exp(mean next-token NLL) over windows of `seq_len` tokens, `stride` apart; each token is scored
    once, by the first window that contains it with context (stride < seq_len gives overlap context)."""
    ids = torch.tensor(token_ids)
    nll, count, scored_until = 0.0, 0, 1  # the first token has no prediction
    for begin in range(0, len(ids) - 1, stride):
        end = min(begin + seq_len, len(ids))
        logits = model(ids[None, begin:end])[0].float()
        first = max(scored_until, begin + 1)
        logprobs = torch.log_softmax(logits[first - begin - 1:end - begin - 1], dim=-1)
        nll -= logprobs.gather(-1, ids[first:end, None]).sum().item()
        count += end - first
        scored_until = end
        if end == len(ids):
            break
    return math.exp(nll / count)




def build_variants(names, pretrained, path):
    from tokenmind.model.gguf import read_gguf
    from tokenmind.model.quant import quantize_from_gguf, quantize_model

    fp32 = pretrained.model
    makers = {
        "fp32": lambda: fp32,
        "bf16": lambda: copy.deepcopy(fp32).to(torch.bfloat16),
        "int8": lambda: quantize_model(copy.deepcopy(fp32), "int8"),
        "int4_g32": lambda: quantize_model(copy.deepcopy(fp32), "int4", group_size=32),
        "int4_g128": lambda: quantize_model(copy.deepcopy(fp32), "int4", group_size=128),
        "gguf_int4": lambda: quantize_from_gguf(copy.deepcopy(fp32), read_gguf(path)),
        "gguf_int4_exact": lambda: quantize_from_gguf(copy.deepcopy(fp32), read_gguf(path),
                                                      compute_dtype=torch.float32, quantize_lm_head=False),
    }
    models, build_s = {}, {}
    for name in names:
        t0 = time.perf_counter()
        models[name] = makers[name]()
        build_s[name] = round(time.perf_counter() - t0, 2)
    return models, build_s


def kernel_table(model, repeats: int) -> dict:
    """Batch-1 matmul over every linear weight of `model` (fp32), per kernel and activation dtype."""
    from tokenmind.model.quant import Int4Linear, Int8Linear

    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    q8 = {dt: [Int8Linear.from_float(w, compute_dtype=dt) for w in weights] for dt in (torch.float32, torch.bfloat16)}
    q4 = {(g, dt): [Int4Linear.from_float(w, group_size=g, compute_dtype=dt) for w in weights]
          for g, dt in [(32, torch.bfloat16), (32, torch.float32), (128, torch.bfloat16)]}
    bf16 = [w.bfloat16() for w in weights]

    def kernels(mods, dt):
        xs = [torch.randn(1, m.padded_in, dtype=dt) for m in mods]
        return lambda: [m._kernel(x) for m, x in zip(mods, xs)]

    def linear(ws):
        xs = [torch.randn(1, w.shape[1], dtype=w.dtype) for w in ws]
        return lambda: [F.linear(x, w) for x, w in zip(xs, ws)]

    fns = {"fp32_F.linear": linear(weights), "bf16_F.linear": linear(bf16),
           "int8pack_bf16": kernels(q8[torch.bfloat16], torch.bfloat16),
           "int8pack_fp32": kernels(q8[torch.float32], torch.float32),
           "int4pack_g32_bf16": kernels(q4[32, torch.bfloat16], torch.bfloat16),
           "int4pack_g128_bf16": kernels(q4[128, torch.bfloat16], torch.bfloat16),
           "int4pack_g32_fp32": kernels(q4[32, torch.float32], torch.float32)}  # fmt: skip
    return {"ms_per_weight_set_batch1": medians(fns, repeats, scale=1e3)}


def crossover_table(models, rows_list, repeats: int) -> dict:
    """Fused kernel vs dequantize + F.linear over all quantized linears, for each row count."""
    from tokenmind.model.quant import QuantizedLinear

    out = {}
    for name, model in models.items():
        mods = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        if not mods:
            continue
        saved = [m.kernel_max_rows for m in mods]
        per_rows = {}
        for rows in rows_list:
            xs = [torch.randn(rows, m.in_features) for m in mods]

            def run(limit, xs=xs):
                def fn():
                    for m, x in zip(mods, xs):
                        m.kernel_max_rows = limit
                        m(x)
                return fn

            per_rows[rows] = medians({"kernel": run(10**9), "dequant_F.linear": run(0)}, repeats, scale=1e3)
        for m, s in zip(mods, saved):
            m.kernel_max_rows = s
        out[name] = {"ms": per_rows, "kernel_max_rows_in_use": saved[0]}
    return out


def native_table(model, rows_list, repeats: int) -> dict:
    """PyTorch's kernel (bf16 activations) vs the native kernel (fp32) over every linear, per row count."""
    from tokenmind.model import native
    from tokenmind.model.quant import Int4Linear, Int8Linear

    if not native.available():
        return {"skipped": "the native kernels do not run here (no AVX2 or no C compiler)"}
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    layers = {"int4_g32": [Int4Linear.from_float(w) for w in weights], "int8": [Int8Linear.from_float(w) for w in weights]}
    layers = {name: [m for m in mods if m._native_ready()] for name, mods in layers.items()}
    out = {}
    for rows in rows_list:
        fns = {}
        for name, mods in layers.items():
            xs = [torch.randn(rows, m.padded_in) for m in mods]
            fns[f"{name}/pytorch_bf16"] = lambda mods=mods, xs=[x.bfloat16() for x in xs]: [
                m._kernel(x) for m, x in zip(mods, xs)]
            fns[f"{name}/native_fp32"] = lambda mods=mods, xs=xs: [m._native_kernel(x) for m, x in zip(mods, xs)]
        ms = medians(fns, repeats, scale=1e3)
        out[rows] = {**ms, **{f"{name}/speedup": round(ms[f"{name}/pytorch_bf16"] / ms[f"{name}/native_fp32"], 2)
                              for name in layers}}
    return {"ms_per_weight_set": out}


@torch.inference_mode()
def medians(fns: dict, repeats: int, scale: float = 1.0) -> dict:
    for fn in fns.values():  # warm-up
        fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(timed(fn))
    return {k: round(statistics.median(v) * scale, 2) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--text", default=None, help="perplexity text file (default: CPython's LICENSE.txt)")
    ap.add_argument("--ppl-seq-len", type=int, default=512)
    ap.add_argument("--no-ppl", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="also time each matmul kernel/dtype at batch 1")
    ap.add_argument("--crossover", default="", help="row counts for kernel vs dequant timing, e.g. 1,16,64,128")
    ap.add_argument("--native", default="", help="row counts for PyTorch's vs the native kernels, e.g. 1,2,4,16")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [v for v in args.variants.split(",") if v]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.model.quant import weight_bytes
    from tokenmind.model.load import Pretrained, load_model, resolve_model_path

    path = resolve_model_path(args.model)
    pretrained = load_model(path)
    tokenizer = pretrained.tokenizer
    models, build_s = build_variants(names, pretrained, path)

    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(100, pretrained.model.cfg.vocab_size, (1, args.prompt_len), generator=gen)
    short_prompt = tokenizer.encode("The history of the printing press begins")
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}

    def prefill(model):
        return lambda: model.logits(model.hidden_states(long_prompt)[:, -1])

    def decode(name, model):
        llm = LLM(Pretrained(model, tokenizer, path), max_num_seqs=1,
                  max_model_len=len(short_prompt) + args.decode_tokens + 1)

        def fn():
            outputs[name] = llm.generate(short_prompt, params)[0].token_ids
            assert len(outputs[name]) == args.decode_tokens
        return fn

    fns = {}
    for name, model in models.items():
        if name in PPL_ONLY:
            continue
        fns[f"{name}/prefill"] = prefill(model)
        fns[f"{name}/decode"] = decode(name, model)
    secs = medians(fns, args.repeats)

    text_path = Path(args.text) if args.text else default_text()
    ppl_ids = tokenizer.encode(text_path.read_text(encoding="utf-8"))
    results = {}
    for name, model in models.items():
        res = {"weight_bytes": weight_bytes(model), "build_s": build_s[name]}
        if name not in PPL_ONLY:
            res["prefill_tok_s"] = round(args.prompt_len / secs[f"{name}/prefill"], 1)
            res["decode_tok_s"] = round(args.decode_tokens / secs[f"{name}/decode"], 1)
        if "fp32" in outputs and name in outputs and name != "fp32":
            same = [a == b for a, b in zip(outputs[name], outputs["fp32"])]
            res["greedy_tokens_equal_to_fp32"] = f"{sum(same)}/{len(same)}"
            res["greedy_common_prefix_with_fp32"] = next((i for i, s in enumerate(same) if not s), len(same))
        if not args.no_ppl:
            t0 = time.perf_counter()
            res["perplexity"] = round(perplexity(model, ppl_ids, args.ppl_seq_len, args.ppl_seq_len), 4)
            res["perplexity_s"] = round(time.perf_counter() - t0, 1)
        results[name] = res
    if "fp32" in results:
        base = results["fp32"]
        for res in results.values():
            if "decode_tok_s" in res:
                res["decode_speedup_vs_fp32"] = round(res["decode_tok_s"] / base["decode_tok_s"], 2)
                res["prefill_speedup_vs_fp32"] = round(res["prefill_tok_s"] / base["prefill_tok_s"], 2)
            if "perplexity" in res:
                res["perplexity_change_vs_fp32_pct"] = round(100 * (res["perplexity"] / base["perplexity"] - 1), 3)

    report = {
        "benchmark": "weight_only_quantization",
        "model": path.name,
        "threads": torch.get_num_threads(),
        "machine": machine_info(cpu_capability=torch.backends.cpu.get_cpu_capability()),
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "repeats": args.repeats,
        "perplexity_text": {"path": str(text_path), "tokens": len(ppl_ids), "seq_len": args.ppl_seq_len,
                            "stride": args.ppl_seq_len},
        "variants": results,
    }
    if args.kernels:
        report["kernels"] = kernel_table(pretrained.model, max(args.repeats, 5))
    if args.native:
        report["native"] = native_table(pretrained.model, [int(r) for r in args.native.split(",")],
                                        max(args.repeats, 5))
    if args.crossover:
        rows = [int(r) for r in args.crossover.split(",")]
        report["crossover"] = crossover_table({k: v for k, v in models.items() if k not in ("fp32", "bf16")}, rows,
                                              args.repeats)
    emit(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
