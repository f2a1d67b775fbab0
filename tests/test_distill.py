"""Teacher-written text: prompt sets, the generate → filter → cache round trip, checksums."""

import gzip
import json

import pytest
from test_serve_fixtures import tiny_pretrained

from tokenmind.model.load import save_model
from tokenmind.posttrain.distill import SynthesisConfig, load_synthetic, manifest_path, synthesize, whole_sentences
from tokenmind.posttrain.prompts import PROMPT_SETS, build_prompts, keep_answer


def test_prompt_sets_are_deterministic_and_varied():
    for kind in PROMPT_SETS:
        a, b = build_prompts(kind, 50, seed=1), build_prompts(kind, 50, seed=1)
        assert a == b and len({p["prompt"] for p in a}) == 50
        assert build_prompts(kind, 50, seed=2) != a
    assert len(build_prompts("answers", 5000)) == 5000  # cycles when asked for more than the set holds


def test_the_filter_keeps_answers_and_drops_refusals_loops_and_code():
    answer = {"kind": "answers"}
    assert keep_answer(answer, "A cat is a small animal that people keep as a pet.")
    assert not keep_answer(answer, "As an AI language model, I cannot do that.")
    assert not keep_answer(answer, "I am SmolLM, a small model made by Hugging Face.")
    assert not keep_answer(answer, "the dog ran and the dog ran and the dog ran and the dog ran and the dog ran")
    assert not keep_answer(answer, "```python\nprint(1)\n```")
    assert not keep_answer({"kind": "stories"}, "Too short to be a story.")


def test_a_cut_off_text_keeps_its_whole_sentences():
    assert whole_sentences("The sun is hot. It gives us light. And when the") == "The sun is hot. It gives us light."
    assert whole_sentences("no sentence ends here") == ""


def test_synthesize_caches_with_a_manifest_and_refuses_a_changed_file(tmp_path):
    teacher = save_model(tiny_pretrained(), tmp_path / "teacher")
    cfg = SynthesisConfig(kind="answers", count=4, teacher=str(teacher), dtype="float32", max_tokens=12,
                          max_num_seqs=4)
    out = synthesize(cfg, tmp_path / "answers.jsonl.gz", progress=False)
    manifest = json.loads(manifest_path(out).read_text())
    assert manifest["prompts"] == 4 and manifest["generated_tokens"] > 0 and manifest["config"]["count"] == 4
    records = load_synthetic(out)
    assert len(records) == manifest["records"]
    before = out.stat().st_mtime_ns
    assert synthesize(cfg, out, progress=False) == out and out.stat().st_mtime_ns == before  # cached
    with gzip.open(out, "wt") as fh:
        fh.write('{"tampered": true}\n')
    with pytest.raises(ValueError, match="does not match its manifest"):
        load_synthetic(out)
