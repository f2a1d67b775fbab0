// The tokenmind chat page: one conversation, streamed over POST /v1/chat/completions (SSE).
// No framework and no build step. EventSource cannot POST, so the stream is read with fetch +
// ReadableStream and split into `data: ...` events by hand. Stop aborts the fetch: the server
// sees the connection close and aborts the generation, freeing its KV cache. Assistant replies are
// rendered as sanitised markdown (vendor/: marked + DOMPurify) and streamed tool calls as blocks of
// name and arguments; user messages stay plain text. When the served model reads images (its
// /v1/models card lists "image" in `input_modalities`), images can be attached, pasted or dropped:
// they go out as OpenAI `image_url` parts holding PNG or JPEG data URLs, before the message's text.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  conversation: $("conversation"), empty: $("empty"), input: $("input"), send: $("send"), stop: $("stop"),
  form: $("composer"), model: $("model"), status: $("status"), newChat: $("new-chat"),
  temperature: $("temperature"), temperatureValue: $("temperature-value"), maxTokens: $("max-tokens"),
  system: $("system"), apiKey: $("api-key"), attach: $("attach"), file: $("image-file"), attachments: $("attachments"),
};

// `attachments`: the images waiting in the composer, each {name, url, width, height}; `reading`: the
// chain of image reads (attachFiles).
const state = {
  messages: [], model: null, controller: null, acceptsImages: false, attachments: [], reading: Promise.resolve(),
};

