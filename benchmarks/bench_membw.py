"""Memory bandwidth this machine gives PyTorch, and the decode roofline it implies for a model.

A batch-1 decode step reads every weight once (and the KV cache of its context), so its speed
limit is bandwidth / bytes per token. This measures the bandwidth the way the model's kernels
see it (torch ops on `--threads` threads over a buffer far larger than the caches: a sum reads,
a copy reads and writes), counts the bytes a decode step of the loaded model must read at two
context lengths, and prints both with the implied ceilings in tokens/s. Prints JSON.

    python benchmarks/bench_membw.py [--model smollm2] [--quantize auto] [--mib 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info  # noqa: E402


def bandwidth_gb_s(mib: int, repeats: int) -> dict[str, float]:
    """Median GB/s of a full read (sum) and of a read + write (copy) of `mib` MiB of float32."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    n_bytes = src.numel() * 4
    src.sum()  # warm-up: pages touched, threads started
    dst.copy_(src)
    reads, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        reads.append(n_bytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * n_bytes / (time.perf_counter() - t0) / 1e9)
    return {"read": round(statistics.median(reads), 1), "copy_read_plus_write": round(statistics.median(copies), 1)}


def decode_bytes_per_token(model: torch.nn.Module, context: int, kv_dtype: torch.dtype) -> dict[str, int]:
    """Bytes one batch-1 decode step reads: every linear's weights (quantized or not, the LM head
    included), one embedding row, the norms, and the keys and values of `context` positions."""
    from tokenmind.model.quant import weight_bytes

    cfg = model.cfg
    sizes = weight_bytes(model)
    embedding = model.embed_tokens.weight
    tied = model.lm_head is None or model.lm_head.weight is embedding
    # the embedding table is read in full only when it is also the (float) LM head
    other = sizes["other"] - (0 if tied else embedding.numel() * embedding.element_size()) + \
        embedding.shape[1] * embedding.element_size()
    elem = torch.empty((), dtype=kv_dtype).element_size()
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem * context
    return {"weights": sizes["linear"] + max(other, 0), "kv_cache": kv, "total": sizes["linear"] + max(other, 0) + kv}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model for the roofline (default smollm2)")
    ap.add_argument("--quantize", default="auto", help="as `tokenmind generate --quantize` (default auto)")
    ap.add_argument("--mib", type=int, default=512, help="buffer size in MiB (default 512, far above any L3)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="threads (default: torch's choice)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmind.model.load import load_model

    bw = bandwidth_gb_s(args.mib, args.repeats)
    pretrained = load_model(args.model, dtype="auto", quantize=args.quantize)
    kv_dtype = pretrained.model.embed_tokens.weight.dtype
    roofline = {}
    for context in (16, 512):
        need = decode_bytes_per_token(pretrained.model, context, kv_dtype)
        roofline[f"context_{context}"] = {**{f"{k}_bytes": v for k, v in need.items()},
                                          "ceiling_tok_s": round(bw["read"] * 1e9 / need["total"], 1)}
    result = {"benchmark": "membw", "machine": machine_info(threads=torch.get_num_threads()),
              "bandwidth_gb_s": bw, "model": pretrained.name, "quantization": pretrained.quantization,
              "kv_dtype": str(kv_dtype).removeprefix("torch."), "decode_roofline": roofline}
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
