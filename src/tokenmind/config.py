"""The one config loader: YAML file → dataclass, patched by `key=value` overrides, checked by name.

Every tokenmind config is a dataclass that validates itself in `__post_init__`: flat ones
(`ServeConfig`, `EvalConfig`) and sectioned ones whose fields are dataclasses themselves
(`RunConfig`'s model/data/optim/schedule/train, `SpeedrunConfig`'s pretrain/sft/eval, which are
whole configs again). One loader fills them all, in layers:

    field defaults ← `defaults` (a command's own, e.g. an env var) ← YAML file ← overrides

An override is `key=value` or `section.key=value` (any depth: `pretrain.train.steps=10`), with or
without leading dashes; argparse flags arrive as a mapping of field names (`cli_overrides`).
Values are parsed with `yaml.safe_load` and coerced to the field's annotation, because YAML 1.1
reads `1e-3` as a string; coercing makes `--optim.lr=1e-3` do what everyone means. Unknown names
fail at once with a did-you-mean and the valid names: a typo must never silently run with the
default. `save_resolved` writes the result back as YAML that loads to the same config.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")
Overrides = Sequence[str] | Mapping[str, Any]  # ["section.key=value", ...] or {"section.key": value} (flags)


def load_config(schema: type[T], path: str | Path | None = None, overrides: Overrides = (),
                defaults: Mapping[str, Any] | None = None) -> T:
    """`schema` from its field defaults ← `defaults` ← the YAML file at `path` ← `overrides`.

    overrides: `["optim.lr=1e-3", "--train.steps", "20"]`, or a mapping `{"train.steps": 20}` of
    values already parsed (argparse flags). defaults: dotted keys, below the file.
    """
    return build_config(schema, read_config(schema, path, overrides, defaults))


def read_config(schema: type, path: str | Path | None = None, overrides: Overrides = (),
                defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The layers merged into one flat `{"section.key": value}` dict, every name checked against
    `schema`, values not yet coerced: for a caller that fills in keys before `build_config`."""
    flat: dict[str, Any] = {}
    _update(schema, flat, defaults or {})
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ValueError(f"{path} must be a YAML mapping of {_kind(schema, '')}s ({', '.join(_names(schema))})")
        flat.update(_flatten(schema, loaded or {}, ""))
    _update(schema, flat, overrides if isinstance(overrides, Mapping) else parse_overrides(overrides))
    return flat


def build_config(schema: type[T], values: Mapping[str, Any]) -> T:
    """`schema` built from flat dotted `values` (as `read_config` returns), each coerced to its
    field's annotation; a section's keys not given take that section class's defaults."""
    for key in values:
        _check_path(schema, key)
    return _build(schema, values, "")


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`["--optim.lr=1e-3", "train.steps", "20"]` → `{"optim.lr": "1e-3", "train.steps": 20}`.

    Accepts `key=value` / `section.key=value` with or without leading dashes, or the value as the
    next item; each value is YAML (`[a, b]`, `{k: v}`, `null`). Later items win.
    """
    parsed, i = {}, 0
    while i < len(items):
        item = items[i].lstrip("-")
        if "=" in item:
            key, text = item.split("=", 1)
        elif i + 1 < len(items):
            key, text = item, items[i + 1]
            i += 1
        else:
            raise ValueError(f"override {items[i]!r} has no value; write --section.key=value (or --key=value)")
        i += 1
        parsed[key] = yaml.safe_load(text)
    return parsed


def cli_overrides(args: argparse.Namespace, schema: type, rest: Sequence[str] = ()) -> dict[str, Any]:
    """A command line's overrides: the `key=value` items argparse left over (`rest`), then every flag
    whose dest is a field of `schema`. Declare those flags with `default=argparse.SUPPRESS`, so a flag
    left out is absent and the YAML file's value, or the field's default, stands."""
    names = {f.name for f in dataclasses.fields(schema)}
    return {**parse_overrides(rest), **{key: value for key, value in vars(args).items() if key in names}}


def config_dict(cfg: Any) -> dict[str, Any]:
    """Plain YAML/JSON-friendly dict of a config (nested sections as mappings, tuples as lists)."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return plain(dataclasses.asdict(cfg))


def save_resolved(cfg: Any, path: str | Path) -> Path:
    """Write the fully resolved config as YAML, atomically; `load_config(type(cfg), path) == cfg`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(config_dict(cfg), sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)
    return path


# argparse types for flags that fill a config field in other units ("0 = off/auto" becomes None)

def comma_list(text: str) -> list[str]:
    """`"a, b,c"` → `["a", "b", "c"]`."""
    return [name.strip() for name in text.split(",") if name.strip()]


def name_equals_path(text: str) -> tuple[str, str]:
    """`"name=path"` → `("name", "path")` (`--lora NAME=PATH`)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name.strip(), path.strip()


