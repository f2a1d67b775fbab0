"""Cold start: from a shell command to the first generated token, tokenmind beside llama.cpp, same GGUF.

What a user waits for when they type a one-shot command:

- tokenmind: `tokenmind generate --model MODEL --max-tokens 1 "Hi"` with no other flags (the defaults
  are the fast path: a GGUF's quantized blocks run quantized), timed from spawn to exit; the load time
  it prints is reported too, and `python -c "import torch"` as the floor every PyTorch program pays.
- llama.cpp: its C++ `llama-server` (built once by `bash benchmarks/setup_llama_server.sh`), timed
  from spawn to the answer of a 1-token `/completion` request (so its HTTP start-up is included,
  and the time to tear it down is not). Its `ready_s` is spawn to a healthy server.

Every repeat is a fresh process with the model file in the page cache (one untimed warm-up run per
side first); sides alternate so noise hits all alike; medians are reported. Prints JSON.

    python benchmarks/bench_coldstart.py [--model smollm2] [--repeats 5] [--out result.json]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, free_port, llama_server_binary, machine_info  # noqa: E402

PROMPT = "Hi"


def tokenmind_run(model: str) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "tokenmind.cli", "generate", "--model", model, "--max-tokens", "1",
                          PROMPT], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"tokenmind generate failed ({out.returncode}): {out.stderr[-2000:]}")
    loaded = re.search(r"loaded .*\((.*)\) in ([\d.]+)s", out.stderr)
    return {"wall_s": wall, "load_s": float(loaded[2]), "settings": loaded[1]}


def import_torch_run() -> dict:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return {"wall_s": time.perf_counter() - t0}


def llama_server_run(binary: Path, model: Path, threads: int) -> dict:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(binary), "-m", str(model), "-t", str(threads), "-c", "2048", "--no-webui",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:  # poll tightly: the start-up being measured is a fraction of a second
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with status {proc.returncode} while starting")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.005)
        ready = time.perf_counter() - t0
        reply = httpx.post(url + "/completion", json={"prompt": PROMPT, "n_predict": 1}, timeout=60)
        reply.raise_for_status()
        return {"wall_s": time.perf_counter() - t0, "ready_s": ready}
    finally:
        proc.terminate()
        proc.wait()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a .gguf file or alias (default smollm2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--llama-server", default=None, help="path of llama-server (default: the one "
                    "setup_llama_server.sh built for this CPU; skipped with a note if there is none)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    import torch

    from tokenmind.model.load import resolve_model_path

    threads = torch.get_num_threads()
    path = resolve_model_path(args.model)
    sides = {"import_torch": import_torch_run, "tokenmind": lambda: tokenmind_run(args.model)}
    notes = []
    try:
        binary = llama_server_binary(args.llama_server)
        sides["llama-server"] = lambda: llama_server_run(binary, path, threads)
    except SystemExit as e:
        notes.append(f"llama-server skipped: {e}")

    for run in sides.values():  # warm-up: the file and the binaries into the page cache
        run()
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():
            runs[name].append(run())
    result = {"benchmark": "coldstart", "model": path.name, "prompt": PROMPT, "repeats": args.repeats,
              "machine": machine_info(threads=threads), "notes": notes, "median_s": {}}
    for name, rows in runs.items():
        result["median_s"][name] = {key: round(statistics.median(r[key] for r in rows), 3)
                                    for key in rows[0] if key != "settings"}
    result["tokenmind_settings"] = runs["tokenmind"][0]["settings"]
    ours = result["median_s"]["tokenmind"]["wall_s"]
    result["wall_ratio_vs"] = {name: round(ours / v["wall_s"], 2) for name, v in result["median_s"].items()
                               if name not in ("tokenmind", "import_torch")}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