function headers() {
  const h = { "Content-Type": "application/json" };
  if (ui.apiKey.value) h["Authorization"] = "Bearer " + ui.apiKey.value;
  return h;
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function addBubble(role, text, images = []) {
  ui.empty.hidden = true;
  const div = element("div", "message " + role, text);  // textContent: user text is never parsed as markup
  div.dataset.role = role;
  if (images.length) div.prepend(thumbnails(images));
  ui.conversation.appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function thumbnails(images) {
  const row = element("div", "thumbnails");
  for (const image of images) {
    const img = row.appendChild(element("img"));
    img.src = image.url;  // always a data: URL this page drew itself (see readImage)
    img.alt = image.name;
  }
  return row;
}

// --- Images: attach, paste or drop; downscaled and re-encoded on a canvas -------------------------------
// Every image is drawn onto a canvas at most MAX_IMAGE_SIDE pixels on its longer side (on white, so
// transparency does not turn black) and sent as PNG or JPEG, whichever is smaller — PNG for drawings and
// screenshots, JPEG (quality 0.9) for photos, where a 512-pixel PNG is several times larger. So requests
// stay small (a VLM resizes to its ViT's few pixels anyway; the server's default limit is 4 MiB per
// image), any format the browser reads (GIF, BMP, HEIC on Safari...) arrives as one the server decodes,
// and the file's metadata (EXIF location, ...) never leaves the browser.
const MAX_IMAGE_SIDE = 512;

async function readImage(file) {
  let bitmap;
  try {
    bitmap = await createImageBitmap(file);
  } catch (_) {
    throw new Error(`${file.name || "the pasted file"} is not an image this browser can read`);
  }
  const scale = Math.min(1, MAX_IMAGE_SIDE / Math.max(bitmap.width, bitmap.height));
  const canvas = element("canvas");
  canvas.width = Math.max(1, Math.round(bitmap.width * scale));
  canvas.height = Math.max(1, Math.round(bitmap.height * scale));
  const context = canvas.getContext("2d");
  context.fillStyle = "white";
  context.fillRect(0, 0, canvas.width, canvas.height);
  context.imageSmoothingQuality = "high";
  context.drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  const png = canvas.toDataURL("image/png"), jpeg = canvas.toDataURL("image/jpeg", 0.9);
  return { name: file.name || "pasted image", url: jpeg.length < png.length ? jpeg : png, width: canvas.width,
    height: canvas.height };
}

function imagesRefusal() {
  return state.model ? `${state.model} reads text only; serve a vision-language model (tokenmind serve --model VLM_DIR) `
    + "to attach images" : "not connected to a model yet";
}

// One batch of files at a time, in the order they came (a paste, then a drop: that order in the
// composer), each read in turn; the status line says what happened (role=status: screen readers hear it).
function attachFiles(files) {
  state.reading = state.reading.then(async () => {
    if (!state.acceptsImages) {
      ui.status.textContent = imagesRefusal();
      return;
    }
    const failed = [];
    for (const file of files) {
      try {
        state.attachments.push(await readImage(file));
      } catch (e) {
        failed.push(e.message);
      }
    }
    renderAttachments();
    const count = state.attachments.length;
    if (failed.length) ui.status.textContent = "error: " + failed.join("; ");
    else if (!state.controller) ui.status.textContent = `${count} image${count === 1 ? "" : "s"} attached`;
  }).catch((e) => { ui.status.textContent = "error: " + e.message; });  // the chain goes on after a failure
}

// The composer's thumbnails, each with a Remove button; an image alone (no text) may be sent.
function renderAttachments() {
  ui.attachments.replaceChildren(...state.attachments.map((image, index) => {
    const item = element("li", "attachment");
    item.appendChild(thumbnails([image]));
    const remove = item.appendChild(element("button", "remove", "×"));
    remove.type = "button";
    remove.dataset.index = String(index);
    remove.setAttribute("aria-label", `Remove image ${image.name}`);
    remove.title = `Remove ${image.name} (${image.width}×${image.height})`;
    return item;
  }));
  ui.attachments.hidden = state.attachments.length === 0;
  ui.input.required = state.attachments.length === 0;
}

function onRemoveClick(event) {
  const button = event.target.closest("button.remove");
  if (!button) return;
  state.attachments.splice(Number(button.dataset.index), 1);
  renderAttachments();
  // Keyboard users keep their place: the next Remove button, else the attach button.
  const buttons = ui.attachments.querySelectorAll("button.remove");
  (buttons[Math.min(Number(button.dataset.index), buttons.length - 1)] || ui.attach).focus();
}

// aria-disabled rather than disabled: the button stays focusable and its tooltip says why.
function updateAttach() {
  ui.attach.setAttribute("aria-disabled", String(!state.acceptsImages));
  ui.attach.title = state.acceptsImages
    ? `Attach images (or paste or drop them); sent at most ${MAX_IMAGE_SIDE} px on a side` : imagesRefusal();
}

// OpenAI's content parts: the images first, then the text (the layout LLaVA-style models train on).
function userContent(text, images) {
  if (!images.length) return text;
  const parts = images.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
  return text ? parts.concat([{ type: "text", text }]) : parts;
}

// Markdown → HTML is marked's job, HTML → safe DOM is DOMPurify's. Two choices on top: raw HTML in
// the model's text is shown as text (escaped), not interpreted, and images become plain links, so a
// reply cannot make the browser fetch a URL on its own. DOMPurify still checks everything marked
// emits (e.g. it drops `javascript:` hrefs), as a second line of defence.
const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const markdown = window.marked && window.DOMPurify && DOMPurify.isSupported
  ? new marked.Marked({
    gfm: true,
    renderer: {
      html: (token) => (token.block
        ? `<p class="raw-html">${escapeHtml(token.text.trimEnd())}</p>` : escapeHtml(token.text)),
      image: (token) => `<a href="${escapeHtml(token.href)}">${escapeHtml(token.text || token.href)}</a>`,
    },
  })
  : null;  // vendor scripts missing: replies fall back to plain text

// Replaces `target`'s children with `text` rendered as sanitised markdown.
function renderMarkdown(target, text) {
  if (!markdown) {
    target.classList.add("plain");
    target.textContent = text;
    return;
  }
  const fragment = DOMPurify.sanitize(markdown.parse(text), { RETURN_DOM_FRAGMENT: true });
  for (const link of fragment.querySelectorAll("a[href]")) {
    link.target = "_blank";
    link.rel = "noopener noreferrer";
  }
  for (const pre of fragment.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    const language = code && /(?:^|\s)language-(\S+)/.exec(code.className);
    const block = element("div", "code-block");
    const bar = block.appendChild(element("div", "code-bar"));
    bar.appendChild(element("span", "language", language ? language[1] : ""));
    const copy = bar.appendChild(element("button", "copy", "Copy"));
    copy.type = "button";
    copy.setAttribute("aria-label", "Copy code");
    pre.replaceWith(block);
    block.appendChild(pre);
  }
  target.replaceChildren(fragment);
}

// The Copy buttons are re-created on every render, so one delegated listener serves them all.
// navigator.clipboard exists only in secure contexts (https, localhost); plain-http hosts fall back.
async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = element("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.appendChild(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("copy refused");
}

function onCopyClick(event) {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const pre = button.closest(".code-block").querySelector("pre");
  copyText(pre.textContent).then(() => "Copied", () => "Copy failed").then((label) => {
    button.textContent = label;
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
}

// One assistant message while it streams: the text so far (re-rendered as markdown at most once a
// frame, so a long reply costs one parse per frame, not per token) and its tool calls. A half-written
// code fence is harmless: marked treats an unclosed fence as running to the end of the text.
class AssistantMessage {
  constructor(bubble) {
    this.bubble = bubble;
    this.content = bubble.appendChild(element("div", "content"));
    this.tools = bubble.appendChild(element("div", "tool-calls"));
    this.text = "";
    this.calls = [];  // by delta index: {id, name, args, block}
    this.frame = 0;
  }

  appendText(delta) {
    this.text += delta;
    this.schedule();
  }

  // OpenAI streaming format: fragments share an `index`; the first carries id and function name,
  // later ones carry pieces of `function.arguments` that concatenate to a JSON string.
  appendToolCall(delta) {
    const index = delta.index ?? 0;
    if (!this.calls[index]) {
      const block = element("div", "tool-call");
      block.setAttribute("role", "group");
      const head = block.appendChild(element("div", "tool-head"));
      head.append(element("span", "muted", "Tool call "), element("code", "tool-name"),
        element("span", "tool-id muted"));
      block.appendChild(element("pre", "tool-args"));
      this.tools.appendChild(block);
      this.calls[index] = { id: "", name: "", args: "", block };
    }
    const call = this.calls[index];
    if (delta.id) call.id = delta.id;
    if (delta.function && delta.function.name) call.name += delta.function.name;
    if (delta.function && delta.function.arguments) call.args += delta.function.arguments;
    this.schedule();
  }

  schedule() {
    if (!this.frame) this.frame = requestAnimationFrame(() => this.render());
  }

  render() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    renderMarkdown(this.content, this.text);
    for (const call of this.calls.filter(Boolean)) {
      call.block.setAttribute("aria-label", "Tool call " + call.name);
      call.block.querySelector(".tool-name").textContent = call.name;
      call.block.querySelector(".tool-id").textContent = call.id ? " " + call.id : "";
      call.block.querySelector(".tool-args").textContent = prettyJson(call.args);
    }
    this.bubble.scrollIntoView({ block: "end" });
  }
}

// Arguments as indented JSON once they parse; until then (mid-stream) the raw fragments.
function prettyJson(text) {
  try {
    return JSON.stringify(JSON.parse(text), null, 2);
  } catch (_) {
    return text;
  }
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
    const card = (await response.json()).data[0];
    state.model = card.id;
    state.acceptsImages = (card.input_modalities || []).includes("image");
    ui.model.textContent = state.model;
  } catch (e) {
    ui.model.textContent = "server unreachable";
  } finally {
    updateAttach();
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
  ui.attach.disabled = busy;
}

async function send(text, images) {
  if (!state.model) await loadModel();
  if (!state.model) return;
  const messages = state.messages;  // New chat swaps in a new list; this turn finishes into its own
  messages.push({ role: "user", content: userContent(text, images) });  // images stay in the history
  addBubble("user", text, images);
  const bubble = addBubble("assistant", "");
  const message = new AssistantMessage(bubble);
  bubble.classList.add("streaming");
  ui.conversation.setAttribute("aria-busy", "true");  // screen readers wait for the finished reply
  const system = ui.system.value.trim();
  const body = {
    model: state.model, stream: true, stream_options: { include_usage: true },
    messages: (system ? [{ role: "system", content: system }] : []).concat(messages),
    temperature: Number(ui.temperature.value), max_tokens: Number(ui.maxTokens.value),
  };
  state.controller = new AbortController();
  setBusy(true);
  ui.status.textContent = "generating…";
  let finish = null, usage = null;
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: state.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const chunk of serverSentEvents(response.body)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) message.appendText(delta.content);
        for (const call of delta.tool_calls || []) message.appendToolCall(call);
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
    message.render();
    if (finish === "tool_calls") addNote(bubble, "finish_reason: tool_calls (this page does not run tools)");
    const seconds = (performance.now() - started) / 1000;
    ui.status.textContent = usage
      ? `${usage.completion_tokens} tokens in ${seconds.toFixed(1)} s (${(usage.completion_tokens / seconds).toFixed(1)} tok/s), finish: ${finish}`
      : `finish: ${finish}`;
    bubble.dataset.finish = finish || "";
  } catch (e) {
    message.render();
    if (e.name === "AbortError") {
      addNote(bubble, "[stopped]");
      bubble.dataset.finish = "stopped";
      ui.status.textContent = "stopped";
    } else {
      bubble.classList.add("error");
      addNote(bubble, "error: " + e.message);
      bubble.dataset.finish = "error";
      ui.status.textContent = "error";
    }
  } finally {
    bubble.classList.remove("streaming");
    ui.conversation.removeAttribute("aria-busy");
    // What was said stays in the conversation, also when stopped early; a failed turn is dropped.
    // Tool calls are shown but not sent back: the page offers no tools, so it has no results to pair them with.
    if (bubble.dataset.finish === "error") messages.pop();
    else messages.push({ role: "assistant", content: message.text });
    state.controller = null;
    setBusy(false);
    ui.input.focus();
  }
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.input.value.trim();
  const images = state.attachments;
  if ((!text && !images.length) || state.controller) return;
  ui.input.value = "";
  state.attachments = [];
  renderAttachments();
  send(text, images);
});
ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    ui.form.requestSubmit();
  }
});
ui.conversation.addEventListener("click", onCopyClick);
ui.attach.addEventListener("click", () => {
  if (state.acceptsImages) ui.file.click();
  else ui.status.textContent = imagesRefusal();
});
ui.file.addEventListener("change", () => {
  const files = [...ui.file.files];
  ui.file.value = "";  // choosing the same file again is a change too
  attachFiles(files);
});
ui.attachments.addEventListener("click", onRemoveClick);
ui.input.addEventListener("paste", (event) => {
  const files = [...event.clipboardData.files].filter((f) => f.type.startsWith("image/"));
  if (!files.length) return;  // text pastes as usual
  event.preventDefault();
  attachFiles(files);
});
// Anywhere on the page: a file dropped outside the composer would otherwise replace the page with it.
// Dragged text is left alone (it drops into the message box as usual).
const carriesFiles = (event) => [...event.dataTransfer.types].includes("Files");
document.addEventListener("dragover", (event) => { if (carriesFiles(event)) event.preventDefault(); });
document.addEventListener("drop", (event) => {
  if (!carriesFiles(event)) return;
  event.preventDefault();
  attachFiles([...event.dataTransfer.files]);
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
