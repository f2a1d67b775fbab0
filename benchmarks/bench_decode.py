"""Batch-1 prefill and decode speed on SmolLM2-135M: tokenmind (fp32, int8, int4) vs `transformers`
(fp32) vs llama.cpp, all on the same GGUF file.

- tokenmind fp32: the GGUF dequantized to float32 (`load_model(path)`); decoding runs through the engine
  as `tokenmind generate` builds it (`chat.interactive_llm`: one sequence, the paged block pool).
- tokenmind int8 / int4: `load_model(path, quantize=...)`; int4 copies the file's Q4_1 blocks
  into PyTorch's int4 kernel unchanged, so it runs the very weights llama.cpp runs (what the CLI
  runs with no flags).
- transformers: `from_pretrained(gguf_file=...)` in float32, `generate` greedy.
- llama.cpp: `llama-bench` (built by `bash benchmarks/setup_llama_server.sh`) on the file as shipped
  (Q4_1, Q8_0 embedding): pp512, tg128 from an empty context and tg128 after 512 tokens (`-d 512`);
  and the Python binding `llama-cpp-python` (`bash benchmarks/setup_peers.sh`) when it is built.
  Each is skipped with a note if absent.

All sides get the same token ids: a random `--prompt-len` prompt for prefill (time to the last
position's logits) and a short prompt followed by `--decode-tokens` greedy tokens for decode
(`decode_tok_s`: the whole generate call). `decode_after_prompt_tok_s` is the decode rate after the
long prompt, first token excluded (llama-bench's `-d`). Repeats alternate between sides so machine
noise hits all alike; medians are reported. Prints JSON.

    python benchmarks/bench_decode.py [--repeats 5] [--prompt-len 512] [--decode-tokens 128]
"""

from __future__ import annotations

