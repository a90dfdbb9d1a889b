// The server's API as the chat uses it: the model list (`/v1/models`) and a streamed chat
// completion (`/v1/chat/completions` with `stream: true`, read as server-sent events). A
// failed request becomes an `ApiError` that keeps the HTTP status, the error's type and
// message from an OpenAI-style body, and the body itself, so the page can show all of it.

export class ApiError extends Error {
  constructor(status, message, { type = null, body = "" } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.type = type;
    this.body = body;
  }
}

function headers(key) {
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorFrom(resp) {
  const body = await resp.text().catch(() => "");
  let message = body.trim() || resp.statusText || "request failed";
  let type = null;
  try {
    const err = JSON.parse(body).error;
    if (err && typeof err === "object") {
      message = err.message || message;
      type = err.type || err.code || null;
    } else if (typeof err === "string") {
      message = err;
    }
  } catch {
    // Not JSON: the text itself is the message.
  }
  return new ApiError(resp.status, message, { type, body });
}

/** The models the server lists: [{ id, status, max_model_len }]. */
export async function listModels(key) {
  const resp = await fetch("/v1/models", { headers: headers(key) });
  if (!resp.ok) throw await errorFrom(resp);
  const body = await resp.json();
  return Array.isArray(body.data) ? body.data : [];
}

/** Streams a chat completion for `body`, calling `onChunk` with each parsed chunk. */
export async function streamChat(body, { key, signal, onChunk }) {
  const resp = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers(key),
    signal,
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
  });
  if (!resp.ok) throw await errorFrom(resp);
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    buffer = buffer.replace(/\r\n?/g, "\n");
    let at;
    while ((at = buffer.indexOf("\n\n")) >= 0) {
      handleEvent(buffer.slice(0, at), onChunk);
      buffer = buffer.slice(at + 2);
    }
    if (done) break;
  }
  if (buffer.trim()) handleEvent(buffer, onChunk);
}

// An error inside a stream came after a 200, so it carries no HTTP status of its own.
function handleEvent(event, onChunk) {
  let name = "message";
  const data = [];
  for (const line of event.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  const text = data.join("\n");
  if (!text || text === "[DONE]") return;
  let chunk;
  try {
    chunk = JSON.parse(text);
  } catch {
    throw new ApiError(null, "the stream sent an event that is not JSON", { body: text });
  }
  if (chunk.error || name === "error") {
    const err = chunk.error || chunk;
    throw new ApiError(null, err.message || "the stream ended with an error", { type: err.type || null, body: text });
  }
  onChunk(chunk);
}
