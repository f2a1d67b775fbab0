"""The concept map (docs/concepts.md) points at real code and real tests: every `path:symbol` it
names exists and defines that symbol, and every test it names exists, so the map cannot rot."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\|(?P<concept>[^|]+)\|[^|]+\|(?P<code>[^|]+)\|(?P<tests>[^|]+)\|\s*$")


def rows():
    for line in (ROOT / "docs" / "concepts.md").read_text().splitlines():
        m = ROW.match(line)
        if m and "src/" in m["code"]:
            yield m["concept"].strip(), m["code"], m["tests"]


def defines(path: Path, symbol: str) -> bool:
    text = path.read_text()
    name = symbol.split(".")[-1]
    return re.search(rf"^\s*(def|class|async def|function)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", text,
                     re.MULTILINE) is not None  # `function`: the chat page's JavaScript


def test_every_concept_names_existing_code_and_tests():
    found, missing = 0, []
    for concept, code, tests in rows():
        found += 1
        last_file = None
        for ref in re.findall(r"`([^`]+)`", code):
            path, _, symbol = ref.partition(":")
            if path.startswith("src/"):
                last_file = ROOT / path
            else:  # a bare symbol in the same file as the previous reference
                path, symbol = None, ref
            target = last_file
            if target is None or not target.is_file():
                missing.append(f"{concept}: {ref} (no such file)")
            elif symbol and not defines(target, symbol):
                missing.append(f"{concept}: {ref} (symbol not defined there)")
        test_refs = re.findall(r"tests/[\w/]+\.py(?:::\w+)?", tests)
        if not test_refs:
            missing.append(f"{concept}: no test named")
        for ref in test_refs:
            path, _, name = ref.partition("::")
            if not (ROOT / path).is_file() or (name and f"def {name}" not in (ROOT / path).read_text()):
                missing.append(f"{concept}: {ref} (no such test)")
    assert found > 50, "the concept map has fewer rows than expected; did its table format change?"
    assert not missing, "docs/concepts.md points at things that do not exist:\n" + "\n".join(missing)
