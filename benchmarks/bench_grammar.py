"""Grammar-constrained decoding cost over SmolLM2's 49,152-token vocabulary: llguidance (what the
engine uses) vs outlines-core vs xgrammar, for one JSON schema (typed fields, an enum, an array).

For each library: the vocabulary set-up once, compiling the schema (median of repeats; llguidance
and outlines also report the first mask, where lazy work lands), and the time to fill the next-token
bitmask at every step of one fixed, canonically tokenized document, for 1 matcher and for 16
matchers per step (each library's batch call where it has one: llguidance's LLExecutor, xgrammar's
BatchGrammarMatcher; outlines-core has none, so a loop). All use compact JSON with ", " and ": "
separators (outlines-core: optional single spaces), threads capped at `--threads`. Prints JSON.

    python benchmarks/bench_grammar.py [--repeats 5] [--threads 2] [--out FILE]

Needs `pip install outlines-core==0.2.14` and `pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi`
(xgrammar's triton dependency is only for its GPU kernels and is not needed here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, machine_info  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    },
    "required": ["name", "age", "score", "active", "role", "tags"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "score": 97.5, "active": True, "role": "admin",
            "tags": ["mathematics", "poetry", "engines"]}
BATCH = 16


def median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1e3, 4)


def vocabulary(tok) -> tuple[list[bytes | None], int]:
    """Each token's bytes (None for special tokens other than EOS) and the EOS id."""
    from tokenmind.tokenizer.gguf_backend import byte_alphabet

    to_byte = {c: b for b, c in byte_alphabet().items()}
    special = {t.content for t in tok.backend.get_added_tokens_decoder().values() if t.special}
    eos = tok.eos_token_id
    out: list[bytes | None] = []
    for i in range(tok.vocab_size):
        piece = tok.id_to_token(i)
        out.append(None if piece in special else bytes(to_byte[c] for c in piece))
    return out, eos


def run_steps(fill, advance, tokens: list[int], repeats: int, reset) -> dict:
    """Milliseconds `fill()` takes at each step of `tokens` (median, mean, max over steps and repeats)."""
    times = []
    for _ in range(repeats):
        reset()
        for token in tokens:
            t0 = time.perf_counter()
            fill()
            times.append(time.perf_counter() - t0)
            advance(token)
    return {"median": median_ms(times), "mean": round(statistics.mean(times) * 1e3, 4),
            "max": round(max(times) * 1e3, 4)}


def bench_llguidance(tok, tokens, eos, args) -> dict:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask, fill_next_token_bitmask_par

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
    setup = time.perf_counter() - t0
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    compile_times, first_masks = [], []
    bitmask = allocate_token_bitmask(BATCH, lltok.vocab_size)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        t1 = time.perf_counter()
        fill_next_token_bitmask(matcher, bitmask)
        compile_times.append(t1 - t0)
        first_masks.append(time.perf_counter() - t1)
        assert not matcher.is_error(), matcher.get_error()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(BATCH)]
    executor = llguidance.LLExecutor(num_threads=args.threads)

    def reset():
        for m in matchers:
            m.reset()

    def advance(token):
        for m in matchers:
            assert m.consume_token(token), m.get_error()

    one = run_steps(lambda: fill_next_token_bitmask(matchers[0], bitmask), lambda t: advance(t), tokens,
                    args.repeats, reset)
    pairs = [(m, i) for i, m in enumerate(matchers)]
    many = run_steps(lambda: fill_next_token_bitmask_par(executor, pairs, bitmask), advance, tokens, args.repeats,
                     reset)
    assert matchers[0].is_stopped() or matchers[0].is_accepting()
    return {"version": _version("llguidance"), "vocab_setup_s": round(setup, 3),
            "compile_ms": median_ms(compile_times), "first_mask_ms": median_ms(first_masks),
            "mask_ms_batch1": one, "mask_ms_batch16_step": many}


