"""HF checkpoint directories: load, save, round-trip through `transformers`, and clear errors."""

import json

import pytest
import torch
import transformers

from tokenmind.model.checkpoint import load_hf_dir, save_hf_dir
from tokenmind.model.config import ModelConfig
from tokenmind.model.transformer import Transformer

CFG = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


def tiny(model_type="llama", **kw):
    cfg = ModelConfig(**{**CFG, "model_type": model_type, **kw})
    torch.manual_seed(0)
    m = Transformer(cfg).eval()
    m.init_weights(std=0.1)
    return m


IDS = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model_type,kw", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                           ("qwen2", {"qkv_bias": True}), ("qwen3", {"qk_norm": True}),
                                           ("mistral", {"sliding_window": 4})])
def test_saved_dir_loads_in_transformers_with_same_logits(tmp_path, model_type, kw):
    ours = tiny(model_type, **kw)
    save_hf_dir(ours, tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(hf).__name__.lower().startswith(model_type)
    with torch.no_grad():
        assert (hf(IDS).logits - ours(IDS)).abs().max().item() <= 1e-4
    back = load_hf_dir(tmp_path / "m")
    with torch.no_grad():
        assert torch.equal(back(IDS), ours(IDS))


def test_loads_sharded_checkpoint_written_by_transformers(tmp_path):
    cfg = ModelConfig(**CFG)
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg.to_hf())).eval()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_hf_dir(tmp_path)
    with torch.no_grad():
        assert (hf(IDS).logits - ours(IDS)).abs().max().item() <= 1e-4


def test_save_is_atomic_and_replaces_existing(tmp_path):
    out = tmp_path / "m"
    save_hf_dir(tiny(), out)

    class Boom:
        def save(self, directory):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_hf_dir(tiny(tie_word_embeddings=True), out, tokenizer=Boom())
    # The failed save left the earlier checkpoint intact and no temporary directory behind.
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_missing_config_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)


def test_missing_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny().cfg.to_hf()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_dir(tmp_path)


def test_pickle_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny().cfg.to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="safetensors only"):
        load_hf_dir(tmp_path)


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    save_hf_dir(tiny(), tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_hf_dir(tmp_path / "m")


def test_bad_json_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_dir(tmp_path)


def test_unsupported_model_type_lists_supported(tmp_path):
    save_hf_dir(tiny(), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'.*llama, mistral, qwen2, qwen3"):
        load_hf_dir(tmp_path / "m")


def test_shape_mismatch_names_the_tensor(tmp_path):
    save_hf_dir(tiny(), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(ValueError, match=r"gate_up_proj.weight has shape \(192, 64\).*\(256, 64\)"):
        load_hf_dir(tmp_path / "m")


def test_missing_tensor_is_named(tmp_path):
    save_hf_dir(tiny(), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing: \['layers.2"):
        load_hf_dir(tmp_path / "m")
