// jaxllm's chat page: streamed chat completions from this server's /v1 API, conversations in localStorage.
// No dependencies. Model output is never put into the page as HTML: renderMarkdown escapes every character
// of it first and only then adds the few tags it makes itself (code blocks, emphasis, lists, http(s) links).
"use strict";

const STORE = { conversations: "jaxllm.conversations", current: "jaxllm.current", settings: "jaxllm.settings", key: "jaxllm.apiKey" };
const $ = (id) => document.getElementById(id);

// ---- markdown, safely ---------------------------------------------------------------------------------------

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

// Inline markup of one escaped line: code spans first (their contents stay literal), then links, bold, italic.
function renderInline(escaped) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = escaped.replace(/\u0000/g, "\uFFFD").replace(/`([^`]+)`/g, (_, code) => hold(`<code>${code}</code>`));
  // links: only absolute http(s) URLs; the text is already escaped, so the URL cannot close the attribute
  s = s.replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, (_, label, url) =>
    hold(`<a href="${url}" rel="noopener noreferrer" target="_blank">${label}</a>`));
  s = s.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>").replace(/__([^_]+)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*([^*\s][^*]*?)\*(?!\w)/g, "$1<em>$2</em>").replace(/(^|\W)_([^_\s][^_]*?)_(?!\w)/g, "$1<em>$2</em>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, i) => held[Number(i)]);
}

// Markdown → HTML: fenced code blocks (an unclosed fence, as while streaming, runs to the end), headings,
// lists, paragraphs. Everything from `text` goes through escapeHtml before any tag is added.
function renderMarkdown(text) {
  const out = [];
  const lines = String(text).split("\n");
  let paragraph = [];
  let list = null; // {tag, items}
  const flushParagraph = () => {
    if (paragraph.length) out.push(`<p>${paragraph.map((l) => renderInline(escapeHtml(l))).join("<br>")}</p>`);
    paragraph = [];
  };
  const flushList = () => {
    if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${renderInline(escapeHtml(i))}</li>`).join("")}</${list.tag}>`);
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(/^\s*```\s*([\w+.#-]*)/);
    if (fence) {
      flushParagraph();
      flushList();
      const code = [];
      for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
      const lang = fence[1] ? ` class="language-${escapeHtml(fence[1])}"` : "";
      out.push(`<pre><code${lang}>${escapeHtml(code.join("\n"))}</code></pre>`);
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
    const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
    if (heading) {
      flushParagraph();
      flushList();
      const level = heading[1].length;
      out.push(`<h${level}>${renderInline(escapeHtml(heading[2]))}</h${level}>`);
    } else if (bullet || numbered) {
      flushParagraph();
      const tag = bullet ? "ul" : "ol";
      if (list && list.tag !== tag) flushList();
      if (!list) list = { tag, items: [] };
      list.items.push((bullet || numbered)[1]);
    } else if (line.trim() === "") {
      flushParagraph();
      flushList();
    } else {
      flushList();
      paragraph.push(line);
    }
  }
  flushParagraph();
  flushList();
  return out.join("");
}

// ---- state --------------------------------------------------------------------------------------------------

function load(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value === null ? fallback : value;
  } catch {
    return fallback;
  }
}

const state = {
  conversations: load(STORE.conversations, []), // [{id, title, messages: [{role, content, reasoning?, meta?, error?}]}]
  current: localStorage.getItem(STORE.current),
  model: null,
  controller: null, // the AbortController of the request in flight
};

function save() {
  localStorage.setItem(STORE.conversations, JSON.stringify(state.conversations));
  if (state.current) localStorage.setItem(STORE.current, state.current);
}

function currentConversation() {
  let conv = state.conversations.find((c) => c.id === state.current);
  if (!conv) {
    conv = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: "New chat", messages: [] };
    state.conversations.unshift(conv);
    state.current = conv.id;
  }
  return conv;
}

