"""The built-in tools: a calculator, Python in the sandbox, search over a RAG index, and read-only
files under a root directory. Each maker returns a `Tool` whose function has a typed signature and a
docstring written for the model."""

from __future__ import annotations

import ast
import math
import operator
from pathlib import Path

from .tools import Tool, ToolError

# --- calculator ---------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
           ast.BitXor: operator.pow}  # "^" is read as a power, as on a calculator
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {name: getattr(math, name) for name in (
    "sqrt", "exp", "log", "log2", "log10", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh",
    "floor", "ceil", "radians", "degrees", "hypot", "gcd", "lcm", "comb", "perm")}
_FUNCTIONS.update(abs=abs, round=round, min=min, max=max, factorial=math.factorial)
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
_MAX_EXPONENT = 10_000  # keeps `9**9**9` from taking the process with it
_MAX_FACTORIAL = 1_000
_MAX_DIGITS = 1_000
_MAX_BITS = int(_MAX_DIGITS * math.log2(10)) + 1


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if type(node.op) in (ast.Pow, ast.BitXor) and (
                abs(right) > _MAX_EXPONENT
                or isinstance(left, int) and isinstance(right, int) and left.bit_length() * right > _MAX_BITS):
            raise ToolError(f"{ast.unparse(node)!r} is too large to compute (more than {_MAX_DIGITS} digits)")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, int) and value.bit_length() > _MAX_BITS:
            raise ToolError(f"the result has more than {_MAX_DIGITS} digits")
        return value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
            and not node.keywords:
        args = [_evaluate(a) for a in node.args]
        if node.func.id == "factorial" and args and abs(args[0]) > _MAX_FACTORIAL:
            raise ToolError(f"factorial of at most {_MAX_FACTORIAL}")
        return _FUNCTIONS[node.func.id](*args)
    what = ast.unparse(node) if isinstance(node, ast.AST) else repr(node)
    raise ToolError(f"{what!r} is not arithmetic; use numbers, + - * / // % ** ( ), "
                    f"the constants {', '.join(_CONSTANTS)} and the functions {', '.join(sorted(_FUNCTIONS))}")


def _number(value) -> str:
    if isinstance(value, float):
        if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value. Use it for any arithmetic.

    Args:
        expression: the expression, e.g. "(1250 - 380) * 12 / 5" or "sqrt(2) * pi"
    """
    text = expression.replace("×", "*").replace("÷", "/").replace("−", "-").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ToolError(f"cannot read {expression!r} as an expression ({e.msg})") from None
    try:
        return _number(_evaluate(tree))
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError, TypeError) as e:
        if isinstance(e, ToolError):
            raise
        raise ToolError(f"{type(e).__name__}: {e}") from None


def calculator_tool() -> Tool:
    return Tool.from_function(calculate, name="calculator")


# --- Python in the sandbox ----------------------------------------------------------------------

def python_tool(timeout_s: float = 10.0) -> Tool:
    """Runs model-written Python in the project's one sandbox (no network, a private /tmp, limits)."""
    from ...sandbox import SandboxConfig, SandboxUnavailable, run_python

    config = SandboxConfig(timeout_s=timeout_s)

    def run_python_code(code: str) -> str:
        """Run a Python program and return what it prints (stdout, then stderr). Print the values you need.
        Runs without network access; files written go to a temporary directory that is then deleted.

        Args:
            code: the complete Python program
        """
        try:
            result = run_python(code, config)
        except SandboxUnavailable as e:
            raise ToolError(f"Python is not available here: {e}") from None
        out = result.stdout + (("\n" if result.stdout and not result.stdout.endswith("\n") else "")
                               + result.stderr if result.stderr else "")
        if not result.ok:
            out += f"\n[the program ended: {result.reason}]"
        return out.strip() or "(the program printed nothing; print the values you need)"

    return Tool.from_function(run_python_code, name="python")


# --- retrieval ----------------------------------------------------------------------------------

def search_tool(index, k: int = 3, mode: str = "hybrid") -> Tool:
    """Search over a `RagIndex`: the best passages, numbered, with their sources. The description names
    the indexed documents, so the model knows which questions the collection can answer."""

    def search_documents(query: str) -> str:
        """Search the document collection and return the most relevant passages with their sources.
        Use it for questions about facts that are in the documents.

        Args:
            query: what to look for, in a few words or a question
        """
        hits = index.search(query, k, mode)
        if not hits:
            return "no passages found"
        return "\n\n".join(f"[{n}] {h.chunk.source}{' — ' + h.chunk.heading if h.chunk.heading else ''}\n"
                           f"{h.chunk.text}" for n, h in enumerate(hits, start=1))

    names = sorted({Path(source).stem.replace("-", " ").replace("_", " ") for source in index.documents})
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    tool = Tool.from_function(search_documents)
    tool.description += f" The collection holds {len(names)} documents: {shown}."
    return tool


# --- files --------------------------------------------------------------------------------------

def file_tools(root: str | Path, max_bytes: int = 64 << 10) -> list[Tool]:
    """`list_files` and `read_file` under `root`, read-only; a path that leaves `root` (`..`, an
    absolute path elsewhere, a symbolic link out) is refused."""
    base = Path(root).resolve()
    if not base.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; give the directory the agent may read")

    def inside(path: str) -> Path:
        target = (base / path).resolve()  # resolves "..", and symbolic links to where they point
        if target != base and base not in target.parents:
            raise ToolError(f"{path!r} is outside the readable directory; give a path relative to it")
        if not target.exists():
            raise ToolError(f"{path!r} does not exist; use list_files to see what there is")
        return target

    def list_files(directory: str = ".") -> str:
        """List the files and directories in a directory (directories end with "/").

        Args:
            directory: a path relative to the root, "." for the root itself
        """
        target = inside(directory)
        if not target.is_dir():
            raise ToolError(f"{directory!r} is a file, not a directory; read it with read_file")
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
        return "\n".join(names) or "(empty directory)"

    def read_file(path: str, start_line: int = 1, max_lines: int = 200) -> str:
        """Read lines of a text file.

        Args:
            path: the file's path relative to the root
            start_line: the first line to return (1 is the first line of the file)
            max_lines: how many lines at most
        """
        target = inside(path)
        if target.is_dir():
            raise ToolError(f"{path!r} is a directory; list it with list_files")
        with open(target, "rb") as f:
            data = f.read(max_bytes + 1)
        if b"\0" in data[:4096]:
            raise ToolError(f"{path!r} is a binary file, not text")
        lines = data[:max_bytes].decode("utf-8", errors="replace").splitlines()
        start = max(start_line, 1)
        chosen = lines[start - 1:start - 1 + max(max_lines, 1)]
        more = len(data) > max_bytes or start - 1 + len(chosen) < len(lines)
        return "\n".join(chosen) + (f"\n[... more; read from line {start + len(chosen)}]" if more else "")

    return [Tool.from_function(list_files), Tool.from_function(read_file)]
