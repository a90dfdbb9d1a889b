// The chat page's behaviour: conversations (a sidebar to switch, rename and delete them; the
// open one is a draft until its first message), sending and streaming a reply, Stop,
// regenerating an answer, editing a user message (which drops what followed and answers
// again), the settings dialog, the model picker (shown when the server lists several
// models) and copy buttons. State lives in `state` and is saved through `store.js`.
import * as store from "./store.js";
import { listModels, streamChat } from "./api.js";
import { chatItem, editorView, el, emptyView, messageView, renameInput, updateReply } from "./view.js";

const $ = (id) => document.getElementById(id);
const state = {
  chats: store.loadChats(),
  currentId: store.loadCurrent(),
  draft: null,
  settings: store.loadSettings(),
  key: store.loadKey(),
  models: [],
  controller: null,
  stick: true,
};

function current() {
  return state.chats.find((c) => c.id === state.currentId) || state.draft || (state.draft = store.newChat());
}

function notice(text) {
  $("notice").textContent = text;
  $("notice").hidden = !text;
}

function persist() {
  const err = store.saveChats(state.chats) || store.saveCurrent(state.currentId);
  notice(err ? "This browser's storage refused the conversation (" + err.name + "); delete old chats to make room." : "");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  for (const b of document.querySelectorAll(".msg .edit, .msg .regenerate, .msg .save-edit")) b.disabled = busy;
}

function follow() {
  const box = $("messages");
  if (state.stick) box.scrollTop = box.scrollHeight;
}

function renderSidebar() {
  const sorted = [...state.chats].sort((a, b) => b.updated - a.updated);
  $("chats").replaceChildren(...sorted.map((c) => chatItem(c, store.chatTitle(c), c.id === state.currentId)));
}

function renderChat() {
  const chat = current();
  const box = $("messages");
  box.replaceChildren(...chat.messages.map(messageView));
  if (!chat.messages.length) box.append(emptyView(selectedModel()));
  setBusy(Boolean(state.controller));
  state.stick = true;
  follow();
}

// --- models -------------------------------------------------------------------------------

function selectedModel() {
  const ids = state.models.map((m) => m.id);
  return ids.includes(state.settings.model) ? state.settings.model : ids[0] || null;
}

function renderModels() {
  const chosen = selectedModel();
  $("picker-row").hidden = state.models.length < 2;
  $("model-picker").replaceChildren(...state.models.map((m) => {
    const option = el("option", null, m.id + (m.status && m.status !== "loaded" ? " (" + m.status + ")" : ""));
    option.value = m.id;
    option.selected = m.id === chosen;
    return option;
  }));
  const info = state.models.find((m) => m.id === chosen);
  $("model").textContent = info
    ? [info.id, info.max_model_len && "context " + info.max_model_len, info.status].filter(Boolean).join(" · ")
    : "no model";
}

async function refreshModels() {
  try {
    state.models = await listModels(state.key);
  } catch (e) {
    if (e.status === 401) $("key-row").hidden = false;
    $("model").textContent = e.status === 401 ? "API key needed" : e.status ? "models: " + e.message : "server unreachable";
    return;
  }
  renderModels();
}

// --- generating ---------------------------------------------------------------------------

function requestBody(messages, model) {
  const history = [];
  const system = (state.settings.system || "").trim();
  if (system) history.push({ role: "system", content: system });
  for (const m of messages) {
    const calls = (m.tool_calls || []).filter(Boolean);
    if (m.role === "user") history.push({ role: "user", content: m.content });
    else if (!m.error && (m.content || calls.length)) {
      history.push(calls.length ? { role: "assistant", content: m.content, tool_calls: calls } : { role: "assistant", content: m.content });
    }
  }
  const body = { messages: history };
  if (model) body.model = model;
  if (state.settings.temperature !== null) body.temperature = state.settings.temperature;
  if (state.settings.maxTokens !== null) body.max_tokens = state.settings.maxTokens;
  return body;
}

