"""The agent loop (ReAct as function calling): the model replies; each tool call it makes is run and
its result goes back as a `tool` message; repeat until a reply calls no tool (the answer) or a step or
time limit ends it. A call repeated with the same arguments is not run again: its earlier result comes
back with a reminder to use it (small models otherwise loop on the same call).

Every event (the task, each reply, each tool result, the end) is one JSON object: appended to a JSONL
transcript as it happens and passed to `on_event` (the CLI prints a readable trace with `format_event`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .tools import Tool, toolset



@dataclass
class AgentResult:
    answer: str | None  # the final reply's text; None when a limit ended the run first
    stop_reason: str  # "answer", "step limit", "time limit"
    steps: int  # model replies
    tool_calls: int
    seconds: float
    messages: list[dict] = field(default_factory=list)  # the whole conversation, OpenAI-shaped


def run_agent(chat, task: str, tools: list[Tool] = (), *, system: str | None = None, max_steps: int = 8,
              time_limit_s: float = 300.0, tool_choice: str = "auto", transcript: str | Path | None = None,
              on_event: Callable[[dict], None] | None = None) -> AgentResult:
    """Solve `task` with `chat` (a `LocalChat` or `RemoteChat`) and `tools`. The time limit is checked
    between steps (a reply or tool already running is not interrupted).

    `system`: a system message; None leaves the template's own default (Qwen2.5-Coder-1.5B called the
    calculator in 3 of 3 word problems under its default, in 0 of 3 under an instruction of ours to use
    the tools).

    `tool_choice`: "auto" lets the model choose; "required" (or a tool's name) forces a call until the
    first one is made, then returns to "auto" so the model can answer (the OpenAI Agents SDK's
    `reset_tool_choice`). Qwen2.5-Coder-1.5B describes a search ("I will search the documents...")
    instead of calling it; forcing the first step makes it search."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    named = toolset(list(tools))
    schemas = [t.schema() for t in named.values()]
    if tool_choice not in ("auto", "required", *named):
        raise ValueError(f"tool_choice must be 'auto', 'required' or a tool's name ({', '.join(named) or 'none'}), "
                         f"got {tool_choice!r}")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": task}]
    start = time.perf_counter()
    log = open(transcript, "a", encoding="utf-8") if transcript else None

    def emit(event: dict) -> None:
        event = {"t": round(time.perf_counter() - start, 3), **event}
        if log:
            log.write(json.dumps(event, ensure_ascii=False) + "\n")
            log.flush()
        if on_event:
            on_event(event)

    steps = calls = 0
    answer, reason = None, "step limit"
    done: dict[tuple[str, str], str] = {}  # (tool, arguments) → its result, for repeated calls
    try:
        emit({"type": "task", "task": task, "tools": list(named), "system": system})
        while steps < max_steps:
            if time.perf_counter() - start > time_limit_s:
                reason = "time limit"
                break
            reply = chat.reply(messages, schemas, tool_choice if schemas and not calls else "auto")
            steps += 1
            messages.append(reply)
            emit({"type": "assistant", "step": steps, "content": reply.get("content"),
                  "tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                 for c in reply.get("tool_calls", [])]})
            if not reply.get("tool_calls"):
                answer, reason = reply.get("content") or "", "answer"
                break
            for call in reply["tool_calls"]:
                name, arguments = call["function"]["name"], call["function"]["arguments"]
                tool = named.get(name)
                t0 = time.perf_counter()
                key = (name, _canonical(arguments))
                if key in done:  # small models re-issue a call instead of reading its result: point them back
                    result = (f"You already called {name} with these arguments; the result was:\n{done[key]}\n"
                              "Use it to answer.")
                else:
                    result = done[key] = (tool.call(arguments) if tool else f"error: there is no tool {name!r}; "
                                          f"the tools are {', '.join(named) or 'none'}")
                calls += 1
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": result})
                emit({"type": "tool", "step": steps, "name": name, "arguments": arguments, "result": result,
                      "seconds": round(time.perf_counter() - t0, 3)})
        result = AgentResult(answer, reason, steps, calls, time.perf_counter() - start, messages)
        emit({"type": "end", "reason": reason, "answer": answer, "steps": steps, "tool_calls": calls})
        return result
    finally:
        if log:
            log.close()


def _canonical(arguments) -> str:
    """Arguments as comparable text: parsed JSON re-serialised with sorted keys (as given if not JSON)."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments
    return json.dumps(value, sort_keys=True)


def _clip(text: str, limit: int = 400) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f" [... {len(text) - limit} more characters]"


def format_event(event: dict) -> str:
    """One transcript event as readable lines (the CLI's trace)."""
    kind = event["type"]
    if kind == "task":
        return f"task: {event['task']}\ntools: {', '.join(event['tools']) or '(none)'}"
    if kind == "assistant":
        label = "thought" if event["tool_calls"] else "answer"
        lines = [f"[{event['step']}] {label}: {_clip(event['content'])}"] if event.get("content") else []
        lines += [f"[{event['step']}] call: {c['name']}({c['arguments']})" for c in event["tool_calls"]]
        return "\n".join(lines) or f"[{event['step']}] (empty reply)"
    if kind == "tool":
        return f"[{event['step']}] {event['name']} → {_clip(event['result'])}  ({event['seconds']:.2f} s)"
    if kind == "end":
        return f"end: {event['reason']} after {event['steps']} steps, {event['tool_calls']} tool calls"
    return json.dumps(event)
