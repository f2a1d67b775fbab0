"""Read the files a user points `rag index` at into plain-text documents, one per file (or per JSONL line)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...data.sources.markup import html_to_text, rst_to_text

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".html", ".htm", ".jsonl", ".pdf")


@dataclass(frozen=True)
class Document:
    source: str  # where it came from: a path, or path#id for a JSONL record
    text: str


def read_documents(paths: list[str | Path]) -> list[Document]:
    """Every supported file under `paths` (folders are walked, in sorted order), as documents.

    .txt/.md/.rst as written (reStructuredText roles and directives cleaned), .html as its readable
    text, .pdf through pypdf, .jsonl one document per line (`text`, and `id` or `source` to name it).
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            if p.suffix.lower() not in TEXT_SUFFIXES:
                raise ValueError(f"{p}: cannot index {p.suffix or 'files without a suffix'}; supported: "
                                 f"{', '.join(TEXT_SUFFIXES)}")
            files.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist")
    docs = [doc for f in files for doc in _read(f)]
    return [d for d in docs if d.text.strip()]


def _read(path: Path) -> list[Document]:
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        return [Document(str(path), _pdf_text(path))]
    text = path.read_text(encoding="utf-8", errors="replace")
    if suffix == ".jsonl":
        docs = []
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                body = record["text"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: each line must be a JSON object with a \"text\" field ({e})") from e
            name = record.get("id", record.get("source", n))
            docs.append(Document(f"{path}#{name}", str(body)))
        return docs
    if suffix in (".html", ".htm"):
        text = html_to_text(text)
    elif suffix == ".rst":
        text = rst_to_text(text)
    return [Document(str(path), text)]


def _pdf_text(path: Path) -> str:
    try:
        import pypdf
    except ImportError as e:
        raise ImportError(f"{path}: reading PDFs needs pypdf: pip install 'tokenmind[rag]'") from e
    try:
        return "\n\n".join(page.extract_text() or "" for page in pypdf.PdfReader(path).pages)
    except pypdf.errors.PdfReadError as e:
        raise ValueError(f"{path} is not a readable PDF ({e})") from e