function mergeToolCall(msg, call) {
  const calls = msg.tool_calls || (msg.tool_calls = []);
  const at = Number.isInteger(call.index) ? call.index : calls.length;
  const c = calls[at] || (calls[at] = { id: "", type: "function", function: { name: "", arguments: "" } });
  if (call.id) c.id = call.id;
  if (call.function && call.function.name) c.function.name = call.function.name;
  if (call.function && call.function.arguments) c.function.arguments += call.function.arguments;
}

function noteText(finish, usage, started, model) {
  const parts = [finish || "done"];
  const tokens = usage && usage.completion_tokens;
  if (tokens) {
    const secs = Math.max((performance.now() - started) / 1000, 1e-3);
    parts.push(tokens + " tokens", (tokens / secs).toFixed(1) + " tok/s");
  }
  if (model && state.models.length > 1) parts.push(model);
  return parts.join(" · ");
}

/** Answers the last message of `chat` with a streamed reply. */
async function generate(chat) {
  const model = selectedModel();
  const body = requestBody(chat.messages, model);
  const msg = { role: "assistant", content: "", reasoning: "", state: "streaming", model };
  chat.messages.push(msg);
  chat.updated = Date.now();
  if (!state.chats.includes(chat)) {
    state.chats.push(chat);
    state.currentId = chat.id;
    state.draft = null;
  }
  const controller = new AbortController();
  state.controller = controller;
  persist();
  renderSidebar();
  renderChat();
  const div = $("messages").lastElementChild;
  const started = performance.now();
  let usage = null;
  let finish = null;
  let frame = 0;
  const redraw = () => {
    frame = 0;
    updateReply(div, msg);
    follow();
  };
  try {
    await streamChat(body, {
      key: state.key,
      signal: controller.signal,
      onChunk: (chunk) => {
        if (chunk.model) msg.model = chunk.model;
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const d = choice.delta || {};
          if (d.reasoning_content) msg.reasoning += d.reasoning_content;
          if (d.content) msg.content += d.content;
          for (const call of d.tool_calls || []) mergeToolCall(msg, call);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
        if (!frame) frame = requestAnimationFrame(redraw);
      },
    });
    msg.state = "done";
    msg.note = noteText(finish, usage, started, msg.model);
  } catch (e) {
    if (e.name === "AbortError") {
      msg.state = "stopped";
      msg.note = "stopped";
    } else {
      msg.state = "error";
      msg.error = { status: e.status || null, type: e.type || null, message: e.message, body: e.body || "" };
      if (e.status === 401) $("key-row").hidden = false;
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    if (state.controller === controller) state.controller = null;
  }
  chat.updated = Date.now();
  persist();
  redraw();
  setBusy(Boolean(state.controller));
  refreshModels();
}

function stop() {
  if (state.controller) state.controller.abort();
}

// --- conversations ------------------------------------------------------------------------

function openChat(id) {
  stop();
  state.currentId = id;
  state.draft = null;
  store.saveCurrent(id);
  renderSidebar();
  renderChat();
}

function deleteChat(id) {
  if (id === state.currentId) {
    stop();
    state.currentId = null;
  }
  state.chats = state.chats.filter((c) => c.id !== id);
  persist();
  renderSidebar();
  renderChat();
}

function onSidebarClick(ev) {
  const li = ev.target.closest("li.chat");
  if (!li) return;
  const chat = state.chats.find((c) => c.id === li.dataset.id);
  if (!chat) return;
  const target = ev.target.closest("button");
  if (target && target.classList.contains("rename")) {
    renameInput(li, store.chatTitle(chat), (title) => {
      if (title !== null && title.trim()) chat.title = title.trim();
      persist();
      renderSidebar();
    });
  } else if (target && target.classList.contains("delete")) {
    if (target.classList.contains("confirm")) {
      deleteChat(chat.id);
      return;
    }
    target.classList.add("confirm");
    target.textContent = "Delete?";
    setTimeout(() => {
      target.classList.remove("confirm");
      target.textContent = "✕";
    }, 3000);
  } else if (!ev.target.closest("input") && chat.id !== state.currentId) {
    openChat(chat.id);
  }
}

// --- messages -----------------------------------------------------------------------------

async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    // No clipboard API here (a page served over plain HTTP off localhost): the old way.
    const area = el("textarea");
    area.value = text;
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    const ok = document.execCommand("copy");
    area.remove();
    return ok;
  }
}