import tokenmind  # noqa: F401  (before torch: MKL's Intel kernels on AMD CPUs, for both in-process sides)

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (PEER_SETUP, emit, llama_server_binary, machine_info, peer_python, run_llamacpp,  # noqa: E402
                     timed)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a .gguf file or alias (default smollm2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="threads for every side (default: torch's choice)")
    ap.add_argument("--sides", default="fp32,int8,int4,transformers,llama.cpp,llama-bench",
                    help="comma-separated subset of fp32,int8,int4,transformers,llama.cpp,llama-bench")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    sides = args.sides.split(",")

    from tokenmind.chat import StreamStats, interactive_llm
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.model.load import load_model, resolve_model_path

    path = resolve_model_path(args.model)
    load_s: dict[str, float] = {}
    ours = {}
    for scheme in ("fp32", "int8", "int4"):
        if scheme in sides:
            t0 = time.perf_counter()
            ours[scheme] = load_model(path, quantize=None if scheme == "fp32" else scheme)
            load_s[f"tokenmind_{scheme}"] = time.perf_counter() - t0
    any_ours = ours[next(iter(ours))] if ours else load_model(path)

    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(100, any_ours.model.cfg.vocab_size, (1, args.prompt_len), generator=gen)
    short_prompt = any_ours.tokenizer.encode("The history of the printing press begins")
    n = args.decode_tokens
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    fns: dict[str, tuple] = {}  # side → (prefill fn, decode fn)
    after_prompt: dict[str, Callable[[], float]] = {}  # side → decode tok/s after the long prompt
    for scheme, pre in ours.items():
        llm = interactive_llm(pre)  # the engine as `tokenmind generate` builds it

        def prefill(model=pre.model):
            with torch.inference_mode():
                model.logits(model.hidden_states(long_prompt)[:, -1])

        def decode(llm=llm):
            assert len(llm.generate(short_prompt, params)[0].token_ids) == n

        def decode_after_prompt(llm=llm) -> float:
            stats = StreamStats(args.prompt_len)
            for out in llm.stream(long_prompt[0].tolist(), params):
                stats.observe(out)
            assert stats.tokens == n
            return stats.decode_tokens_per_s

        fns[f"tokenmind_{scheme}"] = (prefill, decode)
        after_prompt[f"tokenmind_{scheme}"] = decode_after_prompt

    notes = []
    if "transformers" in sides:
        import transformers

        t0 = time.perf_counter()
        hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
        load_s["transformers_fp32"] = time.perf_counter() - t0
        hf.generation_config.eos_token_id = None  # generate exactly n tokens

        def hf_prefill():
            with torch.inference_mode():
                hf(long_prompt, logits_to_keep=1)

        def hf_decode():
            with torch.inference_mode():
                out = hf.generate(torch.tensor([short_prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
            assert out.shape[1] == len(short_prompt) + n

        fns["transformers_fp32"] = (hf_prefill, hf_decode)

    use_llama = "llama.cpp" in sides and peer_python() is not None
    if "llama.cpp" in sides and not use_llama:
        notes.append(f"llama.cpp skipped: its venv is missing; run `{PEER_SETUP}` once")

    for prefill, decode in fns.values():  # warm-up
        prefill()
        decode()
    times: dict[str, dict[str, list[float]]] = {k: {"prefill": [], "decode": []} for k in fns}
    after_prompt_rates: dict[str, list[float]] = {k: [] for k in after_prompt}
    if use_llama:
        times["llama.cpp_Q4_1"] = {"prefill": [], "decode": []}
    llama_version = None
    for _ in range(args.repeats):
        for side, (prefill, decode) in fns.items():
            times[side]["prefill"].append(timed(prefill))
            times[side]["decode"].append(timed(decode))
            if side in after_prompt:
                after_prompt_rates[side].append(after_prompt[side]())
        if use_llama:
            r = run_llamacpp({"model": str(path), "threads": threads, "long_prompt": long_prompt[0].tolist(),
                              "short_prompt": short_prompt, "decode_tokens": n})
            assert r["decoded"] == n, r
            times["llama.cpp_Q4_1"]["prefill"].append(r["prefill_s"])
            times["llama.cpp_Q4_1"]["decode"].append(r["decode_s"])
            load_s["llama.cpp_Q4_1"], llama_version = r["load_s"], r["llama_cpp"]

    prefill_tok_s = {k: round(args.prompt_len / statistics.median(v["prefill"]), 1) for k, v in times.items()}
    decode_tok_s = {k: round(n / statistics.median(v["decode"]), 1) for k, v in times.items()}
    after_prompt_tok_s = {k: round(statistics.median(v), 1) for k, v in after_prompt_rates.items()}
    if "llama-bench" in sides:
        try:
            bench = run_llama_bench(llama_server_binary().parent / "llama-bench", path, threads, args)
        except SystemExit as e:
            notes.append(f"llama-bench skipped: {e}")
        else:
            prefill_tok_s["llama-bench_Q4_1"] = bench["pp"]
            decode_tok_s["llama-bench_Q4_1"] = bench["tg"]
            after_prompt_tok_s["llama-bench_Q4_1"] = bench["tg_after_prompt"]
    result = {
        "benchmark": "decode_batch1",
        "model": path.name,
        "prompt_len": args.prompt_len,
        "decode_tokens": n,
        "repeats": args.repeats,
        "machine": machine_info(threads=threads, llama_cpp=llama_version),
        "load_s": {k: round(v, 2) for k, v in load_s.items()},
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": decode_tok_s,
        "decode_after_prompt_tok_s": after_prompt_tok_s,
    }
    if "llama-bench_Q4_1" in after_prompt_tok_s:
        peer_rate = after_prompt_tok_s["llama-bench_Q4_1"]
        result["decode_after_prompt_ratio_vs_llama-bench_Q4_1"] = {
            k: round(v / peer_rate, 2) for k, v in after_prompt_tok_s.items() if k.startswith("tokenmind")}
    for peer in ("transformers_fp32", "llama.cpp_Q4_1", "llama-bench_Q4_1"):
        if peer in decode_tok_s:
            result[f"decode_ratio_vs_{peer}"] = {k: round(v / decode_tok_s[peer], 2) for k, v in decode_tok_s.items()
                                                 if k.startswith("tokenmind")}
            result[f"prefill_ratio_vs_{peer}"] = {k: round(v / prefill_tok_s[peer], 2)
                                                  for k, v in prefill_tok_s.items() if k.startswith("tokenmind")}
    if notes:
        result["notes"] = notes
    emit(result, args.out)
    return result


def run_llama_bench(binary: Path, model: Path, threads: int, args) -> dict[str, float]:
    """llama.cpp's own benchmark on the file: pp{prompt_len}, tg{decode_tokens} from an empty context
    and after prompt_len tokens of context; mean tokens/s over its repetitions."""
    out = subprocess.run([str(binary), "-m", str(model), "-t", str(threads), "-p", str(args.prompt_len),
                          "-n", str(args.decode_tokens), "-d", f"0,{args.prompt_len}", "-r", str(args.repeats),
                          "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)

    def rate(prompt: int, gen: int, depth: int) -> float:
        return round(next(r["avg_ts"] for r in rows
                          if (r["n_prompt"], r["n_gen"], r["n_depth"]) == (prompt, gen, depth)), 1)

    return {"pp": rate(args.prompt_len, 0, 0), "tg": rate(0, args.decode_tokens, 0),
            "tg_after_prompt": rate(0, args.decode_tokens, args.prompt_len)}


if __name__ == "__main__":
    main()
