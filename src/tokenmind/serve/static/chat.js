// The tokenmind chat page: one conversation, streamed over POST /v1/chat/completions (SSE).
// No framework and no build step. EventSource cannot POST, so the stream is read with fetch +
// ReadableStream and split into `data: ...` events by hand. Stop aborts the fetch: the server
// sees the connection close and aborts the generation, freeing its KV cache.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  conversation: $("conversation"), empty: $("empty"), input: $("input"), send: $("send"), stop: $("stop"),
  form: $("composer"), model: $("model"), status: $("status"), newChat: $("new-chat"),
  temperature: $("temperature"), temperatureValue: $("temperature-value"), maxTokens: $("max-tokens"),
  system: $("system"), apiKey: $("api-key"),
};

const state = { messages: [], model: null, controller: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  if (ui.apiKey.value) h["Authorization"] = "Bearer " + ui.apiKey.value;
  return h;
}

function addBubble(role, text) {
  ui.empty.hidden = true;
  const div = document.createElement("div");
  div.className = "message " + role;
  div.dataset.role = role;
  div.textContent = text;  // textContent, never innerHTML: model output is not trusted markup
  ui.conversation.appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function addNote(bubble, text) {
  const note = document.createElement("span");
  note.className = "note";
  note.textContent = text;
  bubble.appendChild(note);
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : JSON.stringify(body);
  } catch (_) {
    return response.status + " " + response.statusText;
  }
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) {
      ui.model.textContent = response.status === 401 ? "API key needed (Settings)" : await errorMessage(response);
      return;
    }
    state.model = (await response.json()).data[0].id;
    ui.model.textContent = state.model;
  } catch (e) {
    ui.model.textContent = "server unreachable";
  }
}

// Yields the parsed JSON of each `data:` event until `[DONE]`.
async function* serverSentEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) !== -1) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  ui.input.disabled = busy;
}

async function send(text) {
  if (!state.model) await loadModel();
  if (!state.model) return;
  state.messages.push({ role: "user", content: text });
  addBubble("user", text);
  const bubble = addBubble("assistant", "");
  bubble.classList.add("streaming");
  const system = ui.system.value.trim();
  const body = {
    model: state.model, stream: true, stream_options: { include_usage: true },
    messages: (system ? [{ role: "system", content: system }] : []).concat(state.messages),
    temperature: Number(ui.temperature.value), max_tokens: Number(ui.maxTokens.value),
  };
  state.controller = new AbortController();
  setBusy(true);
  ui.status.textContent = "generating…";
  let reply = "", finish = null, usage = null;
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of serverSentEvents(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices) {
        if (choice.delta && choice.delta.content) {
          reply += choice.delta.content;
          bubble.textContent = reply;
          bubble.scrollIntoView({ block: "end" });
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    const seconds = (performance.now() - started) / 1000;
    ui.status.textContent = usage
      ? `${usage.completion_tokens} tokens in ${seconds.toFixed(1)} s (${(usage.completion_tokens / seconds).toFixed(1)} tok/s), finish: ${finish}`
      : `finish: ${finish}`;
    bubble.dataset.finish = finish || "";
  } catch (e) {
    if (e.name === "AbortError") {
      addNote(bubble, "[stopped]");
      bubble.dataset.finish = "stopped";
      ui.status.textContent = "stopped";
    } else {
      bubble.classList.add("error");
      bubble.textContent = reply;
      addNote(bubble, "error: " + e.message);
      bubble.dataset.finish = "error";
      ui.status.textContent = "error";
    }
  } finally {
    bubble.classList.remove("streaming");
    // What was said stays in the conversation, also when stopped early; a failed turn is dropped.
    if (bubble.dataset.finish === "error") state.messages.pop();
    else state.messages.push({ role: "assistant", content: reply });
    state.controller = null;
    setBusy(false);
    ui.input.focus();
  }
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.input.value.trim();
  if (!text || state.controller) return;
  ui.input.value = "";
  send(text);
});
ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    ui.form.requestSubmit();
  }
});
ui.stop.addEventListener("click", () => state.controller && state.controller.abort());
ui.newChat.addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.messages = [];
  ui.conversation.querySelectorAll(".message").forEach((m) => m.remove());
  ui.empty.hidden = false;
  ui.status.textContent = "";
});
ui.temperature.addEventListener("input", () => { ui.temperatureValue.textContent = ui.temperature.value; });
ui.apiKey.value = localStorage.getItem("tokenmind-api-key") || "";
ui.apiKey.addEventListener("change", () => {
  localStorage.setItem("tokenmind-api-key", ui.apiKey.value);
  loadModel();
});
loadModel();
