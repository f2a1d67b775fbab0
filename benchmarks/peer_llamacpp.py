"""llama.cpp side of the batch-1 benchmarks; runs inside benchmarks/.venv-peers (stdlib + llama_cpp only).

Reads a JSON job from argv[1] and prints JSON. Token ids come from the caller so both sides see
exactly the same prompts. Two jobs:

- batch-1 (`long_prompt`, `short_prompt`, `decode_tokens`): the seconds one prefill of
  `long_prompt` and one greedy decode of `decode_tokens` tokens after `short_prompt` take,
  after a warm-up of each;
- offline requests (`requests`: [[prompt ids, output tokens], ...], all arriving at once): the
  Python binding has no batching, so they run one after another, as its users run them; per
  request, time to first token from the start and time per output token.

    python peer_llamacpp.py '{"model": "x.gguf", "threads": 2, "long_prompt": [...], "short_prompt": [...],
                              "decode_tokens": 128}'
"""

import json
import sys
import time


def main() -> None:
    job = json.loads(sys.argv[1])
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=2048, n_batch=max(512, len(job.get("long_prompt", ()))),
                          n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False)
    load_s = time.perf_counter() - t0

    def prefill():
        llm.reset()
        llm.eval(job["long_prompt"])

    def decode(prompt, n_tokens, on_token=None):
        llm.reset()
        n = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            n += 1
            if on_token:
                on_token(n)
            if n == n_tokens:
                break
        return n

    if "requests" in job:
        decode(job["requests"][0][0], 2)  # warm-up
        start, ttft, tpot = time.perf_counter(), [], []
        for prompt, n_tokens in job["requests"]:
            marks = {}
            decode(prompt, n_tokens, lambda i, marks=marks: marks.setdefault(i, time.perf_counter()))
            ttft.append(marks[1] - start)
            if n_tokens > 1:
                tpot.append((marks[n_tokens] - marks[1]) / (n_tokens - 1))
        print(json.dumps({"llama_cpp": llama_cpp.__version__, "load_s": load_s,
                          "seconds": time.perf_counter() - start, "ttft_s": ttft, "tpot_s": tpot}))
        return

    prefill()
    decode(job["short_prompt"], job["decode_tokens"])  # warm-up
    t0 = time.perf_counter()
    prefill()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = decode(job["short_prompt"], job["decode_tokens"])
    decode_s = time.perf_counter() - t0
    print(json.dumps({"llama_cpp": llama_cpp.__version__, "load_s": load_s, "prefill_s": prefill_s,
                      "decode_s": decode_s, "decoded": n}))


if __name__ == "__main__":
    main()