async function copyWith(button, text) {
  const ok = await copyText(text);
  const label = button.textContent;
  button.textContent = ok ? "Copied" : "Copy failed";
  setTimeout(() => (button.textContent = label), 2000);
}

function onMessagesClick(ev) {
  const button = ev.target.closest("button");
  if (!button) return;
  const chat = current();
  const div = button.closest(".msg");
  const index = div ? Number(div.dataset.index) : -1;
  const msg = chat.messages[index];
  if (button.classList.contains("copy")) {
    copyWith(button, button.closest(".code-block").querySelector("code").textContent);
  } else if (!msg) {
    return;
  } else if (button.classList.contains("copy-msg")) {
    copyWith(button, msg.content);
  } else if (state.controller) {
    return;
  } else if (button.classList.contains("regenerate")) {
    chat.messages.splice(index);
    generate(chat);
  } else if (button.classList.contains("edit")) {
    div.classList.add("editing");
    div.querySelector(".content").replaceWith(editorView(msg.content));
    div.querySelector(":scope > .actions").hidden = true;
    div.querySelector(".edit-input").focus();
  } else if (button.classList.contains("cancel-edit")) {
    renderChat();
  } else if (button.classList.contains("save-edit")) {
    const text = div.querySelector(".edit-input").value.trim();
    if (!text) return;
    chat.messages.splice(index, chat.messages.length - index, { role: "user", content: text });
    generate(chat);
  }
}

// --- settings -----------------------------------------------------------------------------

function fillSettings(s) {
  $("set-system").value = s.system || "";
  $("set-temperature").value = s.temperature === null ? "" : String(s.temperature);
  $("set-max-tokens").value = s.maxTokens === null ? "" : String(s.maxTokens);
}

function readNumber(input) {
  const text = input.value.trim();
  return text === "" || !Number.isFinite(Number(text)) ? null : Number(text);
}

function saveSettings(ev) {
  ev.preventDefault();
  state.settings = {
    ...state.settings,
    system: $("set-system").value,
    temperature: readNumber($("set-temperature")),
    maxTokens: readNumber($("set-max-tokens")),
  };
  const err = store.saveSettings(state.settings);
  notice(err ? "This browser's storage refused the settings (" + err.name + ")." : "");
  $("settings").close();
}

// --- wiring -------------------------------------------------------------------------------

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  const chat = current();
  chat.messages.push({ role: "user", content: text });
  generate(chat);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", stop);
$("new-chat").addEventListener("click", () => {
  stop();
  state.currentId = null;
  state.draft = store.newChat();
  renderSidebar();
  renderChat();
  $("input").focus();
});
$("chats").addEventListener("click", onSidebarClick);
$("messages").addEventListener("click", onMessagesClick);
$("messages").addEventListener("keydown", (ev) => {
  if (ev.target.classList.contains("edit-input") && ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    ev.target.closest(".msg").querySelector(".save-edit").click();
  } else if (ev.target.classList.contains("edit-input") && ev.key === "Escape") {
    renderChat();
  }
});
$("messages").addEventListener("scroll", () => {
  const box = $("messages");
  state.stick = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
});
$("model-picker").addEventListener("change", () => {
  state.settings = { ...state.settings, model: $("model-picker").value };
  store.saveSettings(state.settings);
  renderModels();
});
$("open-settings").addEventListener("click", () => {
  fillSettings(state.settings);
  $("settings").showModal();
});
$("settings-form").addEventListener("submit", saveSettings);
$("settings-cancel").addEventListener("click", () => $("settings").close());
$("settings-reset").addEventListener("click", () => fillSettings(store.DEFAULT_SETTINGS));
$("save-key").addEventListener("click", () => {
  state.key = $("api-key").value.trim();
  store.saveKey(state.key);
  $("key-row").hidden = true;
  refreshModels();
});
window.addEventListener("storage", (ev) => {
  if (ev.key !== "ferrite.chats" || state.controller) return;
  state.chats = store.loadChats();
  renderSidebar();
  renderChat();
});

renderSidebar();
renderChat();
refreshModels();