function apiHeaders() {
  const headers = { "Content-Type": "application/json" };
  const key = localStorage.getItem(STORE.key);
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

// ---- rendering ----------------------------------------------------------------------------------------------

function renderConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of state.conversations) {
    const item = document.createElement("li");
    item.className = conv.id === state.current ? "current" : "";
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open";
    open.textContent = conv.title; // text, never HTML
    open.title = conv.title;
    open.addEventListener("click", () => {
      if (state.controller) return;
      state.current = conv.id;
      save();
      renderAll();
    });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "×";
    del.setAttribute("aria-label", `Delete ${conv.title}`);
    del.addEventListener("click", () => {
      if (state.controller && conv.id === state.current) return;
      state.conversations = state.conversations.filter((c) => c !== conv);
      if (state.current === conv.id) state.current = state.conversations[0]?.id ?? null;
      if (!state.current) localStorage.removeItem(STORE.current);
      save();
      renderAll();
    });
    item.append(open, del);
    list.append(item);
  }
}

// One message's element; assistant messages go through renderMarkdown, user messages are plain text.
function messageElement(message) {
  const el = document.createElement("div");
  el.className = `msg ${message.role}${message.error ? " error" : ""}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : state.model || "assistant";
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.innerHTML = "<summary>Reasoning</summary>";
  const reasoningText = document.createElement("div");
  reasoningText.className = "text";
  reasoning.append(reasoningText);
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  el.append(role, reasoning, content, meta);
  updateMessageElement(el, message);
  return el;
}

function updateMessageElement(el, message) {
  const [, reasoning, content, meta] = el.children;
  reasoning.hidden = !message.reasoning;
  reasoning.lastChild.textContent = message.reasoning || "";
  if (message.role === "assistant") content.innerHTML = renderMarkdown(message.content); // escaped inside
  else content.textContent = message.content;
  meta.textContent = message.meta || "";
  el.classList.toggle("error", Boolean(message.error));
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren(...currentConversation().messages.map(messageElement));
  box.scrollTop = box.scrollHeight;
}

function renderAll() {
  currentConversation();
  renderConversations();
  renderMessages();
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("status").textContent = busy ? "generating…" : "";
}

// ---- the API ------------------------------------------------------------------------------------------------

async function needKey() {
  $("model").textContent = "(API key needed)";
  $("key-form").hidden = false;
  $("api-key").focus();
  $("status").textContent = "API key needed";
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: apiHeaders() });
    if (response.status === 401) {
      state.model = null;
      return needKey();
    }
    const body = await response.json();
    state.model = body.data?.[0]?.id ?? null;
    $("model").textContent = state.model || "(no model)";
    $("key-form").hidden = true;
    renderMessages();
  } catch (e) {
    $("model").textContent = `(server unreachable: ${e.message})`;
  }
}

function readSettings() {
  const settings = {
    system: $("system").value,
    temperature: $("temperature").value,
    top_p: $("top-p").value,
    max_tokens: $("max-tokens").value,
  };
  localStorage.setItem(STORE.settings, JSON.stringify(settings));
  return settings;
}

function requestBody(conv, settings) {
  const messages = [];
  if (settings.system.trim()) messages.push({ role: "system", content: settings.system });
  for (const m of conv.messages) if (!m.error && m.content) messages.push({ role: m.role, content: m.content });
  const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true } };
  for (const [name, parse] of [["temperature", parseFloat], ["top_p", parseFloat], ["max_tokens", (v) => parseInt(v, 10)]]) {
    const value = parse(settings[name]);
    if (Number.isFinite(value)) body[name] = value;
  }
  return body;
}

// Server-sent events: calls onEvent(json) per `data:` line until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = lines.pop();
    for (const line of lines) {
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

// Timings the page keeps for tests and benchmarks/chat_page_latency.py (performance.now() milliseconds).
window.jaxllmTimings = [];

async function send(text) {
  if (!state.model) await loadModel();
  if (!state.model) {
    $("prompt").value = text; // kept for when the key is in
    return;
  }
  const conv = currentConversation();
  if (!conv.messages.length) conv.title = text.trim().slice(0, 48);
  conv.messages.push({ role: "user", content: text });
  const body = requestBody(conv, readSettings());
  const answer = { role: "assistant", content: "", reasoning: "" };
  conv.messages.push(answer);
  save();
  renderConversations();
  renderMessages();
  const el = $("messages").lastChild;
  const box = $("messages");
  // sent: Send pressed; headers: the response's headers in; firstText: the first answer text in the page (DOM);
  // firstFrame: the next animation frame after it (about when it is on screen); done: the stream ended
  const timing = { sent: performance.now(), headers: null, firstText: null, firstFrame: null, done: null };
  window.jaxllmTimings.push(timing);
  state.controller = new AbortController();
  setBusy(true);
  let frame = 0;
  let unauthorized = false;
  const paint = () => {
    frame = 0;
    const stick = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    updateMessageElement(el, answer);
    if (timing.firstText === null && answer.content) {
      timing.firstText = performance.now();
      requestAnimationFrame(() => (timing.firstFrame = performance.now()));
    }
    if (stick) box.scrollTop = box.scrollHeight;
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: apiHeaders(),
      body: JSON.stringify(body),
      signal: state.controller.signal,
    });
    timing.headers = performance.now();
    if (response.status === 401) {
      // the key is missing or wrong: take the message back into the box, to send again once the key is in
      unauthorized = true;
      conv.messages.splice(conv.messages.indexOf(answer) - 1, 2);
      $("prompt").value = text;
      state.model = null;
      needKey();
      return;
    }
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      throw new Error(error.error?.message || `HTTP ${response.status}`);
    }
    let usage = null;
    let finish = null;
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "server error");
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) return;
      const delta = choice.delta || {};
      const reasoning = delta.reasoning_content ?? delta.reasoning;
      if (reasoning) answer.reasoning += reasoning;
      if (delta.content) answer.content += delta.content;
      if (choice.finish_reason) finish = choice.finish_reason;
      // the first text is painted at once (what the latency benchmark measures), later ones once per frame
      if (timing.firstText === null && answer.content) paint();
      else if (!frame) frame = requestAnimationFrame(paint);
    });
    timing.done = performance.now();
    const seconds = (timing.done - timing.sent) / 1000;
    const parts = [];
    if (usage) parts.push(`${usage.completion_tokens} tokens`, `${(usage.completion_tokens / seconds).toFixed(1)} tok/s`);
    if (finish && finish !== "stop") parts.push(`finish: ${finish}`);
    answer.meta = parts.join(" · ");
  } catch (e) {
    if (e.name === "AbortError") answer.meta = "stopped";
    else {
      answer.error = true;
      answer.meta = `error: ${e.message}`;
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    state.controller = null;
    setBusy(false);
    save();
    if (unauthorized) {
      renderAll();
      $("status").textContent = "API key needed";
    } else updateMessageElement(el, answer);
  }
}

// ---- wiring -------------------------------------------------------------------------------------------------

function init() {
  const settings = load(STORE.settings, {});
  for (const [id, name] of [["system", "system"], ["temperature", "temperature"], ["top-p", "top_p"], ["max-tokens", "max_tokens"]]) {
    if (settings[name] !== undefined) $(id).value = settings[name];
  }
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (state.controller || !text.trim()) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.controller || !currentConversation().messages.length) return; // already a new one
    state.current = null;
    renderAll();
    save();
    $("prompt").focus();
  });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    localStorage.setItem(STORE.key, $("api-key").value.trim());
    $("api-key").value = "";
    loadModel();
  });
  $("forget-key").addEventListener("click", () => {
    localStorage.removeItem(STORE.key);
    loadModel();
  });
  renderAll();
  loadModel();
}

document.addEventListener("DOMContentLoaded", init);
