"""fp32 matmul GFLOP/s with MKL's stock kernel choice vs the Intel kernels tokenmind selects on AMD CPUs.

`import tokenmind` loads `model/mkl_intel_path.c` before PyTorch on AMD CPUs
(`model/cpu.py:take_mkl_intel_kernels`); `TOKENMIND_MKL_INTEL_PATH=0` keeps MKL's own choice. The two
sides must run in separate processes (the choice is made when PyTorch loads), so each repeat starts one
fresh child per side, alternating which goes first, and medians are reported. The shapes are the
matmuls tokenmind's CPU work spends its time in: a DiT training step (batch 32 × 49 patches, width 192),
SmolLM2-135M prefill / training (512 tokens, width 576, MLP 1536) and a square 2048 one. Each timed
call writes a fresh output tensor, as model code does (into a preallocated `out=` the stock choice ran
as fast on one thread, in one run on the AMD EPYC). Each child also reports its largest relative error
against a float64 product, so a faster path that were less accurate would show.

    python benchmarks/bench_mkl_path.py [--threads 1 2] [--repeats 3] [--out bench_mkl_path.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, machine_info  # noqa: E402  (imports tokenmind before torch: where the kernels are chosen)

SHAPES = [  # (m, k, n, what)
    (1568, 192, 576, "DiT qkv, batch 32"),
    (1568, 192, 768, "DiT MLP up"),
    (1568, 768, 192, "DiT MLP down"),
    (512, 576, 1536, "SmolLM2 gate/up, 512 tokens"),
    (512, 1536, 576, "SmolLM2 down"),
    (2048, 2048, 2048, "square"),
]


def side(threads: int, iters: int) -> dict:
    """One child's measurements: GFLOP/s per shape (median of `iters` calls), max relative error vs float64."""
    import torch
    from tokenmind.model.cpu import mkl_intel_kernels_taken

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for m, k, n, _ in SHAPES:
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        out = a @ b
        exact = a.double() @ b.double()
        err = ((out.double() - exact).abs().max() / exact.abs().max()).item()
        seconds = []
        for _ in range(iters):
            t0 = time.perf_counter()
            torch.mm(a, b)  # a fresh output, as model code gets
            seconds.append(time.perf_counter() - t0)
        rows.append({"gflops": 2 * m * k * n / statistics.median(seconds) / 1e9, "max_rel_err": err})
    return {"mkl_intel_kernels": mkl_intel_kernels_taken(), "rows": rows}


def run(args: argparse.Namespace) -> dict:
    results = []
    for threads in args.threads:
        runs: dict[str, list[dict]] = {"stock": [], "intel": []}
        for r in range(args.repeats):
            for name in (("stock", "intel") if r % 2 == 0 else ("intel", "stock")):
                env = dict(os.environ, TOKENMIND_MKL_INTEL_PATH="0" if name == "stock" else "1",
                           OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
                out = subprocess.run([sys.executable, __file__, "--side", str(threads), "--iters", str(args.iters)],
                                     env=env, capture_output=True, text=True, check=True)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for i, (m, k, n, what) in enumerate(SHAPES):
            stock = statistics.median(x["rows"][i]["gflops"] for x in runs["stock"])
            intel = statistics.median(x["rows"][i]["gflops"] for x in runs["intel"])
            results.append({"threads": threads, "m": m, "k": k, "n": n, "what": what,
                            "stock_gflops": round(stock, 1), "intel_gflops": round(intel, 1),
                            "speedup": round(intel / stock, 3),
                            "max_rel_err_stock": max(x["rows"][i]["max_rel_err"] for x in runs["stock"]),
                            "max_rel_err_intel": max(x["rows"][i]["max_rel_err"] for x in runs["intel"])})
    taken = {name: [x["mkl_intel_kernels"] for x in xs] for name, xs in runs.items()}
    return {"benchmark": "bench_mkl_path", "rows": results, "intel_kernels_taken": taken,
            "geomean_speedup": {t: round(statistics.geometric_mean(r["speedup"] for r in results if r["threads"] == t),
                                         3) for t in args.threads},
            "machine": machine_info(note="each side in fresh child processes, alternating; medians")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=15, help="timed calls per shape in each child")
    p.add_argument("--side", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/bench_mkl_path.json")
    args = p.parse_args()
    if args.side:
        print(json.dumps(side(args.side, args.iters)))
        return
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
