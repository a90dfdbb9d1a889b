// Syntax highlighting for code blocks: one scanner over a small table of languages
// (comments, strings, numbers, keywords, literals, builtins, function calls, types) and one
// for markup (tags, attributes, values, comments). The result is text nodes and
// `<span class="hl-KIND">` elements whose text is set with textContent, never parsed.

const words = (s) => new Set(s.split(" "));
const NONE = new Set();
const LANGS = new Map();

function define(names, spec) {
  const full = { line: null, block: null, strings: ['"', "'"], keywords: NONE, literals: NONE, builtins: NONE, ...spec };
  for (const name of names.split(" ")) LANGS.set(name, full);
}

const C_BLOCK = ["/*", "*/"];
const C_FAMILY_KEYWORDS = words(
  "auto break case catch class const constexpr continue default delete do else enum explicit extern final for " +
  "friend goto if inline namespace new noexcept operator override private protected public register return " +
  "sizeof static struct switch template this throw try typedef typename union using virtual volatile while " +
  "abstract extends implements import package super synchronized throws instanceof interface var val fun " +
  "object when is in out internal lateinit let func guard defer go select chan map range type struct " +
  "fallthrough async await foreach readonly sealed base lock params ref yield get set");

define("c h cpp c++ cc cxx hpp java kotlin kt swift cs csharp dart scala", {
  line: "//", block: C_BLOCK, keywords: C_FAMILY_KEYWORDS, preprocessor: true,
  literals: words("true false null nullptr NULL nil"),
  builtins: words("int char void float double long short unsigned signed bool size_t string uint8_t int32_t int64_t " +
    "uint32_t uint64_t std printf println String Integer System"),
});
define("go golang", {
  line: "//", block: C_BLOCK, strings: ['"', "'", "`"], keywords: C_FAMILY_KEYWORDS,
  literals: words("true false nil iota"),
  builtins: words("int int8 int16 int32 int64 uint uint8 uint16 uint32 uint64 float32 float64 string bool byte rune " +
    "error make len cap append copy panic recover fmt"),
});
define("js javascript mjs cjs jsx ts typescript tsx", {
  line: "//", block: C_BLOCK, strings: ['"', "'", "`"],
  keywords: words("async await break case catch class const continue debugger default delete do else export extends " +
    "finally for from function if import in instanceof let new of return static super switch this throw try typeof " +
    "var void while with yield interface type enum implements private public protected readonly declare namespace as"),
  literals: words("true false null undefined NaN Infinity"),
  builtins: words("console window document Math JSON Object Array String Number Boolean Promise Map Set Symbol Error " +
    "fetch require module"),
});
define("python py python3", {
  line: "#", strings: ['"""', "'''", '"', "'"], decorators: true,
  keywords: words("and as assert async await break class continue def del elif else except finally for from global " +
    "if import in is lambda nonlocal not or pass raise return try while with yield match case"),
  literals: words("True False None"),
  builtins: words("print len range int str float list dict set tuple bool open super isinstance enumerate zip map " +
    "filter sorted sum min max abs type object self cls"),
});
define("rust rs", {
  line: "//", block: C_BLOCK, strings: ['"'], chars: true, macros: true,
  keywords: words("as async await break const continue crate dyn else enum extern fn for if impl in let loop match " +
    "mod move mut pub ref return static struct super trait type unsafe use where while"),
  literals: words("true false None Some Ok Err Self self"),
  builtins: words("i8 i16 i32 i64 i128 isize u8 u16 u32 u64 u128 usize f32 f64 bool char str String Vec Option " +
    "Result Box"),
});
define("sh bash shell zsh console terminal", {
  line: "#", variables: true, noTypes: true,
  keywords: words("if then else elif fi for while until do done case esac in function return export local readonly " +
    "unset shift exit source alias"),
  literals: words("true false"),
  builtins: words("echo cd ls cat grep sed awk curl pip python python3 cargo git make mkdir rm cp mv chmod printf " +
    "read test sudo apt apt-get npm docker"),
});
define("json jsonc json5", { line: "//", strings: ['"'], keys: true, literals: words("true false null") });
define("yaml yml toml ini", { line: "#", keys: true, noTypes: true, literals: words("true false null yes no on off") });
define("sql", {
  line: "--", block: C_BLOCK, caseless: true, noTypes: true,
  keywords: words("select from where insert into values update set delete create table drop alter add index primary " +
    "key foreign references join left right inner outer on group by order having limit offset as and or not is in " +
    "exists distinct union all case when then else end begin commit rollback view default unique"),
  literals: words("true false null"),
});
const GENERIC = { line: "//", block: C_BLOCK, strings: ['"', "'"], keywords: NONE, literals: NONE, builtins: NONE };
const MARKUP = new Set(["html", "xml", "svg", "vue", "xhtml"]);

