"""`Tokenizer`: one tokenizer API over a Hugging Face `tokenizers.Tokenizer`, whichever way it was loaded.

The Rust `tokenizers` library does the encoding work and its `tokenizer.json` is the interchange
format, so a model directory, a GGUF file and our own `save()` output all load into the same
object, and transformers can load what we save. Around it we keep what `tokenizer.json` does not
say: which tokens are bos/eos/pad, every id that should stop generation, and the chat template.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend
from tokenizers import processors

from tokenmind.data.fim import find_fim_tokens, infill_prompt, require_fim_tokens
from tokenmind.jsonl import read_json_or_empty
from tokenmind.tokenizer.chat_template import ChatTemplateError, render_chat, render_template
from tokenmind.tokenizer.gguf_backend import GGUFTokenizer, build_backend
from tokenmind.tokenizer.streaming import StreamDecoder

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """Encode/decode text, render chats, and describe the special tokens of one model.

    Build it with `from_pretrained` (an HF directory), `from_file` or `from_gguf` (a GGUF file's
    vocabulary); `tokenmind.model.load.load_tokenizer` takes any model reference.
    `backend` is the underlying `tokenizers.Tokenizer`; its post-processor decides what
    `add_special_tokens=True` adds (e.g. a BOS for Llama, nothing for SmolLM2).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ):
        self.backend = backend
        special_tokens = special_tokens or {}
        self.special_tokens_map = {n: special_tokens[n] for n in _SPECIAL_NAMES if special_tokens.get(n) is not None}
        self.chat_template = chat_template
        self._extra_eos_token_ids = {int(i) for i in extra_eos_token_ids}

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_gguf(cls, gguf: GGUFTokenizer) -> Tokenizer:
        """From the tokenizer a GGUF file embeds (see `tokenmind.model.gguf.read_gguf`).

        llama.cpp's end-of-turn / end-of-message ids (`tokenizer.ggml.eot_token_id`, `eom_token_id`)
        count as stop ids: Llama 3 chats end turns with `<|eot_id|>`, not with its eos token.
        """
        backend = build_backend(gguf)
        ids = dict(bos_token=gguf.bos_token_id, eos_token=gguf.eos_token_id, unk_token=gguf.unk_token_id,
                   pad_token=gguf.pad_token_id)  # fmt: skip
        special = {name: gguf.tokens[i] for name, i in ids.items() if i is not None}
        _set_bos_eos_processor(backend, special, gguf.add_bos_token, gguf.add_eos_token)
        stops = [gguf.extra.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom")]
        return cls(
            backend,
            special_tokens=special,
            chat_template=gguf.chat_template,
            extra_eos_token_ids=[i for i in stops if i is not None],
        )

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        tokenizer_config: Mapping[str, Any] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """From a `tokenizer.json` plus the dict of its `tokenizer_config.json`, if any.

        The post-processor in `tokenizer.json` alone decides what `add_special_tokens=True` adds;
        like transformers 5 we ignore `add_bos_token`/`add_eos_token` flags in the config.
        """
        config = dict(tokenizer_config or {})
        backend = Backend.from_file(str(path))
        special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        template = config.get("chat_template")
        if isinstance(template, list):  # older multi-template format: [{"name": ..., "template": ...}]
            template = {t["name"]: t["template"] for t in template}.get("default")
        return cls(backend, special_tokens=special, chat_template=template, extra_eos_token_ids=extra_eos_token_ids)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face model directory containing `tokenizer.json`.

        In a directory, `special_tokens_map.json` fills special tokens the config lacks, a
        `chat_template.jinja`/`chat_template.json` overrides the config's template (that is where
        newer transformers saves it), and the `eos_token_id`s of `generation_config.json` and
        `config.json` become extra stop ids (Llama 3 stops on `<|eot_id|>` as well as its eos).
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} is not a directory with a tokenizer.json (for a .gguf file or an "
                                    "alias use tokenmind.model.load.load_tokenizer)")
        config = read_json_or_empty(path / "tokenizer_config.json")
        for name, value in read_json_or_empty(path / "special_tokens_map.json").items():
            if name in _SPECIAL_NAMES and config.get(name) is None:
                config[name] = value
        if (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            config["chat_template"] = read_json_or_empty(path / "chat_template.json")["chat_template"]
        stop_ids = set()
        for name in ("generation_config.json", "config.json"):
            eos = read_json_or_empty(path / name).get("eos_token_id")
            stop_ids.update([eos] if isinstance(eos, int) else eos or [])
        return cls.from_file(path / "tokenizer.json", config, extra_eos_token_ids=stop_ids)

    def save(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` loadable by `transformers.AutoTokenizer`.

        No `add_bos_token` flags are written: the post-processor inside `tokenizer.json` already
        says what `add_special_tokens=True` adds, and transformers 5 reads only that.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.special_tokens_map,
            "clean_up_tokenization_spaces": False,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        if self.eos_token_ids:  # every stop id (e.g. <|im_end|> as well as eos), as transformers' generate reads it
            generation = {"eos_token_id": sorted(self.eos_token_ids)}
            if self.bos_token_id is not None:
                generation["bos_token_id"] = self.bos_token_id
            (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    # ----------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids.

        `add_special_tokens=True` adds what the model expects around a sequence (a BOS for
        Llama-style tokenizers); it is off by default because chat templates already write them.
        Goes through the backend's batch call: unlike its single-text call it releases the GIL,
        so a long text does not stall other threads (the server's event loop: 0.24 s for 900 kB),
        and for one short text both cost the same.
        """
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_prompt(self, prompt: str) -> list[int]:
        """A plain-text prompt's token ids (with the model's BOS); an empty prompt is just the BOS."""
        ids = self.encode(prompt, add_special_tokens=True)
        if not ids:
            if self.bos_token_id is None:
                raise ValueError("the prompt is empty and the tokenizer has no BOS token to start from; give a prompt")
            ids = [self.bos_token_id]
        return ids

    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        """The fill-in-the-middle prompt (PSM, `data/fim.py`) whose continuation is the text between
        `prefix` and `suffix`, each encoded alone as FIM training encodes them; ValueError naming the
        fix when this tokenizer has no FIM tokens."""
        return infill_prompt(self.encode(prefix), self.encode(suffix), require_fim_tokens(self))

    @property
    def infill_stop_token_ids(self) -> list[int]:
        """Ids that end a middle besides eos: another sentinel, or `<|endoftext|>` (Qwen2.5-Coder ends its
        middles there while its eos is `<|im_end|>`)."""
        ids = list(find_fim_tokens(self) or ())
        end_of_text = self.token_to_id("<|endoftext|>")
        return ids + ([end_of_text] if end_of_text is not None else [])

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` for many texts, parallelised by the Rust backend."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh `StreamDecoder` for one generated sequence."""
        return StreamDecoder(lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens))

    # ----------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the embedding rows a model needs)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the eos token plus the stop ids the model config declares."""
        eos = self.eos_token_id
        return self._extra_eos_token_ids | ({eos} if eos is not None else set())

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.token_to_id(token)

    # ----------------------------------------------------------------- chat

    def get_chat_template(self, chat_template: str | None = None) -> str:
        """`chat_template` if given, else the tokenizer's own; an error naming the fix if neither exists."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ChatTemplateError(
                "This tokenizer has no chat template. Pass one with `chat_template=` (a Jinja string), "
                "set `tokenizer.chat_template`, or load a chat/instruct model that ships one "
                "(tokenizer_config.json `chat_template`, chat_template.jinja, or GGUF `tokenizer.chat_template`)."
            )
        return template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **variables: Any,
    ) -> list[int] | str:
        """Format `messages` ({"role", "content"} dicts) with the chat template, like transformers.

        Returns the token ids, or the prompt text with `tokenize=False`. The template also sees
        `bos_token`/`eos_token`/... and any extra `variables` (e.g. `enable_thinking=False`).
        """
        text = render_template(
            self.get_chat_template(chat_template),
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            **{**self.special_tokens_map, **variables},
        )
        return self.encode(text) if tokenize else text

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> tuple[list[int], list[int]]:
        """`(ids, assistant_mask)` for SFT; see `tokenmind.tokenizer.chat_template.render_chat`."""
        return render_chat(self, messages, **kwargs)


def _set_bos_eos_processor(backend: Backend, special: Mapping[str, str | None], add_bos: bool, add_eos: bool):
    """Make `add_special_tokens=True` wrap sequences as `[bos] A [eos]` per the two flags.

    Mirrors the post-processor transformers builds, so both load paths add the same tokens; a
    template processor (unlike ByteLevel's) also leaves encoding offsets untrimmed.
    """
    bos, eos = special.get("bos_token") if add_bos else None, special.get("eos_token") if add_eos else None
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = " ".join([single] + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    tokens = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _token_text(value: Any) -> str | None:
    """A special token from a config: a plain string or a serialized `AddedToken` dict."""
    return value.get("content") if isinstance(value, Mapping) else value

