"""Manuals: the Python, Linux, Perl, PostgreSQL, Django and Rust documentation, and the Python FAQ.

Technical prose from Debian's documentation packages. Most come as a Sphinx `_sources` tree
(RST) or a folder of HTML pages, so two extractor factories (`_sphinx_sources`, `_html_pages`)
serve them, parameterised by the folder and the pages to leave out; perl's POD and the FAQ's
question/answer sections have their own. The FAQ is the one SFT source here: it reads the same
package as `python-doc`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from tokenmind.data.sources.archive import decode_text, iter_members
from tokenmind.data.sources.base import Record, Source
from tokenmind.data.sources.markup import html_to_text, pod_to_text, rst_to_text


def _sphinx_sources(root: str, skip: tuple[str, ...] = ()) -> Callable[[Path], Iterator[Record]]:
    def extract(deb: Path) -> Iterator[Record]:
        for path, data in iter_members(deb, lambda n: n.startswith(root) and n.endswith(".txt")):
            rel = path[len(root) :]
            if not any(fnmatch.fnmatchcase(rel, s) for s in skip):
                yield {"id": rel.removesuffix(".txt").removesuffix(".rst"), "text": rst_to_text(decode_text(data))}

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
                yield {"id": rel.removesuffix(".html"), "text": html_to_text(decode_text(data))}

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
            yield {"id": name, "text": pod_to_text(decode_text(data))}


def extract_python_faq(deb: Path) -> Iterator[Record]:
    """Question/answer pairs from the Python FAQ (each `?` section title is a question)."""
    root = "usr/share/doc/python3.11/html/_sources/faq/"
    for path, data in iter_members(deb, lambda n: n.startswith(root) and n.endswith(".rst.txt")):
        lines = decode_text(data).split("\n")
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


SOURCES = [
    Source("python-doc", "debian", "python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0", "PSF-2.0", "pretrain",
           extract_python_doc, "Python 3.11 tutorial, library and language reference, HOWTOs (RST)", ("pretrain",)),
    Source("linux-doc", "debian", "linux-doc-6.1", "6.1.192-2", "GPL-2.0", "GPL-2.0 (some files CC-BY-4.0 or dual)",
           "pretrain", extract_linux_doc, "Linux kernel 6.1 documentation (RST)", ("pretrain",)),
    Source("perl-doc", "debian", "perl-doc", "5.36.0-7+deb12u4", "GPL-1+ or Artistic", "GPL-1+ or Artistic",
           "pretrain", extract_perl_doc, "Perl 5.36 manual pages (POD)", ("pretrain",)),
    Source("postgresql-doc", "debian", "postgresql-doc-15", "15.20-0+deb12u1", "PostgreSQL", "PostgreSQL",
           "pretrain", extract_postgresql_doc, "PostgreSQL 15 manual (HTML)", ("pretrain",)),
    Source("django-doc", "debian", "python-django-doc", "3:3.2.25-0+deb12u7", "BSD-3-Clause", "BSD-3-Clause",
           "pretrain", extract_django_doc, "Django 3.2 documentation (HTML; release notes left out)", ("pretrain",)),
    Source("rust-doc", "debian", "rust-doc", "1.63.0+dfsg1-2", "MIT or Apache-2.0", "MIT or Apache-2.0", "pretrain",
           extract_rust_doc, "The Rust Book, Reference, Nomicon, Rust by Example and more (mdBook HTML)",
           ("pretrain",)),
    Source("python-faq", "debian", "python3.11-doc", "3.11.2-6+deb12u9", "PSF-2.0", "PSF-2.0", "sft",
           extract_python_faq, "Python FAQ question/answer pairs", ("sft",)),
]  # fmt: skip
