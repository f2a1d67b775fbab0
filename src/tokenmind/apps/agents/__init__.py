"""Agents: a function-calling (ReAct) loop over tokenmind's engine or any OpenAI-compatible server,
typed tools (calculator, sandboxed Python, RAG search, files), MCP both ways, and a task-set evaluation."""

from .builtin import calculator_tool, file_tools, python_tool, search_tool
from .chat import LocalChat, RemoteChat
from .loop import AgentResult, format_event, run_agent
from .tools import Tool, ToolError

__all__ = ["AgentResult", "LocalChat", "RemoteChat", "Tool", "ToolError", "calculator_tool", "file_tools",
           "format_event", "python_tool", "run_agent", "search_tool"]
