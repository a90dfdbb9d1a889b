// What the chat keeps in the browser's localStorage: the conversations (`ferrite.chats`, a
// list of { id, title, updated, messages }), which one is open (`ferrite.current`), the
// settings (`ferrite.settings`) and the API key (`ferrite-api-key`). Reads tolerate missing
// or damaged entries (they read as empty); writes return the error when storage is full.

const CHATS = "ferrite.chats";
const CURRENT = "ferrite.current";
const SETTINGS = "ferrite.settings";
const KEY = "ferrite-api-key";

export const DEFAULT_SETTINGS = Object.freeze({ system: "", temperature: null, maxTokens: null, model: null });

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return null;
  } catch (e) {
    return e;
  }
}

const isChat = (c) => c && typeof c.id === "string" && Array.isArray(c.messages);

export function loadChats() {
  const chats = read(CHATS, []);
  if (!Array.isArray(chats)) return [];
  const valid = chats.filter(isChat);
  // A reply that was streaming when the page went away ends as stopped.
  for (const message of valid.flatMap((c) => c.messages)) {
    if (message.state === "streaming") {
      message.state = "stopped";
      message.note = "interrupted";
    }
  }
  return valid;
}

export const saveChats = (chats) => write(CHATS, chats);
export const loadCurrent = () => read(CURRENT, null);
export const saveCurrent = (id) => write(CURRENT, id);

export function loadSettings() {
  const saved = read(SETTINGS, {});
  return { ...DEFAULT_SETTINGS, ...(saved && typeof saved === "object" ? saved : {}) };
}

export const saveSettings = (settings) => write(SETTINGS, settings);
export const loadKey = () => localStorage.getItem(KEY) || "";

export function saveKey(key) {
  try {
    localStorage.setItem(KEY, key);
  } catch {
    // Storage refused: the key still works for this page.
  }
}

export function newChat() {
  const id = Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  return { id, title: "", updated: Date.now(), messages: [] };
}

/** The name shown in the list: the given title, else the first user message. */
export function chatTitle(chat) {
  if (chat.title) return chat.title;
  const first = chat.messages.find((m) => m.role === "user");
  const text = first ? first.content.replace(/\s+/g, " ").trim() : "";
  return text ? (text.length > 48 ? text.slice(0, 47) + "…" : text) : "New chat";
}