def mebibytes(text: str) -> int:
    """MiB → bytes (`--kv-cache-mb 512` fills `kv_cache_bytes`)."""
    return int(float(text) * 2**20)


def zero_is_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, except that 0 gives None: flags that say "0 = no limit" for a field whose None does."""
    def convert(text: str) -> Any:
        return parse(text) or None

    convert.__name__ = parse.__name__  # argparse names it in "invalid float value: 'x'"
    return convert


# the schema walk: names checked with a did-you-mean, values coerced by annotation

def _section(hint: Any) -> type | None:
    """The dataclass a field holds as a nested section, else None (a plain value)."""
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def _names(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema) if f.init]


def _kind(schema: type, prefix: str) -> str:
    """What the names at this level are called in errors: sections, or keys (of which section)."""
    sections = all(_section(hint) for name, hint in get_type_hints(schema).items() if name in _names(schema))
    if not prefix:
        return "config section" if sections else "config key"
    return f"{'section in' if sections else 'key in section'} {prefix.rstrip('.')!r}"


def _hint(schema: type, name: Any, prefix: str) -> Any:
    """The annotation of field `name`, or an error naming the closest valid name and all of them."""
    valid = _names(schema)
    if name not in valid:
        close = difflib.get_close_matches(str(name), valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {_kind(schema, prefix)} {str(name)!r}{hint}; valid: {', '.join(valid)}")
    return get_type_hints(schema)[name]


def _check_path(schema: type, key: str) -> type | None:
    """Check a dotted key against the schema; return the section class if it names a section."""
    parts, cls, prefix = key.split("."), schema, ""
    for depth, part in enumerate(parts):
        hint = _hint(cls, part, prefix)
        section = _section(hint)
        if depth == len(parts) - 1:
            return section
        if section is None:
            shape = ".".join(["section"] * depth + ["key"])
            raise ValueError(f"override {key!r} must be {shape}: {prefix}{part} is one value, not a section; "
                             f"give it whole as YAML, e.g. {prefix}{part}='{{a: 1, b: 2}}'")
        cls, prefix = section, prefix + part + "."
    return None


def _update(schema: type, flat: dict[str, Any], values: Mapping[str, Any]) -> None:
    """Set dotted keys in `flat`; a key naming a whole section takes a mapping of its keys."""
    for key, value in values.items():
        section = _check_path(schema, key)
        if section is None:
            flat[key] = value
        elif isinstance(value, Mapping):  # `--train='{steps: 10, seed: 1}'` sets several keys of one section
            flat.update(_flatten(section, value, key + "."))
        else:
            raise ValueError(f"{key} is a section: set its keys as {key}.KEY=value "
                             f"(keys: {', '.join(_names(section))})")


def _build(schema: type[T], values: Mapping[str, Any], prefix: str) -> T:
    hints = get_type_hints(schema)
    kwargs = {}
    for f in dataclasses.fields(schema):
        if not f.init:
            continue
        key, hint = prefix + f.name, hints[f.name]
        section = _section(hint)
        if section is not None:
            kwargs[f.name] = _build(section, values, key + ".")
        elif key in values:
            kwargs[f.name] = _coerce(values[key], hint, key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{key} is not set: give it in the YAML config or on the command line")
    return schema(**kwargs)


def _flatten(schema: type, mapping: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """`{"optim": {"lr": 1}}` → `{"optim.lr": 1}`, recursing only into sections."""
    flat = {}
    for name, value in mapping.items():
        section = _section(_hint(schema, name, prefix))
        key = prefix + name
        if section is None:
            flat[key] = value
        elif isinstance(value, Mapping):
            flat.update(_flatten(section, value, key + "."))
        elif value is not None:  # `train:` with nothing under it keeps the defaults
            raise ValueError(f"{key} is a section: give it a mapping of key: value "
                             f"(keys: {', '.join(_names(section))})")
    return flat


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """`value` (from YAML or a flag) as the annotated type, or a ValueError that says what was expected."""
    origin = get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is not type(None):
                try:
                    return _coerce(value, option, where)
                except ValueError:
                    pass
        raise ValueError(f"{where}: {value!r} is not a valid {annotation}")
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # a folder named 2024 is still a path
    elif origin is tuple and isinstance(value, (list, tuple)):
        items = get_args(annotation)
        if len(items) == len(value):
            return tuple(_coerce(v, t, where) for v, t in zip(value, items))
    elif origin is dict and isinstance(value, dict):
        return value
    elif origin is list:  # one value is a one-item list, so `--data.files=a.jsonl` works
        (item,) = get_args(annotation)
        return [_coerce(v, item, where) for v in (value if isinstance(value, (list, tuple)) else [value])]
    raise ValueError(f"{where}: expected {getattr(annotation, '__name__', annotation)}, got {value!r}")
