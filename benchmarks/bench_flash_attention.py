"""FlashAttention's tiling on CPU: peak memory vs sequence length, and speed against SDPA.

Three ways to compute causal attention forward + backward on (1, H, T, D):

* naive: scores = q·kᵀ materialised, masked, softmaxed, times v, autograd through it all —
  the (T, T) score, probability and gradient matrices per head: memory quadratic in T;
* tiled: `model/flash_attention.flash_attention` (online softmax over key tiles, backward by
  recomputation): memory linear in T;
* sdpa: `F.scaled_dot_product_attention(is_causal=True)`, PyTorch's fused C++ kernel (on CPU
  its own flash-style kernel), the model's default.

Memory: each (method, T) runs in a fresh subprocess that builds its inputs, records its peak
resident set (ru_maxrss), runs one forward + backward and reports the peak's growth — the
bytes that call needed at its high-water mark, as the OS saw them (glibc returns big blocks
to the OS on free, so the high-water mark is the live peak). Alongside, the largest single
intermediate each method allocates, by arithmetic: naive T·T per head, tiled block_q·block_k.
Speed: forward + backward, median of --repeats, in this process, tiled eager, tiled compiled
(`compile=True`; its one-off compile time reported apart) and SDPA.

    python benchmarks/bench_flash_attention.py [--lengths 512 1024 2048 4096] [--out bench_flash_attention.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from _common import emit, machine_info, timed
from tokenmind.model.flash_attention import flash_attention


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    T = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def methods(block: int, compile: bool) -> dict:
    return {"naive": naive_attention,
            "tiled": lambda q, k, v: flash_attention(q, k, v, block_q=block, block_k=block, compile=compile),
            "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}


def make_inputs(heads: int, T: int, dim: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, T, dim, generator=g).requires_grad_() for _ in range(3)]


def fwd_bwd(fn, q, k, v) -> None:
    fn(q, k, v).sum().backward()


def measure_memory(args: argparse.Namespace) -> dict:
    """The child: one method at one length, its peak RSS growth in MiB."""
    torch.set_num_threads(1)
    q, k, v = make_inputs(args.heads, args.T, args.dim)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fwd_bwd(methods(args.block, compile=False)[args.method], q, k, v)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_growth_mib": round((after - before) / 1024, 1)}


def memory_row(args: argparse.Namespace, method: str, T: int) -> float:
    cmd = [sys.executable, __file__, "--child", method, "--T", str(T), "--heads", str(args.heads),
           "--dim", str(args.dim), "--block", str(args.block)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_mib"]


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    mib = 2**20
    memory = []
    for T in args.lengths:
        row = {"T": T, "inputs_mib": round(3 * args.heads * T * args.dim * 4 / mib, 1),
               "largest_intermediate_mib": {"naive": round(args.heads * T * T * 4 / mib, 1),
                                            "tiled": round(args.heads * args.block * args.block * 4 / mib, 3)}}
        for method in ("naive", "tiled", "sdpa"):
            row[f"{method}_peak_growth_mib"] = memory_row(args, method, T)
        memory.append(row)
        print(json.dumps(row), file=sys.stderr)

    q, k, v = make_inputs(args.heads, args.speed_T, args.dim)
    compiled = methods(args.block, compile=True)
    compile_s = timed(lambda: fwd_bwd(compiled["tiled"], q, k, v))
    runners = {"tiled_eager": methods(args.block, compile=False)["tiled"], "tiled_compiled": compiled["tiled"],
               "sdpa": compiled["sdpa"]}
    for fn in runners.values():
        fwd_bwd(fn, q, k, v)
    seconds = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, fn in runners.items():
            seconds[name].append(timed(lambda: fwd_bwd(fn, q, k, v)))
    speed = {name: round(statistics.median(s) * 1000, 2) for name, s in seconds.items()}
    return {
        "benchmark": "flash_attention", "machine": machine_info(),
        "shape": {"batch": 1, "heads": args.heads, "head_dim": args.dim, "block_q": args.block, "block_k": args.block,
                  "dtype": "float32", "causal": True},
        "memory": memory,
        "speed": {"T": args.speed_T, "fwd_bwd_ms_median": speed, "repeats": args.repeats,
                  "tiled_compile_s": round(compile_s, 1),
                  "sdpa_speedup_over_tiled_compiled": round(speed["tiled_compiled"] / speed["sdpa"], 2)},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--speed-T", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    p.add_argument("--child", choices=["naive", "tiled", "sdpa"], dest="method")
    p.add_argument("--T", type=int)
    args = p.parse_args()
    if args.method:
        print(json.dumps(measure_memory(args)))
        return
    emit(run(args), args.out)


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"took {time.perf_counter() - t0:.0f} s", file=sys.stderr)
