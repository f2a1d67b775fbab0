"""Multi-token prediction drafting (`--speculative mtp`) against plain decoding, on a tiny DeepSeek-V3
model trained here with MTP (batch 1, greedy, fp32, through the engine).

No released MTP checkpoint fits a CPU, so the script first pre-trains a small deepseek_v3 (MLA,
4 experts, `--depths` MTP depths, λ = 0.3) on arithmetic progressions modulo the vocabulary — the
corpus of the training tests, where the next tokens follow from the last two — for `--steps`
steps, then decodes held-out progression prompts plainly and with MTP drafts of k = 1.. tokens
(the last depth reused past the depths). Reports acceptance, tokens per target step and tokens/s,
checks the text is plain decoding's token for token, and prints JSON.

    python benchmarks/bench_mtp.py [--steps 150] [--depths 1] [--ks 1,2,3] [--max-tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info, timed_call  # noqa: E402

VOCAB = 300


def write_progressions(root: Path, num_docs: int, seed: int = 0) -> Path:
    from tokenmind.data.shards import ShardConfig, ShardWriter

    rng = np.random.default_rng(seed)
    with ShardWriter(root, vocab_size=VOCAB, eos_token_id=0, cfg=ShardConfig(tokens_per_shard=20_000,
                                                                             val_tokens=2_000)) as writer:
        for _ in range(num_docs):
            start, stride, length = rng.integers(1, VOCAB), rng.integers(1, 4), rng.integers(8, 64)
            writer.add((start + stride * np.arange(length)) % (VOCAB - 1) + 1)
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--depths", type=int, default=1, help="MTP depths (num_nextn_predict_layers)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ks", default="1,2,3", help="comma-separated draft lengths")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from tokenmind.engine.config import EngineConfig
    from tokenmind.engine.llm import Engine
    from tokenmind.engine.sampling import SamplingParams
    from tokenmind.engine.speculative import SpeculativeConfig
    from tokenmind.jsonl import read_jsonl
    from tokenmind.model.checkpoint import load_hf_dir
    from tokenmind.train import pretrain
    from tokenmind.train.config import load_config

    tmp = Path(tempfile.mkdtemp(prefix="bench_mtp_"))
    d, heads = args.hidden, 4
    flags = [f"--model.vocab_size={VOCAB}", f"--model.hidden_size={d}", f"--model.intermediate_size={2 * d}",
             f"--model.num_hidden_layers={args.layers}", f"--model.num_attention_heads={heads}",
             f"--model.num_key_value_heads={heads}", "--model.max_position_embeddings=256",
             "--model.model_type=deepseek_v3", "--model.num_experts=4", "--model.num_experts_per_tok=2",
             f"--model.moe_intermediate_size={d // 2}", "--model.n_shared_experts=1",
             "--model.first_k_dense_replace=1", "--model.topk_method=noaux_tc", "--model.scoring_func=sigmoid",
             f"--model.kv_lora_rank={d // 4}", f"--model.q_lora_rank={d // 2}", f"--model.qk_nope_head_dim={d // 8}",
             f"--model.qk_rope_head_dim={d // 16}", f"--model.v_head_dim={d // 8}",
             f"--model.num_nextn_predict_layers={args.depths}", f"--data.shards={write_progressions(tmp / 's', 3000)}",
             "--data.batch_size=8", "--data.seq_len=64", "--optim.lr=3e-3", "--schedule.warmup_steps=10",
             f"--train.steps={args.steps}", "--train.precision=fp32", "--train.eval_batches=4",
             f"--train.eval_every={args.steps}", f"--train.out_dir={tmp / 'run'}"]
    train_s, result = timed_call(lambda: pretrain(load_config(None, flags)))
    val = [r for r in read_jsonl(result.metrics_path) if "val_mtp" in r][-1]
    model = load_hf_dir(result.final_model_path).eval()

    rng = np.random.default_rng(12345)  # held-out prompts: the corpus's kind, another seed
    prompts = [((rng.integers(1, VOCAB) + rng.integers(1, 4) * np.arange(6)) % (VOCAB - 1) + 1).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    ks = [int(k) for k in args.ks.split(",") if k]

    def engine(k=None):
        spec = None if k is None else SpeculativeConfig("mtp", k, adaptive=False)
        return Engine(model, config=EngineConfig(block_size=16, max_num_seqs=1, speculative=spec))

    engines = {"plain": engine(), **{f"mtp_k{k}": engine(k) for k in ks}}

    def decode(e: Engine) -> tuple[list[list[int]], dict]:
        before = (e.num_drafted, e.num_accepted, e.num_steps)
        outs = []
        for p in prompts:  # one request at a time: batch 1
            request = e.add_request(p, params)
            while e.has_unfinished():
                outs += [o.outputs[0].token_ids for o in e.step() if o.finished and o.request_id == request]
        return outs, {"drafted": e.num_drafted - before[0], "accepted": e.num_accepted - before[1],
                      "steps": e.num_steps - before[2]}

    reference, _ = decode(engines["plain"])  # also the warm-up
    times: dict[str, list[float]] = {name: [] for name in engines}
    stats, identical = {}, {}
    for _ in range(args.repeats):
        for name, e in engines.items():  # alternating, so load hits every configuration alike
            dt, (outs, st) = timed_call(lambda: decode(e))
            times[name].append(dt)
            identical[name], stats[name] = outs == reference, st
    n = sum(map(len, reference))
    plain_s = statistics.median(times["plain"])
    configs = {}
    for name, ts in times.items():
        med, st = statistics.median(ts), stats[name]
        configs[name] = {"tok_s": round(n / med, 1), "speedup": round(plain_s / med, 3),
                         "acceptance_rate": round(st["accepted"] / st["drafted"], 3) if st["drafted"] else None,
                         "tokens_per_step": round(n / st["steps"], 3), "identical_to_plain": identical[name]}
    emit({"benchmark": "mtp_speculative_decoding_batch1_greedy",
          "model": {"hidden": d, "layers": args.layers, "mtp_depths": args.depths, "experts": 4,
                    "parameters": model.cfg.num_parameters, "train_steps": args.steps, "train_s": round(train_s, 1),
                    "val_loss": round(val["val_loss"], 3), "val_mtp_loss": round(val["val_mtp"], 3)},
          "prompts": len(prompts), "max_tokens": args.max_tokens, "generated_tokens": n, "repeats": args.repeats,
          "configs": configs, "machine": machine_info()}, args.out)


if __name__ == "__main__":
    sys.exit(main())
