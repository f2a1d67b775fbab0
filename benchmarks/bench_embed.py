"""Sentence embedding throughput: tokenmind's encoder vs `transformers` (and `sentence-transformers`,
when installed) on the same weights, texts and batches.

All sides embed the same texts (SQuAD questions and paragraphs from `tokenmind data fetch squad`,
so lengths vary as in retrieval) with all-MiniLM-L6-v2, batches of `--batch` texts sorted by
length (as sentence-transformers batches them), mean pooling and normalisation; `transformers`
uses its own tokenizer and `BertModel`; `sentence-transformers` (the library people embed with:
`pip install sentence-transformers==6.2.0` in the benchmark's environment) runs its own `encode`.
Repeats alternate sides; medians are reported, with the cosine between each peer's vectors and
tokenmind's as the check that they compute the same thing. `--int8` adds tokenmind's W8A8 encoder
(int8 weights and activations), reported against the float32 sides with its cosine to float32.
Prints JSON.

    python benchmarks/bench_embed.py [--texts 1000] [--batch 32] [--dtype float32|bfloat16] [--int8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="data/eval/squad.jsonl")
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides")
    ap.add_argument("--int8", action="store_true",
                    help="also time tokenmind's int8 encoder (W8A8, `load_encoder(quantize='int8')`); float32 only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import transformers

    from tokenmind.jsonl import read_jsonl
    from tokenmind.model.encoder import load_encoder, mean_pool

    rows = read_jsonl(args.data)
    texts = [t for r in rows for t in (r["question"], r["context"])][:args.texts]
    dtype = getattr(torch, args.dtype)
    if args.int8 and dtype != torch.float32:
        ap.error("--int8 compares against float32 peers: leave --dtype at float32")
    ours = load_encoder("minilm", dtype=dtype)
    ours_int8 = load_encoder("minilm", quantize="int8") if args.int8 else None
    hf = transformers.AutoModel.from_pretrained(str(ours.path), dtype=dtype).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(ours.path))
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        st = None
    else:
        st = SentenceTransformer(str(ours.path), device="cpu").to(dtype).eval()

    def run_ours() -> torch.Tensor:
        return ours.embed(texts, batch_size=args.batch)

    def run_theirs() -> torch.Tensor:
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = []
        with torch.inference_mode():
            for s in range(0, len(order), args.batch):
                batch = tok([texts[i] for i in order[s:s + args.batch]], padding=True, truncation=True,
                            max_length=ours.max_seq_length, return_tensors="pt")
                hidden = hf(**batch).last_hidden_state.float()
                out.append(F.normalize(mean_pool(hidden, batch["attention_mask"], normalize=False), dim=-1))
        vectors = torch.cat(out)
        return vectors[torch.argsort(torch.tensor(order))]

    def run_st() -> torch.Tensor:
        return st.encode(texts, batch_size=args.batch, convert_to_tensor=True, normalize_embeddings=True).float()

    def run_ours_int8() -> torch.Tensor:
        return ours_int8.embed(texts, batch_size=args.batch)

    sides = {"tokenmind": run_ours, **({"tokenmind int8": run_ours_int8} if ours_int8 else {}),
             "transformers": run_theirs, **({"sentence-transformers": run_st} if st else {})}
    reference = run_ours()  # warm-up, and the agreement check
    agreement = {name: (reference * fn()).sum(-1) for name, fn in sides.items() if name != "tokenmind"}
    cosine = {name: round(float(c.min()), 6) for name, c in agreement.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    rate = {k: round(len(texts) / statistics.median(v), 1) for k, v in times.items()}
    result = {"benchmark": "embed", "model": "all-MiniLM-L6-v2", "dtype": args.dtype, "texts": len(texts),
              "batch": args.batch, "machine": machine_info(threads=torch.get_num_threads()),
              "texts_per_s": rate, "ratio": round(rate["tokenmind"] / rate["transformers"], 2),
              **({"ratio_vs_sentence_transformers": round(rate["tokenmind"] / rate["sentence-transformers"], 2)}
                 if st else {}),
              "cosine_min_vs_tokenmind": cosine}
    if ours_int8:
        result["ratio_int8"] = round(rate["tokenmind int8"] / rate["transformers"], 2)
        result["ratio_int8_vs_float32"] = round(rate["tokenmind int8"] / rate["tokenmind"], 2)
        result["cosine_mean_int8_vs_float32"] = round(float(agreement["tokenmind int8"].mean()), 4)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
