"""Fill-in-the-middle on real code: the same small model pre-trained on networkx's Python source with and
without the FIM transform, then asked to fill single held-out lines.

    tokenmind data fetch code-networkx --out data
    python benchmarks/bench_fim.py --data data/pretrain/code-networkx.jsonl --steps 300

Modules are split by a hash of their id: 5% are held out and never reach the tokenizer or the shards.
Both runs share the tokenizer (trained with the FIM sentinels), the documents, the model, the seed and
the step count; only `fim.rate` differs (0.5, half of those SPM, against 0). Reported for each: exact
match and middle loss on single-line infilling of held-out lines (`eval/infill.py`, 8 lines of context
each side), and the plain left-to-right loss on the held-out modules (what FIM should not cost).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
from _common import machine_info

from tokenmind.data.clean import CleanConfig
from tokenmind.data.fim import FIMConfig
from tokenmind.data.pipeline import DataPipelineConfig, run_pipeline
from tokenmind.data.readers import read_documents
from tokenmind.data.shards import ShardConfig
from tokenmind.eval.infill import evaluate_infill, line_infill_examples
from tokenmind.eval.perplexity import evaluate_lm
from tokenmind.model.load import load_model
from tokenmind.tokenizer.train import TokenizerTrainConfig, train_tokenizer
from tokenmind.train import load_config, pretrain


def held_out(doc_id: str) -> bool:
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little") % 20 == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/pretrain/code-networkx.jsonl")
    parser.add_argument("--out", default="runs/bench_fim")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--json", default="benchmarks/results/fim.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    docs = list(read_documents(args.data))
    train, test = [d for d in docs if not held_out(d.id)], [d for d in docs if held_out(d.id)]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        f.writelines(json.dumps(d.to_dict()) + "\n" for d in train)
    tok_report = train_tokenizer(TokenizerTrainConfig(data=[str(out / "train.jsonl")], out=str(out / "tokenizer"),
                                                      vocab_size=4096, heldout_every=0, fim=True))
    from tokenmind.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(out / "tokenizer")
    examples = line_infill_examples([d.text for d in test], per_text=50, seed=0, context_lines=8)[: args.examples]
    results = {}
    for name, rate in (("fim", 0.5), ("plain", 0.0)):
        shards = out / f"shards-{name}"
        if not (shards / "manifest.json").exists():
            run_pipeline(out / "train.jsonl", shards, tokenizer, DataPipelineConfig(
                clean=CleanConfig(remove_boilerplate=False), near_dedup=None, num_workers=1, print_report=False,
                shards=ShardConfig(val_tokens=0), fim=FIMConfig(rate=rate, spm_rate=0.5)))
        cfg = load_config(None, [
            "--model.vocab_size=4096", "--model.hidden_size=128", "--model.intermediate_size=384",
            "--model.num_hidden_layers=4", "--model.num_attention_heads=4", "--model.num_key_value_heads=2",
            "--model.max_position_embeddings=512", "--model.tie_word_embeddings=true",
            f"--data.shards={shards}", f"--data.tokenizer={out / 'tokenizer'}", "--data.batch_size=8",
            "--data.seq_len=256", "--optim.lr=3e-3", "--schedule.warmup_steps=20", f"--train.steps={args.steps}",
            "--train.precision=bf16", f"--train.out_dir={out / name}", "--train.log_every=50", "--train.resume=false"])
        t0 = time.perf_counter()
        run = pretrain(cfg)
        seconds = time.perf_counter() - t0
        model = load_model(run.final_model_path, dtype="float32").model
        infill = evaluate_infill(model, tokenizer, examples, max_tokens=48)
        lm = evaluate_lm(model, [d.text for d in test], tokenizer, seq_len=256)
        results[name] = {"fim_rate": rate, "train_seconds": round(seconds, 1), "tokens_seen": run.tokens_seen,
                         "exact_match": infill["exact_match"], "middle_loss": infill["middle_loss"],
                         "heldout_lm_loss": lm["loss"], "samples": infill["predictions"][:5]}
        print(name, {k: v for k, v in results[name].items() if k != "samples"}, flush=True)
    report = {"benchmark": "fim", "machine": machine_info(note="shared 2-core machine, other jobs running"),
              "data": {"train_docs": len(train), "heldout_docs": len(test), "examples": len(examples),
                       "tokenizer_vocab": tok_report["vocab_size"]}, "steps": args.steps, "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
