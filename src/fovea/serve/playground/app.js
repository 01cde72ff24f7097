// fovea's playground: plain JS, no build step. It talks to the same OpenAI-compatible API as any
// client: POST /v1/chat/completions with stream: true and fovea's extension
// {"grounding": true, "timing": true}, whose answers arrive in the stream's last chunk.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { dataUrl: null, model: null, busy: false, canaryFailed: false };

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.style.display = text ? "block" : "none";
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function describeError(body, status) {
  // fovea's refusals are {"error": {"message", "type", "param", "code"}}.
  const e = (body && body.error) || {};
  const where = e.param ? ` (${e.param})` : "";
  return `${status ? "HTTP " + status + ": " : ""}${e.code || "error"}${where}\n${e.message || JSON.stringify(body)}`;
}

async function loadHealth() {
  try {
    const reply = await fetch("/health");
    const h = await reply.json();
    state.model = h.model;
    state.canaryFailed = Boolean(h.canary && !h.canary.ok);
    const canary = h.canary ? (h.canary.ok ? "canary passed" : "canary FAILED") : "canary not run";
    $("server").textContent = `Model ${h.model} on ${h.device} (${h.dtype}); ${h.status}, ${canary}.`;
    $("server").className = h.status === "ok" ? "ok" : "bad";
  } catch (err) {
    $("server").textContent = "The server's /health did not answer: " + err;
    $("server").className = "bad";
  }
}

function takeFile(file) {
  showError("");
  if (!file) return;
  $("file-info").textContent = `${file.name || "image"}: ${file.type || "unknown type"}, ${file.size} bytes`;
  const reader = new FileReader();
  reader.onload = () => {
    state.dataUrl = reader.result;
    // The server decides what is an image: a file the browser cannot show is still sent, and the
    // server's refusal (invalid_image, unsupported_image_format, ...) is what the page shows.
    const img = $("preview");
    img.onerror = () => { img.style.display = "none"; $("drop-hint").style.display = "block"; };
    img.src = state.dataUrl;
    img.style.display = "block";
    $("drop-hint").style.display = "none";
  };
  reader.onerror = () => showError("The browser could not read that file: " + reader.error);
  reader.readAsDataURL(file);
}

function resetStats() {
  for (const id of ["grounded", "kl", "encoder", "ttft", "tps", "rid"]) {
    $(id).textContent = "–";
    $(id).className = "";
  }
}

function showFovea(ext) {
  const g = ext.grounding;
  if (g) {
    const line = groundingLine(g, state.canaryFailed);  // grounding.js
    $("grounded").textContent = line.text;
    $("grounded").className = line.className;
    if (typeof g.max_kl === "number") {
      $("kl").textContent = `${g.max_kl.toFixed(3)} (threshold ${g.threshold.toFixed(3)})`;
    }
  }
  const t = ext.timing;
  if (t) {
    $("encoder").textContent = t.encoder_ms === null ? "unknown"
      : `${t.encoder_ms.toFixed(1)} ms (${t.images_encoded} encoded, ${t.images_cached} from the encoder cache)`;
    $("ttft").textContent = t.first_token_ms === null ? "–" : `${t.first_token_ms.toFixed(1)} ms`;
    $("tps").textContent = t.decode_tokens_per_s === null ? `${t.completion_tokens} token(s)`
      : `${t.decode_tokens_per_s.toFixed(1)} tokens/s over ${t.completion_tokens} tokens`;
  }
}

async function ask() {
  if (state.busy) return;
  showError("");
  resetStats();
  $("answer").textContent = "";
  const question = $("question").value.trim();
  if (!state.dataUrl) { showError("Pick or drop an image first."); return; }
  if (!question) { showError("Type a question."); return; }
  state.busy = true;
  $("ask").disabled = true;
  try {
    await loadHealth();  // the canary runs again every --canary-interval: its verdict colours the grounding line
    await streamAnswer(question);
  } catch (err) {
    showError("The request failed: " + err);
  } finally {
    state.busy = false;
    $("ask").disabled = false;
  }
}

async function streamAnswer(question) {
  const body = {
    model: state.model || undefined,
    stream: true,
    fovea: { grounding: true, timing: true },
    messages: [{ role: "user", content: [
      { type: "image_url", image_url: { url: state.dataUrl } },
      { type: "text", text: question },
    ] }],
  };
  const reply = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(body) });
  $("rid").textContent = reply.headers.get("x-request-id") || "–";
  if (!reply.ok) {  // refused before streaming: a JSON error body
    let parsed = null;
    try { parsed = await reply.json(); } catch (_) { parsed = { error: { message: reply.statusText } }; }
    showError(describeError(parsed, reply.status));
    return;
  }
  const reader = reply.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {  // one server-sent event
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        handleChunk(JSON.parse(data));
      }
    }
  }
}

function handleChunk(chunk) {
  if (chunk.error) {  // the stream began, then failed: fovea ends it with an error event
    showError(describeError(chunk, 0));
    return;
  }
  for (const choice of chunk.choices || []) {
    if (choice.delta && choice.delta.content) $("answer").textContent += choice.delta.content;
  }
  if (chunk.fovea) showFovea(chunk.fovea);
}

function setup() {
  const drop = $("drop");
  drop.addEventListener("click", () => $("file").click());
  drop.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") $("file").click(); });
  $("file").addEventListener("change", (e) => takeFile(e.target.files[0]));
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    takeFile(e.dataTransfer.files[0]);
  });
  $("ask").addEventListener("click", ask);
  $("question").addEventListener("keydown", (e) => { if (e.key === "Enter") ask(); });
  loadHealth();
}

setup();
