"""Batch-1 prefill and decode speed on SmolLM2-135M: tokenmind vs `transformers` on the same weights.

Both load the same GGUF (dequantized to fp32) and run side by side in one process, alternating
repeats so machine noise hits both alike; medians are reported. Prints JSON.

    python benchmarks/bench_decode.py [--repeats 5] [--prompt-len 512] [--decode-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from tokenmind.engine.generate import generate
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.pretrained import load_pretrained, resolve_model_path

    path = resolve_model_path(args.model)
    t0 = time.perf_counter()
    ours = load_pretrained(path)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    t_hf = time.perf_counter() - t0
    hf.generation_config.eos_token_id = None  # both sides generate exactly --decode-tokens tokens

    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(100, ours.model.cfg.vocab_size, (1, args.prompt_len), generator=gen)
    short_prompt = ours.tokenizer.encode("The history of the printing press begins")
    n = args.decode_tokens
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    def ours_prefill():
        with torch.inference_mode():
            ours.model.logits(ours.model.hidden_states(long_prompt)[:, -1])

    def hf_prefill():
        with torch.inference_mode():
            hf(long_prompt, logits_to_keep=1)

    def ours_decode():
        assert len(generate(ours.model, short_prompt, params).token_ids) == n

    def hf_decode():
        with torch.inference_mode():
            out = hf.generate(torch.tensor([short_prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert out.shape[1] == len(short_prompt) + n

    for fn in (ours_prefill, hf_prefill, ours_decode, hf_decode):  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in ("ours_prefill", "hf_prefill", "ours_decode", "hf_decode")}
    for _ in range(args.repeats):
        for name, fn in (("ours_prefill", ours_prefill), ("hf_prefill", hf_prefill),
                         ("ours_decode", ours_decode), ("hf_decode", hf_decode)):
            times[name].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "decode_batch1",
        "model": str(path.name),
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_1m": os.getloadavg()[0], "torch": torch.__version__,
                    "transformers": transformers.__version__},
        "prompt_len": args.prompt_len,
        "decode_tokens": n,
        "repeats": args.repeats,
        "load_s": {"tokenmind": round(t_ours, 2), "transformers": round(t_hf, 2)},
        "prefill_tok_s": {"tokenmind": round(args.prompt_len / med["ours_prefill"], 1),
                          "transformers": round(args.prompt_len / med["hf_prefill"], 1)},
        "decode_tok_s": {"tokenmind": round(n / med["ours_decode"], 1),
                         "transformers": round(n / med["hf_decode"], 1)},
    }
    result["ratio_vs_transformers"] = {
        "prefill": round(med["hf_prefill"] / med["ours_prefill"], 2),
        "decode": round(med["hf_decode"] / med["ours_decode"], 2),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
