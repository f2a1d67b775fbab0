"""Where an agent's replies come from: tokenmind's own engine in this process (`LocalChat`), or any
OpenAI-compatible server (`RemoteChat`: `tokenmind serve`, vLLM, llama-server, OpenAI).

Both take OpenAI-shaped messages, tool definitions and a `tool_choice` ("auto", "required" or a
function's name, as in the OpenAI API) and return one assistant message
`{"role": "assistant", "content": str | None, "tool_calls": [...]}`, so the loop never knows which it
talks to. The local one shows the tools to the model and reads its calls back exactly as the server
does (`serve/tool_calls.py`, per chat-template family).
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

from ...engine.sampling import SamplingParams
from ...engine.structured import StructuredOutput
from ...serve.tool_calls import FORMATS, ToolFormat, format_for_template


class LocalChat:
    """Replies from an `LLM` (one request at a time), with tool calls in the template's own format."""

    def __init__(self, llm, params: SamplingParams | None = None, tool_format: str | None = None):
        self.llm = llm
        self.llm.tokenizer.get_chat_template()  # no template: fail now, naming the fix
        self.params = params or SamplingParams(max_tokens=512, temperature=0.0)
        self.format: ToolFormat = (FORMATS[tool_format] if tool_format
                                   else format_for_template(llm.tokenizer.chat_template))
        self.prompt_tokens = self.completion_tokens = 0

    def reply(self, messages: list[dict], tools: list[dict], tool_choice: str = "auto") -> dict:
        shown, template_tools = self.format.prepare(messages, tools or None)
        prompt = self.llm.tokenizer.apply_chat_template(shown, tools=template_tools, add_generation_prompt=True)
        context = self.llm.engine.max_model_len
        if len(prompt) >= context:
            raise ValueError(f"the conversation has grown to {len(prompt)} tokens, past the model's context of "
                             f"{context}; give the agent fewer steps or tools that return less text")
        params = self.params
        if len(prompt) + params.max_tokens > context:
            params = dataclasses.replace(params, max_tokens=context - len(prompt))
        if tools and tool_choice != "auto":  # the reply must be one call, as the server forces it
            special = self.llm.engine.grammar.special_tokens(self.format.markup)
            grammar = self.format.grammar(tools, None if tool_choice == "required" else tool_choice, False, special)
            params = dataclasses.replace(params, structured=StructuredOutput(lark=grammar))
        out = self.llm.generate(prompt, params, progress=False)[0]
        self.prompt_tokens += len(prompt)
        self.completion_tokens += len(out.token_ids)
        content, calls = self.format.parse(out.text) if tools else (out.text.strip() or None, [])
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message


class RemoteChat:
    """Replies from an OpenAI-compatible `/v1/chat/completions` endpoint (standard library HTTP)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, temperature: float = 0.0,
                 max_tokens: int = 512, timeout_s: float = 300.0):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s
        self.temperature, self.max_tokens = temperature, max_tokens
        self.prompt_tokens = self.completion_tokens = 0

    def reply(self, messages: list[dict], tools: list[dict], tool_choice: str = "auto") -> dict:
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens}
        if tools:
            body["tools"] = tools
            if tool_choice != "auto":  # one call, as `LocalChat` forces it
                body["tool_choice"] = (tool_choice if tool_choice == "required"
                                       else {"type": "function", "function": {"name": tool_choice}})
                body["parallel_tool_calls"] = False
        request = urllib.request.Request(self.url, json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {self.api_key}"}
                                                     if self.api_key else {})})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as e:  # 4xx: this request was wrong (model name, context); 5xx: the server
            detail = e.read().decode(errors="replace")[:500]
            raise (ValueError if e.code < 500 else ConnectionError)(f"{self.url} answered {e.code}: {detail}") from None
        except urllib.error.URLError as e:
            raise ConnectionError(f"cannot reach {self.url} ({e.reason}); is the server running?") from None
        usage = answer.get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        message = answer["choices"][0]["message"]
        out: dict = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            out["tool_calls"] = [{"id": c["id"], "type": "function", "function": c["function"]}
                                 for c in message["tool_calls"]]
        return out
