"""Serving a vision-language model: image requests through `tokenmind serve`, cold vs warm prefix cache, concurrency.

Takes a VLM directory (`--vlm`, e.g. a `tokenmind vision train-vlm` run's final/) or builds one:
SmolLM2-135M-Instruct + a ViT (the Fashion-MNIST default shape) with random weights + a fresh
projector, `--pool-grid` image tokens per side (0: every patch, 49 + the class token). Timings do not
depend on training; the answers do. Starts `tokenmind serve --model VLM` on a free port and measures
with the official `openai` client, each request a different random 28x28 PNG as a data URL:

- cache: per image, a streaming request (cold), then the same image and text again (warm): time to
  first token and the prompt tokens served from the prefix cache (usage.prompt_tokens_details);
- concurrency: c clients at once, `--requests` requests in all, `--max-tokens` output tokens each
  (ignore_eos): requests/s and output tokens/s per level;
- answers (`--eval N`, for a trained `--vlm`): the first N Fashion-MNIST test images, each asked
  "What is in this picture?" through the server (4 clients at once): class accuracy (the class the
  answer names), and agreement with the offline engine's answers (`vlm_eval.engine_answers`).

    python benchmarks/bench_serve_vision.py [--vlm DIR] [--pool-grid 0] [--images 6] [--concurrency 1,4] \\
        [--eval 0] [--out result.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from _common import emit, free_port, machine_info, start_server
from PIL import Image

QUESTION = "What is in this picture?"


def build_vlm_dir(path: Path, pool_grid: int) -> Path:
    from tokenmind.model.load import load_model
    from tokenmind.vision.vit import ViT, ViTConfig
    from tokenmind.vision.vlm import build_vlm, save_vlm

    lm = load_model("smollm2", dtype=torch.float32)
    torch.manual_seed(0)
    vlm = build_vlm(ViT(ViTConfig()), lm.model, lm.tokenizer, pool_grid=pool_grid)
    return save_vlm(vlm, lm.tokenizer, path)


def image_url(seed: int | np.ndarray) -> str:
    """A PNG data URL of a uint8 (28, 28) array, or of random pixels from a seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (28, 28), dtype=np.uint8) if isinstance(seed, int) else seed
    buf = io.BytesIO()
    Image.fromarray(pixels, "L").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(seed: int | np.ndarray) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(seed)}},
                                         {"type": "text", "text": QUESTION}]}]


def eval_answers(client, folder: Path, n: int) -> dict:
    """Server answers about the first n Fashion-MNIST test images: class accuracy, and agreement
    with the offline engine's answers on the same images."""
    from tokenmind.diffusion.data import load_split
    from tokenmind.vision.images import to_pixel_values
    from tokenmind.vision.vlm import load_vlm
    from tokenmind.vision.vlm_data import mentioned_class
    from tokenmind.vision.vlm_eval import engine_answers

    images, labels = load_split("fashion-mnist", "test")
    images, labels = images[:n].numpy(), labels[:n].tolist()

    def ask(image: np.ndarray) -> str:
        reply = client.chat.completions.create(model="vlm", messages=messages(image), max_tokens=24, temperature=0)
        return reply.choices[0].message.content.strip()

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        served = list(pool.map(ask, images))
    seconds = time.perf_counter() - start
    model, tokenizer = load_vlm(folder)
    offline = engine_answers(model, tokenizer, QUESTION, to_pixel_values(images, model.image_size,
                                                                         model.image_channels))
    return {"images": n, "seconds": seconds,
            "class_accuracy": sum(mentioned_class(a) == y for a, y in zip(served, labels)) / n,
            "agreement_with_offline_engine": sum(a == b for a, b in zip(served, offline)) / n,
            "examples": [{"label": y, "answer": a} for a, y in list(zip(served, labels))[:5]]}


def stream_once(client, model: str, seed: int, max_tokens: int) -> dict:
    """One streaming request: TTFT, latency, output and cached prompt tokens."""
    start = time.perf_counter()
    ttft, usage = None, None
    chunks = client.chat.completions.create(model=model, messages=messages(seed), max_tokens=max_tokens,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    for chunk in chunks:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    return {"ttft_s": ttft, "latency_s": time.perf_counter() - start, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens, "output_tokens": usage.completion_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vlm", help="a save_vlm directory (default: build one from SmolLM2-135M + a random ViT)")
    ap.add_argument("--pool-grid", type=int, default=0, help="image tokens per side when building (0: every patch)")
    ap.add_argument("--images", type=int, default=6, help="distinct images for the cache measurement")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--eval", type=int, default=0, metavar="N", help="also ask about N Fashion-MNIST test images")
    ap.add_argument("--out")
    args = ap.parse_args()
    import openai

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.vlm) if args.vlm else build_vlm_dir(Path(tmp) / "vlm", args.pool_grid)
        port = free_port()
        cmd = [sys.executable, "-c", "from tokenmind.cli import main; raise SystemExit(main())", "serve", "--model",
               str(folder), "--port", str(port), "--served-model-name", "vlm", "--log-level", "warning"]
        proc, url = start_server(cmd, port, "/health")
        try:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            card = client.models.retrieve("vlm")
            stream_once(client, "vlm", 10_000, 2)  # warm-up: first-call costs (allocations, lazy imports)
            cold, warm = [], []
            for seed in range(args.images):
                cold.append(stream_once(client, "vlm", seed, args.max_tokens))
                warm.append(stream_once(client, "vlm", seed, args.max_tokens))
            levels = []
            for c in map(int, args.concurrency.split(",")):
                seeds = range(1000 * c, 1000 * c + args.requests)
                start = time.perf_counter()
                with ThreadPoolExecutor(c) as pool:
                    rows = list(pool.map(lambda s: stream_once(client, "vlm", s, args.max_tokens), seeds))
                wall = time.perf_counter() - start
                levels.append({"concurrency": c, "requests": len(rows), "requests_per_s": len(rows) / wall,
                               "output_tok_per_s": sum(r["output_tokens"] for r in rows) / wall,
                               "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows)})
            answers = eval_answers(client, folder, args.eval) if args.eval else None
        finally:
            proc.terminate()
            proc.wait()
    result = {"machine": machine_info(), "model": str(args.vlm or f"SmolLM2-135M + random ViT, pool_grid "
                                                                  f"{args.pool_grid}"),
              "tokens_per_image": card.tokens_per_image, "prompt_tokens": cold[0]["prompt_tokens"],
              "cache": {"cold_ttft_p50_s": statistics.median(r["ttft_s"] for r in cold),
                        "warm_ttft_p50_s": statistics.median(r["ttft_s"] for r in warm),
                        "cold_cached_tokens": [r["cached_tokens"] for r in cold],
                        "warm_cached_tokens": [r["cached_tokens"] for r in warm]},
              "concurrency": levels, "answers": answers}
    emit(result, args.out)


if __name__ == "__main__":
    main()
