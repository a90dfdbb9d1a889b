// Markdown to DOM nodes for the chat: paragraphs with line breaks, headings, fenced code
// (highlighted, with a copy button; an unclosed fence runs to the end, as while streaming),
// lists (nested, ordered or not), block quotes, tables, rules, and inline code, emphasis,
// strikethrough and links. Model text only ever becomes text nodes or attribute values
// checked here: nothing is parsed as HTML, so markup in a reply shows as the text it is.
// Links open only http(s) and mailto URLs; images become links (no request to a URL a reply
// names, which could carry data out of the conversation).
import { highlight } from "./highlight.js";

const FENCE = /^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const RULE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:[ \t]+(.*))?$/;
const TABLE_RULE = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;
const ESCAPABLE = /[\\`*_{}[\]()#+\-.!|~<>"']/;
const BARE_URL = /https?:\/\/[^\s<>"'`]+/y;
const TRAILING = /[.,;:!?'")\]]+$/;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

/** `src` rendered as a fragment of DOM nodes. */
export function renderMarkdown(src) {
  const out = document.createDocumentFragment();
  blocks(src.replace(/\r\n?/g, "\n").split("\n"), out);
  return out;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function blocks(lines, out) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (!line.trim()) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      i = fence(lines, i, m, out);
    } else if ((m = HEADING.exec(line))) {
      const h = el("h" + m[1].length);
      inline(m[2] || "", h);
      out.append(h);
      i++;
    } else if (RULE.test(line)) {
      out.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i++;
      }
      const quote = el("blockquote");
      blocks(inner, quote);
      out.append(quote);
    } else if (ITEM.test(line)) {
      i = list(lines, i, out);
    } else if (isTable(lines, i)) {
      i = table(lines, i, out);
    } else {
      i = paragraph(lines, i, out);
    }
  }
}

function fence(lines, i, m, out) {
  const indent = m[1].length;
  const marker = m[2];
  const body = [];
  let j = i + 1;
  for (; j < lines.length; j++) {
    const t = lines[j].trim();
    const closes = t.length >= marker.length && t === t[0].repeat(t.length) && t[0] === marker[0];
    if (closes && lines[j].search(/\S/) <= 3) {
      j++;
      break;
    }
    body.push(lines[j].replace(new RegExp("^ {0," + indent + "}"), ""));
  }
  if (j >= lines.length && body.length && !body[body.length - 1].trim()) body.pop();
  out.append(codeBlock(body.join("\n"), m[3]));
  return j;
}

function codeBlock(text, lang) {
  const box = el("div", "code-block");
  const head = el("div", "code-head");
  const label = el("span", "lang");
  label.textContent = lang || "text";
  const copy = el("button", "copy");
  copy.type = "button";
  copy.textContent = "Copy";
  head.append(label, copy);
  const pre = el("pre");
  const code = el("code");
  code.append(highlight(text, lang));
  pre.append(code);
  box.append(head, pre);
  return box;
}

function list(lines, i, out) {
  const first = ITEM.exec(lines[i]);
  const base = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  const items = [];
  let item = null;
  let loose = false;
  let j = i;
  while (j < lines.length) {
    const line = lines[j];
    const m = ITEM.exec(line);
    const sibling = m && m[1].length >= base && m[1].length <= base + 1 && /\d/.test(m[2]) === ordered;
    if (sibling && !RULE.test(line)) {
      item = { lines: [m[3] || ""], indent: m[1].length + m[2].length + 1 };
      items.push(item);
      j++;
      continue;
    }
    if (!line.trim()) {
      let k = j + 1;
      while (k < lines.length && !lines[k].trim()) k++;
      const next = k < lines.length ? lines[k] : "";
      const nm = ITEM.exec(next);
      const continues = next && (next.search(/\S/) > base || (nm && nm[1].length === base && /\d/.test(nm[2]) === ordered));
      if (!continues) break;
      item.lines.push("");
      loose = true;
      j++;
      continue;
    }
    const indent = line.search(/\S/);
    if (indent > base) {
      item.lines.push(line.slice(Math.min(indent, item.indent)));
      j++;
      continue;
    }
    if (m || startsBlock(line) || !item.lines[item.lines.length - 1].trim()) break;
    item.lines.push(line.trim());
    j++;
  }
  for (const it of items) {
    const li = el("li");
    blocks(it.lines, li);
    node.append(li);
  }
  if (!loose) node.className = "tight";
  out.append(node);
  return j;
}

function cells(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  // Split on pipes outside code spans; `\|` is a literal pipe.
  const out = [""];
  for (let i = 0, tick = 0; i < s.length; i++) {
    if (s[i] === "\\" && s[i + 1] === "|") {
      out[out.length - 1] += "|";
      i++;
    } else if (s[i] === "|" && !tick) {
      out.push("");
    } else {
      if (s[i] === "`") tick ^= 1;
      out[out.length - 1] += s[i];
    }
  }
  return out.map((c) => c.trim());
}

function isTable(lines, i) {
  if (i + 1 >= lines.length || !lines[i].includes("|") || !TABLE_RULE.test(lines[i + 1])) return false;
  return cells(lines[i]).length === cells(lines[i + 1]).length;
}

