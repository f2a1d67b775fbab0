// The tokenmind image page: pick a class of the served diffusion model, POST /v1/images/generations,
// show the PNGs. Every string from the server goes into the page as textContent or an <option>'s
// text, never as markup; images are shown only from base64 that is checked to be base64, as
// data:image/png URLs, so a response cannot make the page load anything else.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), form: $("image-form"), cls: $("class"), n: $("n"), steps: $("steps"),
  guidance: $("guidance"), seed: $("seed"), generate: $("generate"), gallery: $("gallery"), empty: $("empty"),
  status: $("status"), apiKey: $("api-key"),
};
const state = { model: null };
const BASE64 = /^[A-Za-z0-9+/]+={0,2}$/;

function headers() {
  const h = { "Content-Type": "application/json" };
  if (ui.apiKey.value) h["Authorization"] = "Bearer " + ui.apiKey.value;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && typeof body.error.message === "string") return body.error.message;
  } catch (e) { /* not JSON */ }
  return response.status + " " + response.statusText;
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) {
    ui.model.textContent = response.status === 401 ? "API key needed (Settings)" : await errorMessage(response);
    return;
  }
  const card = (await response.json()).data[0];
  state.model = card.id;
  ui.model.textContent = `${card.id} (${card.size})`;
  ui.cls.replaceChildren(...card.classes.map((name) => new Option(name, name)));
  ui.n.max = String(card.max_images);
  ui.generate.disabled = false;
}

function numberOrNull(input) {
  return input.value === "" ? null : Number(input.value);
}

async function generate(event) {
  event.preventDefault();
  const request = { model: state.model, prompt: ui.cls.value, n: numberOrNull(ui.n) ?? 1,
                    steps: numberOrNull(ui.steps) ?? 25, guidance_scale: numberOrNull(ui.guidance) ?? 3,
                    response_format: "b64_json" };
  const seed = numberOrNull(ui.seed);
  if (seed !== null) request.seed = seed;
  ui.generate.disabled = true;
  ui.status.textContent = "generating…";
  const started = performance.now();
  try {
    const response = await fetch("/v1/images/generations", { method: "POST", headers: headers(),
                                                              body: JSON.stringify(request) });
    if (!response.ok) {
      ui.status.textContent = "error: " + await errorMessage(response);
      return;
    }
    const body = await response.json();
    const row = document.createElement("figure");
    row.className = "image-row";
    for (const item of body.data) {
      if (typeof item.b64_json !== "string" || !BASE64.test(item.b64_json)) continue;
      const img = document.createElement("img");
      img.src = "data:image/png;base64," + item.b64_json;
      img.alt = request.prompt;
      row.appendChild(img);
    }
    const caption = document.createElement("figcaption");
    caption.textContent = `${request.prompt} · ${request.steps} steps · guidance ${request.guidance_scale}`;
    row.appendChild(caption);
    ui.empty.hidden = true;
    ui.gallery.prepend(row);
    ui.status.textContent = `${row.querySelectorAll("img").length} images in ${
      ((performance.now() - started) / 1000).toFixed(1)} s`;
  } catch (e) {
    ui.status.textContent = "error: " + e.message;
  } finally {
    ui.generate.disabled = false;
  }
}

ui.form.addEventListener("submit", generate);
ui.apiKey.addEventListener("change", loadModel);
loadModel();
