"""MCP both ways, against the official SDK (`mcp`): the SDK's client uses tokenmind's server (in
process, and `tokenmind mcp serve` over stdio), and tokenmind's client uses servers built with the
SDK's own `MCPServer` (over stdio and streamable HTTP), handing their tools to the agent loop."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest
from test_serve_fixtures import free_port

from tokenmind.apps.agents import calculator_tool, file_tools, run_agent
from tokenmind.apps.agents.mcp import MCPTools, mcp_server

mcp = pytest.importorskip("mcp")

TOKENMIND = str(Path(sys.executable).parent / "tokenmind")
SDK_SERVER = '''
import sys
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("shouter")

@app.tool()
def shout(text: str, times: int = 1) -> str:
    """Upper-case a text, repeated."""
    if not text:
        raise ToolError("nothing to shout")
    return " ".join([text.upper()] * times)

@app.tool()
def calculator(expression: str) -> str:
    """A tool whose name the agent's own calculator already has."""
    return "remote " + expression

if len(sys.argv) > 1:
    app.run("streamable-http", port=int(sys.argv[1]))
else:
    app.run()
'''


def sdk_call(server, name: str, arguments: dict):
    """List the tools and call one, with the SDK's own client."""
    async def go():
        async with mcp.Client(server) as client:
            listed = {t.name: t for t in (await client.list_tools()).tools}
            return listed, await client.call_tool(name, arguments)

    return anyio.run(go)


def text_of(result) -> str:
    return "\n".join(block.text for block in result.content)


def test_the_sdk_client_lists_and_calls_tokenmind_tools_in_process(tmp_path):
    (tmp_path / "note.txt").write_text("hello from the file")
    server = mcp_server([calculator_tool(), *file_tools(tmp_path)])
    listed, result = sdk_call(server, "calculator", {"expression": "7391 * 8467"})
    assert set(listed) == {"calculator", "list_files", "read_file"}
    assert listed["calculator"].description.startswith("Evaluate an arithmetic expression")
    assert listed["calculator"].input_schema["required"] == ["expression"]
    assert listed["read_file"].input_schema["properties"]["start_line"]["default"] == 1
    assert not result.is_error and text_of(result) == "62579597"
    _, result = sdk_call(server, "read_file", {"path": "note.txt"})
    assert text_of(result) == "hello from the file"
    _, result = sdk_call(server, "calculator", {"expression": "1 / 0"})  # a tool's complaint reaches the client
    assert result.is_error and "division by zero" in text_of(result)
    _, result = sdk_call(server, "read_file", {"path": "../../etc/passwd"})
    assert result.is_error and "outside the readable directory" in text_of(result)


def test_the_sdk_client_uses_tokenmind_mcp_serve_over_stdio(tmp_path):
    (tmp_path / "a.txt").write_text("alpha")
    params = mcp.StdioServerParameters(command=TOKENMIND, args=["mcp", "serve", "--tools", "calculator",
                                                                "--root", str(tmp_path)])
    listed, result = sdk_call(params, "list_files", {})
    assert set(listed) == {"calculator", "list_files", "read_file"} and text_of(result) == "a.txt"


@pytest.fixture
def sdk_server_script(tmp_path):
    script = tmp_path / "sdk_server.py"
    script.write_text(SDK_SERVER)
    return script


def test_tokenmind_client_offers_an_sdk_servers_tools_over_stdio(sdk_server_script):
    with MCPTools([f"{sys.executable} {sdk_server_script}"], taken=("calculator",)) as remote:
        tools = {t.name: t for t in remote.tools}
        assert set(tools) == {"shout", "shouter_calculator"}  # a taken name gets the server's prefix
        assert tools["shout"].description == "Upper-case a text, repeated."
        assert tools["shout"].parameters["required"] == ["text"]
        assert tools["shout"].call({"text": "hi", "times": 2}) == "HI HI"
        assert tools["shout"].call({"text": ""}) == "error: Error executing tool shout: nothing to shout"
        assert tools["shouter_calculator"].call({"expression": "1+1"}) == "remote 1+1"

        class Scripted:  # the loop runs a remote tool like any other
            replies = [{"role": "assistant", "content": None, "tool_calls": [{
                "id": "c1", "type": "function", "function": {"name": "shout", "arguments": '{"text": "mcp"}'}}]},
                {"role": "assistant", "content": "done"}]

            def reply(self, messages, schemas, tool_choice="auto"):
                return self.replies.pop(0)

        result = run_agent(Scripted(), "shout mcp", [calculator_tool(), *remote.tools])
        assert result.messages[2] == {"role": "tool", "tool_call_id": "c1", "name": "shout", "content": "MCP"}


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 180.0) -> None:
    """Until the server listens: its start took over 60 s in `make test` (two workers) on a loaded 2-core CPU."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read().decode()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port}")


@pytest.mark.parametrize("which", ["sdk", "tokenmind"])
def test_streamable_http_both_ways(which, sdk_server_script):
    port = free_port()
    argv = ([sys.executable, str(sdk_server_script), str(port)] if which == "sdk" else
            [TOKENMIND, "mcp", "serve", "--tools", "calculator", "--transport", "http", "--port", str(port)])
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_port(port, process)
        url = f"http://127.0.0.1:{port}/mcp"
        if which == "sdk":  # tokenmind's client → the SDK's server
            with MCPTools([url]) as remote:
                assert {t.name: t for t in remote.tools}["shout"].call({"text": "web"}) == "WEB"
        else:  # the SDK's client → tokenmind's server
            listed, result = sdk_call(url, "calculator", {"expression": "2 ** 20"})
            assert list(listed) == ["calculator"] and text_of(result) == "1048576"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_bad_server_spec_fails_with_the_fix_named():
    with pytest.raises(ValueError, match="empty MCP server spec"):
        MCPTools(["  "])
    with pytest.raises(Exception):
        MCPTools([f"{sys.executable} -c 'import sys; sys.exit(3)'"], timeout_s=10)


def test_the_agent_cli_offers_mcp_tools(sdk_server_script, capsys, monkeypatch):
    """`tokenmind agent run --mcp ... --url ...` against a scripted OpenAI-compatible endpoint."""
    from tokenmind.apps.agents import chat as chat_module
    from tokenmind.cli import main

    seen = []

    def reply(self, messages, tools, tool_choice="auto"):
        seen.append([t["function"]["name"] for t in tools])
        if len(seen) == 1:
            return {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shout", "arguments": '{"text": "ok"}'}}]}
        return {"role": "assistant", "content": "the server said " + messages[-1]["content"]}

    monkeypatch.setattr(chat_module.RemoteChat, "reply", reply)
    assert main(["agent", "run", "shout ok", "--url", "http://127.0.0.1:9/v1", "--tools", "calculator",
                 "--mcp", f"{sys.executable} {sdk_server_script}", "--json", "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {**out, "answer": "the server said OK", "stop": "answer", "steps": 2, "tool_calls": 1}
    assert seen[0] == ["calculator", "shout", "shouter_calculator"]
