// The chat page of `h2o-local serve`: a conversation through the server's own /v1/chat/completions (streamed), and
// beside it what the conversation's KV cache keeps (the `kv_cache.view` extension: kept positions and scores with
// every token). No build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), policy: $("policy"), budget: $("budget"), newChat: $("new"), keyBox: $("key-box"),
  key: $("key"), keySave: $("key-save"), error: $("error"), messages: $("messages"), form: $("composer"),
  input: $("input"), send: $("send"), stop: $("stop"), stats: $("cache-stats"), tokens: $("cache-tokens"),
  maxTokens: $("max-tokens"), temperature: $("temperature"),
};

const chat = {
  messages: [],      // the conversation as the API takes it
  modelId: null,
  controller: null,  // aborts the running request
};

// the cache view: the conversation's tokens (pieces) and what the cache holds of them
const cache = { pieces: [], spans: [], positions: [], scores: [], seen: 0, protected: 0, info: null, drawn: 0,
                hostCount: 0, hostFrom: Infinity, wasHost: () => false, back: new Set(), recalled: 0 };

function apiKey() { return localStorage.getItem("h2o_local.api_key") || ""; }

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = "Bearer " + apiKey();
  return h;
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
}

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return response.status + " " + response.statusText;
  }
}

async function needsKey(response) {
  if (response.status !== 401) return false;
  ui.keyBox.hidden = false;
  showError("This server needs an API key: " + await errorText(response));
  ui.key.focus();
  return true;
}

async function loadModel() {
  const response = await fetch("v1/models", { headers: headers() });
  if (await needsKey(response)) return;
  if (!response.ok) { showError(await errorText(response)); return; }
  const model = (await response.json()).data[0];
  chat.modelId = model.id;
  ui.model.textContent = model.id + " · " + model.policy;
  for (const name of model.policies || []) {
    const option = document.createElement("option");
    option.value = option.textContent = name;
    ui.policy.appendChild(option);
  }
  if (model.budget) ui.budget.placeholder = "server's: " + model.budget;
  if (model.max_budget) ui.budget.max = model.max_budget;
  showError("");
  ui.keyBox.hidden = !apiKey();
  document.body.dataset.state = "idle";
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  ui.messages.appendChild(div);
  ui.messages.scrollTop = ui.messages.scrollHeight;
  return div;
}

function setBusy(busy) {
  ui.send.disabled = busy;
  ui.stop.disabled = !busy;
  ui.newChat.disabled = busy;
  document.body.dataset.state = busy ? "answering" : "idle";
}

// the answer's length and temperature as the header sets them (an empty field: the server's default)
function sampling() {
  const out = {};
  if (ui.maxTokens.value) out.max_tokens = Number(ui.maxTokens.value);
  if (ui.temperature.value !== "") out.temperature = Number(ui.temperature.value);
  return out;
}

function conversationCache() {
  const kv = { view: true };
  if (ui.policy.value) kv.policy = ui.policy.value;
  const budget = ui.budget.value.trim();
  if (budget) kv.budget = Number(budget);
  return kv;
}

// ------------------------------------------------------------------------------------------------ the cache view
function takeView(view) {
  if (view.tokens) {  // the first chunk: the whole prompt (the conversation so far, as the template renders it)
    cache.pieces = view.tokens.slice();
    cache.drawn = Infinity;  // drawn again from the start
    cache.info = { policy: view.policy, budget: view.budget };
    cache.protected = view.protected || 0;
    if (!view.recalled) cache.back = new Set();  // a conversation that recalled nothing yet (a new one)
  }
  // a reader that fell behind gets several tokens in one chunk: their pieces, one per token
  if (view.pieces) cache.pieces.push(...view.pieces);
  else if (view.piece !== undefined) cache.pieces.push(view.piece);
  cache.positions = view.positions;
  cache.scores = view.scores;
  cache.seen = view.seen;
  cache.evicted = view.evicted;
  // with recall every evicted position from host_from on waits in host memory (the store drops the oldest first)
  cache.hostCount = view.host || 0;
  cache.hostFrom = view.host ? view.host_from : Infinity;
  cache.recalled = view.recalled || 0;
  const kept = new Set(cache.positions);
  cache.positions.forEach((p) => { if (cache.wasHost(p)) cache.back.add(p); });
  const hostFrom = cache.hostFrom, seen = cache.seen;
  cache.wasHost = (p) => !kept.has(p) && p >= hostFrom && p < seen;
  scheduleDraw();
}

let drawPending = false;
function scheduleDraw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => { if (drawPending) { drawPending = false; drawCache(); } });
}

function flushDraw() {  // a finished answer shows its final cache view at once, not a frame later
  if (drawPending) { drawPending = false; drawCache(); }
}

function shades(scores) {
  // scores span orders of magnitude: shade by rank among the kept entries (as `h2o-local inspect` does)
  const order = scores.map((s, i) => [s, i]).sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  const out = new Array(scores.length).fill(0);
  order.forEach(([, i], rank) => { out[i] = scores.length > 1 ? rank / (scores.length - 1) : 1; });
  return out;
}