const IDENT = /[A-Za-z_$][\w$]*/y;
const NUMBER = /(?:0[xX][\da-fA-F_]+|0[bB][01_]+|\d[\d_]*(?:\.\d[\d_]*)?(?:[eE][+-]?\d+)?)[A-Za-z\d_]*/y;
const SHELL_VAR = /\$(?:\{[^}\n]*\}?|[\w@#?*!$-])[\w]*/y;
const DECORATOR = /@[\w.]+/y;
const RUST_CHAR = /'(?:\\[^'\n]{1,8}|[^\\'\n])'/y;

/** `code` as a fragment of text nodes and highlight spans; plain text when `lang` is empty. */
export function highlight(code, lang) {
  const out = document.createDocumentFragment();
  const name = (lang || "").toLowerCase();
  let plain = "";
  const emit = (kind, text) => {
    if (!kind) {
      plain += text;
      return;
    }
    if (plain) out.append(plain);
    plain = "";
    const span = document.createElement("span");
    span.className = "hl-" + kind;
    span.textContent = text;
    out.append(span);
  };
  if (!name) emit(null, code);
  else if (MARKUP.has(name)) markup(code, emit);
  else scan(code, LANGS.get(name) || GENERIC, emit);
  if (plain) out.append(plain);
  return out;
}

function sticky(re, code, i) {
  re.lastIndex = i;
  const m = re.exec(code);
  return m ? m[0] : null;
}

function stringEnd(code, j, quote) {
  const multiline = quote.length === 3 || quote === "`";
  while (j < code.length) {
    if (code[j] === "\\") j += 2;
    else if (code.startsWith(quote, j)) return j + quote.length;
    else if (code[j] === "\n" && !multiline) return j;
    else j++;
  }
  return code.length;
}

const nextIsColon = (code, j) => /^[ \t]*:/.test(code.slice(j, j + 16));
const lineStart = (code, i) => /(^|\n)[ \t]*$/.test(code.slice(Math.max(0, i - 64), i));

function scan(code, spec, emit) {
  let i = 0;
  while (i < code.length) {
    const c = code[i];
    const prev = code[i - 1] || "";
    let m;
    if (spec.preprocessor && c === "#" && lineStart(code, i)) {
      const end = code.indexOf("\n", i);
      m = code.slice(i, end < 0 ? code.length : end);
      emit("meta", m);
    } else if (spec.line && code.startsWith(spec.line, i) && !(spec.line === "#" && /[\w$]/.test(prev))) {
      const end = code.indexOf("\n", i);
      m = code.slice(i, end < 0 ? code.length : end);
      emit("com", m);
    } else if (spec.block && code.startsWith(spec.block[0], i)) {
      const end = code.indexOf(spec.block[1], i + spec.block[0].length);
      m = code.slice(i, end < 0 ? code.length : end + spec.block[1].length);
      emit("com", m);
    } else if ((m = spec.strings.find((q) => code.startsWith(q, i)))) {
      const end = stringEnd(code, i + m.length, m);
      emit(spec.keys && nextIsColon(code, end) ? "attr" : "str", code.slice(i, end));
      m = code.slice(i, end);
    } else if (spec.chars && c === "'" && (m = sticky(RUST_CHAR, code, i))) {
      emit("str", m);
    } else if (/\d/.test(c) && !/[\w$]/.test(prev) && (m = sticky(NUMBER, code, i))) {
      emit("num", m);
    } else if (spec.variables && c === "$" && (m = sticky(SHELL_VAR, code, i))) {
      emit("var", m);
    } else if (spec.decorators && c === "@" && lineStart(code, i) && (m = sticky(DECORATOR, code, i))) {
      emit("meta", m);
    } else if ((m = sticky(IDENT, code, i))) {
      emit(wordKind(m, spec, code, i + m.length), m);
    } else {
      m = c;
      emit(null, c);
    }
    i += m.length;
  }
}

function wordKind(word, spec, code, end) {
  const key = spec.caseless ? word.toLowerCase() : word;
  if (spec.keys && nextIsColon(code, end)) return "attr";
  if (spec.keywords.has(key)) return "kw";
  if (spec.literals.has(key)) return "lit";
  if (spec.builtins.has(key)) return "bi";
  if (spec.macros && code[end] === "!") return "fn";
  if (/^[ \t]*\(/.test(code.slice(end, end + 8))) return "fn";
  if (!spec.noTypes && /^[A-Z][a-z\d]/.test(word)) return "type";
  return null;
}

const TAG_NAME = /<\/?[A-Za-z][\w:.-]*/y;
const ATTR_NAME = /[^\s=>/"']+/y;

function markup(code, emit) {
  let i = 0;
  while (i < code.length) {
    if (code.startsWith("<!--", i)) {
      const end = code.indexOf("-->", i + 4);
      const text = code.slice(i, end < 0 ? code.length : end + 3);
      emit("com", text);
      i += text.length;
      continue;
    }
    const tag = sticky(TAG_NAME, code, i);
    if (!tag) {
      emit(null, code[i]);
      i++;
      continue;
    }
    emit("tag", tag);
    i += tag.length;
    while (i < code.length && code[i] !== ">" && !code.startsWith("/>", i) && code[i] !== "<") {
      let m;
      if (code[i] === '"' || code[i] === "'") {
        const close = code.indexOf(code[i], i + 1);
        m = code.slice(i, close < 0 ? code.length : close + 1);
        emit("str", m);
      } else if ((m = sticky(ATTR_NAME, code, i))) {
        emit("attr", m);
      } else {
        m = code[i];
        emit(null, m);
      }
      i += m.length;
    }
    const end = code.startsWith("/>", i) ? "/>" : code[i] === ">" ? ">" : "";
    if (end) emit("tag", end);
    i += end.length;
  }
}
