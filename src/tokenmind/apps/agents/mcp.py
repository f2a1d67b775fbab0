"""MCP (Model Context Protocol) on the official `mcp` SDK, both ways:

- `MCPTools`: a client of MCP servers (a command run over stdio, or a streamable-HTTP URL) that
  offers their tools to the agent as ordinary `Tool`s. The SDK is async; the agent loop is not, so the
  connections live on an event loop in a background thread (an anyio blocking portal).
- `mcp_server`: an MCP server exposing tokenmind's tools (RAG search, generation, the built-ins) to any
  MCP client; `tokenmind mcp serve` runs it over stdio or streamable HTTP.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import threading
from typing import Any

from .tools import Tool, ToolError, toolset


def _sdk():
    try:
        import mcp
    except ImportError:
        raise ImportError("MCP needs the official SDK: pip install 'tokenmind[mcp]' (mcp==2.3.0)") from None
    return mcp


def server_target(spec: str):
    """What the SDK's `Client` connects to: an http(s) URL as is, anything else as a command line run
    over stdio (`"python my_server.py --flag"`)."""
    if spec.startswith(("http://", "https://")):
        return spec
    argv = shlex.split(spec)
    if not argv:
        raise ValueError("an empty MCP server spec; give a URL (http://host:port/mcp) or a command")
    return _sdk().StdioServerParameters(command=argv[0], args=argv[1:])


def _result_text(result) -> str:
    """A tool result's content as text: text blocks joined; other blocks named by their type."""
    parts = []
    for block in result.content:
        parts.append(block.text if getattr(block, "type", None) == "text" else f"[{block.type} content]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


class MCPTools:
    """Connections to MCP servers and their tools, usable from synchronous code.

        with MCPTools(["python weather_server.py", "http://localhost:8000/mcp"]) as mcp:
            run_agent(chat, task, mcp.tools)

    A tool whose name another server (or a built-in) already uses is offered as `server_tool`."""

    def __init__(self, specs: list[str], timeout_s: float = 60.0, taken: tuple[str, ...] = ()):
        from anyio.from_thread import start_blocking_portal

        mcp = _sdk()
        self._stack = contextlib.ExitStack()
        self._lock = threading.Lock()
        self.tools: list[Tool] = []
        try:
            self._portal = self._stack.enter_context(start_blocking_portal())
            names = set(taken)
            for spec in specs:
                client = self._stack.enter_context(self._portal.wrap_async_context_manager(
                    mcp.Client(server_target(spec), read_timeout_seconds=timeout_s)))
                server = (client.server_info.name if client.server_info else "") or "mcp"
                for remote in self._portal.call(client.list_tools).tools:
                    name = remote.name if remote.name not in names else f"{server}_{remote.name}"
                    names.add(name)
                    self.tools.append(Tool(name, remote.description or remote.title or remote.name,
                                           remote.input_schema, self._caller(client, remote.name)))
        except BaseException:
            self._stack.close()
            raise

    def _caller(self, client, name: str):
        def call(**arguments: Any) -> str:
            with self._lock:
                result = self._portal.call(client.call_tool, name, arguments)
            text = _result_text(result)
            if result.is_error:
                raise ToolError(text or "the tool failed")
            return text

        return call

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> MCPTools:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def generate_tool(llm, max_tokens: int = 256) -> Tool:
    """The model itself as a tool: a chat reply to one message."""
    from ...chat import ChatSession
    from ...engine.sampling import SamplingParams

    lock = threading.Lock()  # the SDK runs synchronous tools on worker threads; the engine is one loop

    def generate(prompt: str, max_new_tokens: int = max_tokens) -> str:
        """Ask the language model: its reply to one user message.

        Args:
            prompt: the message
            max_new_tokens: the longest reply, in tokens
        """
        if max_new_tokens < 1:
            raise ToolError("max_new_tokens must be at least 1")
        with lock:
            session = ChatSession(llm, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
            return "".join(session.send(prompt)).strip()

    return Tool.from_function(generate)


def mcp_server(tools: list[Tool], name: str = "tokenmind"):
    """An SDK `MCPServer` offering `tools`; run it with `.run("stdio")` or `.run("streamable-http", port=...)`."""
    _sdk()
    from mcp.server.mcpserver import MCPServer

    server = MCPServer(name, instructions="tokenmind's tools: search its document index, ask its model, "
                                          "calculate, run Python in a sandbox, read files.")
    for tool in toolset(tools).values():
        server.add_tool(_reporting(tool.fn), name=tool.name, description=tool.description)
    return server


def _reporting(fn):
    """`fn` with our `ToolError` raised as the SDK's, whose message the client sees (the SDK hides the
    text of any other exception from the client, as a crash)."""
    from mcp.server.mcpserver.exceptions import ToolError as SDKToolError

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ToolError as e:
            raise SDKToolError(str(e)) from None

    return call