def bench_outlines(tok, tokens, eos, args) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    pieces, _ = vocabulary(tok)
    t0 = time.perf_counter()
    mapping: dict[bytes, list[int]] = {}
    for i, piece in enumerate(pieces):
        if piece is not None and i != eos:
            mapping.setdefault(piece, []).append(i)
    vocab = outlines_core.Vocabulary(eos, mapping)
    setup = time.perf_counter() - t0
    regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?")
    compile_times, first_masks = [], []
    words = (tok.vocab_size + 31) // 32
    bitmask = np.full((BATCH, words), -1, dtype=np.int32)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        index = outlines_core.Index(regex, vocab)
        guide = outlines_core.Guide(index)
        t1 = time.perf_counter()
        guide.write_mask_into(bitmask[0].ctypes.data, words, 4)
        compile_times.append(t1 - t0)
        first_masks.append(time.perf_counter() - t1)
    guides = [outlines_core.Guide(index) for _ in range(BATCH)]
    rows = [bitmask[i].ctypes.data for i in range(BATCH)]

    def reset():
        for g in guides:
            g.reset()

    def advance(token):
        for g in guides:
            g.advance(token, return_tokens=False)

    def fill_all():
        for g, row in zip(guides, rows):
            g.write_mask_into(row, words, 4)

    one = run_steps(lambda: guides[0].write_mask_into(rows[0], words, 4), advance, tokens[:-1], args.repeats, reset)
    many = run_steps(fill_all, advance, tokens[:-1], args.repeats, reset)  # outlines has no EOS step to take
    return {"version": _version("outlines_core"), "vocab_setup_s": round(setup, 3),
            "compile_ms": median_ms(compile_times), "first_mask_ms": median_ms(first_masks),
            "mask_ms_batch1": one, "mask_ms_batch16_step": many,
            "batch16": "python loop over guides (no batch API)"}


def bench_xgrammar(tok, tokens, eos, args) -> dict:
    import xgrammar

    pieces, _ = vocabulary(tok)
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo([p if p is not None else b"" for p in pieces], xgrammar.VocabType.RAW,
                                  vocab_size=tok.vocab_size, stop_token_ids=[eos])
    setup = time.perf_counter() - t0
    compile_times = []
    for _ in range(args.repeats):
        compiler = xgrammar.GrammarCompiler(info, max_threads=args.threads, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        compile_times.append(time.perf_counter() - t0)
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(BATCH)]
    bitmask = xgrammar.allocate_token_bitmask(BATCH, tok.vocab_size)
    batch = xgrammar.BatchGrammarMatcher(max_threads=args.threads)

    def reset():
        for m in matchers:
            m.reset()

    def advance(token):
        for m in matchers:
            assert m.accept_token(token)

    one = run_steps(lambda: matchers[0].fill_next_token_bitmask(bitmask, 0), advance, tokens, args.repeats, reset)
    many = run_steps(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask), advance, tokens, args.repeats,
                     reset)
    return {"version": _version("xgrammar"), "vocab_setup_s": round(setup, 3), "compile_ms": median_ms(compile_times),
            "mask_ms_batch1": one, "mask_ms_batch16_step": many,
            "note": "compile precomputes the per-state token masks, so there is no lazy first mask"}


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from tokenmind.model.load import load_tokenizer

    tok = load_tokenizer("smollm2")
    eos = tok.eos_token_id
    text = json.dumps(DOCUMENT)
    tokens = tok.encode(text) + [eos]
    result = {"benchmark": "grammar", "schema": SCHEMA, "document": text, "document_tokens": len(tokens) - 1,
              "vocab_size": tok.vocab_size, "batch": BATCH, "repeats": args.repeats, "threads": args.threads,
              "machine": machine_info(), "libraries": {}}
    for name, bench in [("llguidance", bench_llguidance), ("outlines_core", bench_outlines),
                        ("xgrammar", bench_xgrammar)]:
        try:
            result["libraries"][name] = bench(tok, tokens, eos, args)
        except Exception as e:  # a missing or broken peer is reported, not fatal
            result["libraries"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    emit(result, args.out)


if __name__ == "__main__":
    main()
