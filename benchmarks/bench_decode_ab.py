"""Batch-1 (or batch-B) engine decode steps of two versions of tokenmind in one process, steps alternated.

On a shared machine the load moves a step's time by tens of percent between runs, far more than a
change to the step's per-op overhead saves; alternating single steps of the two versions inside one
process exposes both to the same load. The `--base` version is `git archive`d into a temporary
directory under another package name (tokenmind's modules import each other relatively), the
working tree is the other side; both load the same model and decode the same random prompts greedily.

Per side: `aten_calls_per_step` (ATen operators one all-decode step dispatches, counted with a
dispatch mode: independent of load), the median wall time and the median thread CPU time of a
step (`time.thread_time`: the time this thread ran, which a busy neighbour inflates less than wall
time), and whether both sides generated the same tokens. Prints JSON.

    python benchmarks/bench_decode_ab.py --base HEAD~1 [--scheme int4] [--batch 1] [--steps 100]
"""

from __future__ import annotations

import argparse
import importlib
import io
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import aten_calls, emit, machine_info  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BASE_PACKAGE = "tokenmind_base"


def export_base(ref: str, into: Path) -> None:
    """src/tokenmind at git `ref` as the package `tokenmind_base` under `into`."""
    data = subprocess.run(["git", "archive", ref, "src/tokenmind"], cwd=REPO, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    shutil.move(into / "src" / "tokenmind", into / BASE_PACKAGE)


def make_side(package: str, args, prompts: list[list[int]]) -> dict:
    load = importlib.import_module(f"{package}.model.load")
    llm = importlib.import_module(f"{package}.engine.llm")
    sampling = importlib.import_module(f"{package}.engine.sampling")
    pre = load.load_model(args.model, quantize=None if args.scheme == "fp32" else args.scheme)
    engine = llm.LLM(pre, max_num_seqs=args.batch).engine
    params = sampling.SamplingParams(max_tokens=args.steps + 4, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    side = {"engine": engine, "ids": ids, "tokens": {}, "wall": [], "cpu": []}
    step(side)  # the prompts
    step(side)
    side["aten"] = aten_calls(lambda: step(side))
    return side


def step(side: dict) -> None:
    for out in side["engine"].step():
        side["tokens"][out.request_id] = list(out.token_ids)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="git ref of the other side, e.g. HEAD~1")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--scheme", default="int4", choices=("fp32", "int8", "int4"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40_000, (args.batch, args.prompt_len), generator=gen).tolist()
    result = {"benchmark": "decode_ab", "base": args.base, "scheme": args.scheme, "batch": args.batch,
              "steps": args.steps, "machine": machine_info(threads=args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        export_base(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        sides = {"base": make_side(BASE_PACKAGE, args, prompts), "working_tree": make_side("tokenmind", args, prompts)}
        for i in range(args.steps):
            for name in ("base", "working_tree") if i % 2 == 0 else ("working_tree", "base"):
                side = sides[name]
                t0, c0 = time.perf_counter(), time.thread_time()
                step(side)
                side["cpu"].append(time.thread_time() - c0)
                side["wall"].append(time.perf_counter() - t0)
        for side in sides.values():
            while side["engine"].has_unfinished():
                step(side)
    for name, side in sides.items():
        result[name] = {"aten_calls_per_step": side["aten"],
                        "step_wall_ms": round(1e3 * statistics.median(side["wall"]), 2),
                        "step_cpu_ms": round(1e3 * statistics.median(side["cpu"]), 2)}
    base, new = result["base"], result["working_tree"]
    result["cpu_ratio_working_tree_over_base"] = round(new["step_cpu_ms"] / base["step_cpu_ms"], 3)
    result["wall_ratio_working_tree_over_base"] = round(new["step_wall_ms"] / base["step_wall_ms"], 3)
    result["same_tokens"] = ([sides["base"]["tokens"][i] for i in sides["base"]["ids"]]
                             == [sides["working_tree"]["tokens"][i] for i in sides["working_tree"]["ids"]])
    result["machine"]["loadavg_1m_end"] = machine_info()["loadavg_1m"]
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
