"""The package layers of docs/architecture.md, enforced: no module imports a higher layer, and no
import cycle exists between modules (counting imports inside functions and `TYPE_CHECKING` blocks
too: a cycle that only types see is still two modules that cannot be read apart)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Bottom to top; a module may import its own layer and those below it. Listed by package prefix.
LAYERS = [
    ["tokenmind.config", "tokenmind.jsonl", "tokenmind.progress", "tokenmind.sandbox", "tokenmind.data"],  # nothing else of tokenmind
    ["tokenmind.tokenizer"],
    ["tokenmind.model"],
    ["tokenmind.engine"],
    ["tokenmind.train"],
    ["tokenmind.eval", "tokenmind.posttrain", "tokenmind.diffusion", "tokenmind.vision", "tokenmind.embodied"],
    ["tokenmind.chat", "tokenmind.serve", "tokenmind.speedrun", "tokenmind.apps"],
    ["tokenmind.cli", "tokenmind"],  # the front door and the command line
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every tokenmind module `path` imports, absolute or relative, wherever the import statement is."""
    name, found = module_name(path), set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("tokenmind"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("tokenmind"):
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return found


def modules() -> dict[str, set[str]]:
    graph = {module_name(p): imports(p) for p in (SRC / "tokenmind").rglob("*.py")}
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def layer_or_none(module: str) -> int | None:
    """The layer of the longest LAYERS prefix that covers `module`, or None."""
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            # the bare package name stands for tokenmind/__init__.py alone, not for everything under it
            if module == prefix or ("." in prefix and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return None if best is None else best[0]


def layer(module: str) -> int:
    found = layer_or_none(module)
    assert found is not None, f"{module} is in no layer; add its package to LAYERS (and docs/architecture.md)"
    return found


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
              for m, deps in modules().items() for d in deps if layer(d) > layer(m)]
    assert not upward, "\n".join(upward)


def test_there_are_no_import_cycles():
    graph = modules()
    for m in graph:  # package __init__ files re-export their own modules: that is not a cycle
        if m.count(".") and (SRC / m.replace(".", "/") / "__init__.py").exists():
            graph[m] = {d for d in graph[m] if not d.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_layers_cover_every_package():
    found = modules()
    assert {"tokenmind.model.lora", "tokenmind.serve.app", "tokenmind.cli"} <= set(found)  # the walk sees the tree
    uncovered = sorted(m for m in found if layer_or_none(m) is None)
    assert not uncovered, f"in no layer (add to LAYERS and docs/architecture.md): {uncovered}"
    assert layer_or_none("tokenmind.nowhere.new") is None and layer_or_none("tokenmind.model.lora") == 2