function table(lines, i, out) {
  const head = cells(lines[i]);
  const align = cells(lines[i + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "");
  const node = el("table");
  const row = (values, tag) => {
    const tr = el("tr");
    head.forEach((_, n) => {
      const cell = el(tag);
      if (align[n]) cell.style.textAlign = align[n];
      inline(values[n] || "", cell);
      tr.append(cell);
    });
    return tr;
  };
  const thead = el("thead");
  thead.append(row(head, "th"));
  const tbody = el("tbody");
  let j = i + 2;
  for (; j < lines.length && lines[j].trim() && lines[j].includes("|"); j++) tbody.append(row(cells(lines[j]), "td"));
  node.append(thead, tbody);
  const wrap = el("div", "table-wrap");
  wrap.append(node);
  out.append(wrap);
  return j;
}

function paragraph(lines, i, out) {
  const text = [lines[i].trim()];
  let j = i + 1;
  while (j < lines.length && lines[j].trim() && !startsBlock(lines[j]) && !isTable(lines, j)) {
    text.push(lines[j].trim());
    j++;
  }
  const p = el("p");
  inline(text.join("\n"), p);
  out.append(p);
  return j;
}

/** Inline Markdown of `text` appended to `out`. */
function inline(text, out) {
  let plain = "";
  const flush = () => {
    if (plain) out.append(plain);
    plain = "";
  };
  let i = 0;
  while (i < text.length) {
    const c = text[i];
    let m = null;
    if (c === "\\" && ESCAPABLE.test(text[i + 1] || "")) {
      plain += text[i + 1];
      i += 2;
      continue;
    }
    if (c === "\n") {
      flush();
      out.append(el("br"));
      i++;
      continue;
    }
    if (c === "`" && (m = codeSpan(text, i))) {
      flush();
      const code = el("code");
      code.textContent = m.text;
      out.append(code);
      i = m.end;
      continue;
    }
    if ((c === "*" || c === "_" || c === "~") && (m = delimited(text, i))) {
      flush();
      let node = el(m.tag);
      out.append(node);
      if (m.tag === "strong" && m.em) {
        const em = el("em");
        node.append(em);
        node = em;
      }
      inline(m.inner, node);
      i = m.end;
      continue;
    }
    if ((c === "[" || (c === "!" && text[i + 1] === "[")) && (m = link(text, i))) {
      flush();
      out.append(anchor(m));
      i = m.end;
      continue;
    }
    if (c === "h" && !/[\w/]/.test(text[i - 1] || "")) {
      BARE_URL.lastIndex = i;
      const u = BARE_URL.exec(text);
      if (u) {
        const url = u[0].replace(TRAILING, "");
        flush();
        out.append(anchor({ url, label: null }));
        i += url.length;
        continue;
      }
    }
    plain += c;
    i++;
  }
  flush();
}

function codeSpan(text, i) {
  let n = 0;
  while (text[i + n] === "`") n++;
  const run = "`".repeat(n);
  let j = text.indexOf(run, i + n);
  while (j >= 0 && text[j + n] === "`") {
    let k = j;
    while (text[k] === "`") k++;
    j = text.indexOf(run, k);
  }
  if (j < 0) return null;
  let inner = text.slice(i + n, j).replace(/\n/g, " ");
  if (inner.length > 2 && inner.startsWith(" ") && inner.endsWith(" ")) inner = inner.slice(1, -1);
  return { text: inner, end: j + n };
}

function delimited(text, i) {
  const c = text[i];
  let n = 1;
  while (text[i + n] === c) n++;
  if ((c === "~" && n !== 2) || n > 3) return null;
  const wordChar = /[\p{L}\p{N}]/u;
  if (!text[i + n] || /\s/.test(text[i + n])) return null;
  if (c === "_" && wordChar.test(text[i - 1] || "")) return null;
  const run = c.repeat(n);
  for (let j = text.indexOf(run, i + n + 1); j >= 0; j = text.indexOf(run, j + 1)) {
    const before = text[j - 1];
    const after = text[j + n] || "";
    if (/\s/.test(before) || before === c || after === c) continue;
    if (c === "_" && wordChar.test(after)) continue;
    const tag = c === "~" ? "del" : n === 1 ? "em" : "strong";
    return { tag, em: n === 3, inner: text.slice(i + n, j), end: j + n };
  }
  return null;
}

function link(text, i) {
  const image = text[i] === "!";
  const open = image ? i + 1 : i;
  let depth = 0;
  let j = open;
  for (; j < text.length; j++) {
    if (text[j] === "\\") j++;
    else if (text[j] === "[") depth++;
    else if (text[j] === "]" && --depth === 0) break;
  }
  if (j >= text.length || text[j + 1] !== "(") return null;
  let k = j + 2;
  for (let parens = 1; k < text.length; k++) {
    if (text[k] === "\n") return null;
    if (text[k] === "(") parens++;
    else if (text[k] === ")" && --parens === 0) break;
  }
  if (k >= text.length) return null;
  const dest = /^\s*<?([^\s>]*)>?(?:\s+["'(](.*)["')])?\s*$/.exec(text.slice(j + 2, k));
  return { label: text.slice(open + 1, j), url: dest ? dest[1] : "", title: dest && dest[2], image, end: k + 1 };
}

/** A URL a reply may link to: http(s) or mailto, nothing that runs or embeds. */
export function safeUrl(url) {
  const u = (url || "").trim();
  return /^(https?:\/\/|mailto:)/i.test(u) ? u : null;
}

function anchor({ url, label, title, image }) {
  const href = safeUrl(url);
  const node = el(href ? "a" : "span", image ? "image-link" : "");
  if (href) {
    node.href = href;
    node.target = "_blank";
    node.rel = "noopener noreferrer";
  }
  if (title) node.title = title;
  if (image) node.append("image: " + (label || href || url));
  else if (label === null) node.append(url);
  else inline(label, node);
  return node;
}
