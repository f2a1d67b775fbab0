"""Several LoRA adapters served beside their base through the official `openai` client: a request
names an adapter as its `model`, and requests for different adapters share the engine's batches."""

import asyncio
import copy

import openai
import pytest
import torch
from test_serve_fixtures import MODEL, LiveServer, tiny_pretrained

from tokenmind.engine.llm import LLM
from tokenmind.engine.sampling import SamplingParams
from tokenmind.model.load import Pretrained
from tokenmind.model.lora import LoRAConfig, add_lora, merge_lora, save_adapter


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two adapters trained nowhere: random, large enough to change greedy output."""
    root, paths = tmp_path_factory.mktemp("adapters"), {}
    for name, targets, seed in (("pirate", ["q_proj", "v_proj", "down_proj"], 1), ("poet", ["o_proj", "up_proj"], 2)):
        model = tiny_pretrained().model
        add_lora(model, LoRAConfig(rank=4, targets=targets), seed=seed)
        with torch.no_grad():
            g = torch.Generator().manual_seed(seed)
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 2)
        paths[name] = save_adapter(model, root / name, base_model=MODEL)
    return paths


def merged_answer(adapter_dir, messages, max_tokens):
    """What the base with this adapter merged answers, through the plain engine."""
    from tokenmind.model.lora import load_adapter

    base = tiny_pretrained()
    model = base.model if adapter_dir is None else merge_lora(load_adapter(copy.deepcopy(base.model), adapter_dir))
    prompt = base.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    llm = LLM(Pretrained(model, base.tokenizer, base.path))
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))[0].outputs[0].text


def test_each_adapter_answers_as_its_merged_model_in_one_batch(adapters):
    messages = [{"role": "user", "content": "Tell me a story."}]
    with LiveServer(tiny_pretrained(), lora={k: str(v) for k, v in adapters.items()}) as server:
        client = server.openai()
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {MODEL, "pirate", "poet"} and listed["poet"].model_extra["parent"] == MODEL

        async def ask_all():
            aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            calls = [aclient.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0)
                     for name in (MODEL, "pirate", "poet", "pirate")]
            return await asyncio.gather(*calls)

        answers = asyncio.run(ask_all())
        with pytest.raises(openai.NotFoundError, match="pirate"):
            client.chat.completions.create(model="parrot", messages=messages, max_tokens=4)
    assert [a.model for a in answers] == [MODEL, "pirate", "poet", "pirate"]
    texts = [a.choices[0].message.content for a in answers]
    assert texts[0] == merged_answer(None, messages, 16)
    assert texts[1] == texts[3] == merged_answer(adapters["pirate"], messages, 16)
    assert texts[2] == merged_answer(adapters["poet"], messages, 16)
    assert len(set(texts)) == 3


def test_a_missing_adapter_directory_is_named_at_start(tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        LiveServer(tiny_pretrained(), lora={"ghost": str(tmp_path)})