function drawCache() {
  // spans are made once per token and only restyled afterwards
  if (cache.drawn > cache.pieces.length) { ui.tokens.textContent = ""; cache.spans = []; cache.drawn = 0; }
  for (let i = cache.drawn; i < cache.pieces.length; i++) {
    const span = document.createElement("span");
    span.textContent = cache.pieces[i];
    span.dataset.index = i;
    ui.tokens.appendChild(span);
    cache.spans.push(span);
  }
  cache.drawn = cache.pieces.length;
  const kept = new Map();  // position -> [shade, score]
  const shade = shades(cache.scores);
  cache.positions.forEach((p, k) => kept.set(p, [shade[k], cache.scores[k]]));
  cache.spans.forEach((span, i) => {
    let cls = "tok ";
    if (i >= cache.seen) cls += "pending";
    else if (kept.has(i)) cls += "kept" + (i < cache.protected ? " protected" : "") + (cache.back.has(i) ? " recalled" : "");
    else if (i >= cache.hostFrom) cls += "host";
    else cls += "evicted";
    if (span.className !== cls) span.className = cls;
    const entry = kept.get(i);
    const value = entry ? entry[0].toFixed(3) : "";
    if (span.style.getPropertyValue("--shade") !== value) span.style.setProperty("--shade", value);
    span.title = "position " + i + (entry ? ", score " + entry[1] : "");
  });
  const info = cache.info || {};
  ui.stats.textContent = "policy " + info.policy + " · budget " + info.budget + " · kept " + cache.positions.length +
    " · evicted " + cache.evicted + (cache.hostCount ? " · in host memory " + cache.hostCount + " · recalled " +
    cache.recalled : "") + " · tokens seen " + cache.seen;
  ui.stats.dataset.kept = cache.positions.length;
  ui.stats.dataset.policy = info.policy || "";
  ui.tokens.scrollTop = ui.tokens.scrollHeight;
}

// ------------------------------------------------------------------------------------------------ the conversation
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split(/\r?\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;  // comments (pings), blank lines
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function send(text) {
  showError("");
  const userMessage = { role: "user", content: text };
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  setBusy(true);
  ui.policy.disabled = ui.budget.disabled = true;  // chosen once per conversation
  chat.controller = new AbortController();
  let answer = "", reasoning = "";
  let finish = null;
  try {
    const response = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), signal: chat.controller.signal,
      body: JSON.stringify({ model: chat.modelId, messages: chat.messages.concat([userMessage]), stream: true,
                             kv_cache: conversationCache(), ...sampling() }),
    });
    if (!response.ok) {
      if (!(await needsKey(response))) showError(await errorText(response));
      bubble.remove();
      if (!chat.messages.length) ui.policy.disabled = ui.budget.disabled = false;
      return;
    }
    for await (const chunk of sseEvents(response)) {
      if (chunk.kv_cache) takeView(chunk.kv_cache);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta && (choice.delta.content || choice.delta.reasoning_content)) {
        answer += choice.delta.content || "";
        reasoning += choice.delta.reasoning_content || "";
        fillAnswer(bubble, reasoning, answer);
        ui.messages.scrollTop = ui.messages.scrollHeight;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  } catch (e) {
    if (e.name !== "AbortError") showError("The request failed: " + e.message);
    finish = finish || "stopped";
  } finally {
    chat.controller = null;
    flushDraw();
    setBusy(false);
  }
  chat.messages.push(userMessage, { role: "assistant", content: answer });
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = (finish || "stopped") + (cache.info ? " · " + cache.info.policy : "");
  bubble.appendChild(meta);
  bubble.dataset.finish = finish || "stopped";
}

// a thinking model's reasoning (the server gives it apart, as llama-server does) above its answer, dimmed
function fillAnswer(bubble, reasoning, answer) {
  bubble.textContent = "";
  if (reasoning) {
    const thinking = document.createElement("span");
    thinking.className = "thinking";
    thinking.textContent = reasoning.trim();
    bubble.appendChild(thinking);
  }
  bubble.appendChild(document.createTextNode(answer));
}

function newConversation() {
  if (chat.controller) chat.controller.abort();
  chat.messages = [];
  ui.messages.textContent = "";
  ui.tokens.textContent = "";
  Object.assign(cache, { pieces: [], spans: [], positions: [], scores: [], seen: 0, protected: 0, info: null, drawn: 0 });
  ui.stats.textContent = "The conversation's KV cache appears here as it answers.";
  ui.policy.disabled = ui.budget.disabled = false;
  showError("");
  ui.input.focus();
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = ui.input.value.trim();
  if (!text || chat.controller) return;
  ui.input.value = "";
  send(text);
});
ui.input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); ui.form.requestSubmit(); }
});
ui.stop.addEventListener("click", () => { if (chat.controller) chat.controller.abort(); });
ui.newChat.addEventListener("click", newConversation);
ui.keySave.addEventListener("click", () => {
  localStorage.setItem("h2o_local.api_key", ui.key.value.trim());
  loadModel();
});

loadModel().catch((e) => showError("Cannot reach the server: " + e.message));
