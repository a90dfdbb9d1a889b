// DOM for the chat's pieces: a message (a user's text; an assistant's reply with its
// reasoning collapsed, Markdown content, tool calls, error and a note on how it ended, with
// its actions), the inline editor for a user message, and a conversation's entry in the
// sidebar. Text from the model or the user goes in as text or through `renderMarkdown`.
import { renderMarkdown } from "./markdown.js";
import { highlight } from "./highlight.js";

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(className, label, title) {
  const b = el("button", className, label);
  b.type = "button";
  if (title) b.title = title;
  return b;
}

function actions(...buttons) {
  const row = el("div", "actions");
  row.append(...buttons.map(([cls, label, title]) => button(cls, label, title)));
  return row;
}

/** The element of message `index` of a conversation. */
export function messageView(msg, index) {
  const div = el("div", "msg " + msg.role);
  div.dataset.index = String(index);
  if (msg.role === "user") {
    div.append(el("div", "content", msg.content), actions(["edit", "Edit", "Edit and send again"], ["copy-msg", "Copy"]));
    return div;
  }
  const reasoning = el("details", "reasoning");
  reasoning.append(el("summary", null, "Reasoning"), el("div", "text"));
  div.append(reasoning, el("div", "content"), el("div", "tool-calls"), el("div", "error-box"), el("div", "note"),
    actions(["regenerate", "Regenerate", "Answer this again"], ["copy-msg", "Copy"]));
  updateReply(div, msg);
  return div;
}

const rendered = new WeakMap();

/** Brings an assistant message's element up to date with `msg`. */
export function updateReply(div, msg) {
  div.dataset.state = msg.state || "done";
  if (msg.model) div.dataset.model = msg.model;
  const reasoning = div.querySelector(".reasoning");
  reasoning.hidden = !msg.reasoning;
  reasoning.querySelector("summary").textContent =
    msg.state === "streaming" && !msg.content && !(msg.tool_calls || []).length ? "Thinking…" : "Reasoning";
  reasoning.querySelector(".text").textContent = msg.reasoning || "";
  const content = div.querySelector(".content");
  if (rendered.get(content) !== msg.content) {
    content.replaceChildren(renderMarkdown(msg.content || ""));
    rendered.set(content, msg.content);
  }
  const tools = div.querySelector(".tool-calls");
  tools.hidden = !(msg.tool_calls || []).length;
  tools.replaceChildren(...(msg.tool_calls || []).map(toolCallView));
  const error = div.querySelector(".error-box");
  error.hidden = !msg.error;
  error.replaceChildren(...(msg.error ? errorParts(msg.error) : []));
  div.classList.toggle("error", Boolean(msg.error));
  div.querySelector(".note").textContent = msg.note || "";
}

function toolCallView(call) {
  const box = el("div", "tool-call");
  const fn = call.function || {};
  box.append(el("div", "tool-name", "Tool call: " + (fn.name || "(unnamed)")));
  let args = fn.arguments || "";
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // Not complete JSON yet (still streaming) or not JSON: shown as it came.
  }
  const pre = el("pre");
  const code = el("code");
  code.append(highlight(args, "json"));
  pre.append(code);
  box.append(pre);
  return box;
}

function errorParts(error) {
  const head = el("div", "error-head", error.status ? "Error " + error.status : "Error");
  if (error.type) head.append(el("span", "error-type", " " + error.type));
  const parts = [head, el("div", "error-message", error.message)];
  if (error.body && error.body.trim() !== error.message) {
    const body = el("details", "error-body");
    body.append(el("summary", null, "Response body"), el("pre", null, error.body));
    parts.push(body);
  }
  return parts;
}

/** The editor that replaces a user message while it is edited. */
export function editorView(text) {
  const box = el("div", "editor");
  const area = el("textarea", "edit-input");
  area.value = text;
  area.rows = Math.min(12, Math.max(2, text.split("\n").length));
  box.append(area, actions(["cancel-edit", "Cancel"], ["save-edit primary", "Send"]));
  return box;
}

export function emptyView(modelName) {
  const box = el("div", null, modelName ? "Send a message to " + modelName + "." : "Send a message to start a chat.");
  box.id = "empty";
  return box;
}

/** A conversation's entry in the sidebar. */
export function chatItem(chat, title, active) {
  const li = el("li", active ? "chat active" : "chat");
  li.dataset.id = chat.id;
  li.append(el("span", "title", title), button("rename", "✎", "Rename"), button("delete", "✕", "Delete"));
  return li;
}

/** Replaces an entry's title with an input; `done(text | null)` when finished. */
export function renameInput(li, title, done) {
  const input = el("input", "rename-input");
  input.value = title;
  let finished = false;
  const finish = (value) => {
    if (finished) return;
    finished = true;
    done(value);
  };
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") finish(input.value);
    else if (ev.key === "Escape") finish(null);
  });
  input.addEventListener("blur", () => finish(input.value));
  li.querySelector(".title").replaceWith(input);
  input.focus();
  input.select();
}
