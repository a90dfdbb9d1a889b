//! Tool-call scaffolds: the fixed tokens of a chat template's tool-call syntax, found without
//! knowing the syntax. The template renders an assistant turn with probe tool calls that
//! differ in one part at a time (the name, the arguments, a second call); diffing the token
//! ids gives the runs that never change — the opening up to the name, the run between the
//! name and the arguments, and the closing after the arguments. Each run with more than one
//! token becomes an assert rule: once the model has chosen its first token (the trigger) in
//! the right place, the rest of the run is appended without sampling (`--fill strict`).

use ferrite_models::chat_template::{ChatRenderRequest, ChatTemplate};
use ferrite_models::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// One fixed run: after `trigger`, `rest` follows.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Segment {
    trigger: u32,
    rest: Vec<u32>,
}

/// The fixed runs of one tool call, in order: opening, between name and arguments, closing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolScaffold {
    segments: Vec<Segment>,
}

/// Where a sequence is in the scaffold: the index of the run it expects next.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScaffoldCursor {
    stage: usize,
}

fn tool_call(name: &str, arguments: Value) -> Value {
    json!({"id": format!("call_{name}"), "type": "function", "function": {"name": name, "arguments": arguments}})
}

fn probe_tool(name: &str) -> Value {
    json!({"type": "function", "function": {
        "name": name, "description": "A probe.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn common_suffix(a: &[u32], b: &[u32]) -> usize {
    a.iter().rev().zip(b.iter().rev()).take_while(|(x, y)| x == y).count()
}

impl ToolScaffold {
    /// Find the scaffold of `template`'s tool calls under `tok`. `None` when the template
    /// renders no tool calls, renders them inconsistently, or its opening does not start
    /// with a token that only the template writes (an added token such as `<tool_call>`):
    /// a trigger that ordinary text can produce would assert scaffolds into plain answers.
    pub fn discover(template: &ChatTemplate, tok: &Tokenizer, ends: &[u32]) -> Option<ToolScaffold> {
        // Names and arguments that differ at both ends, so no run swallows part of them.
        let (n1, n2) = ("probe", "xyz_fetch");
        let (a1, a2) = (json!({"city": "Paris"}), json!({}));
        let tools = [probe_tool(n1), probe_tool(n2)];
        let user = json!({"role": "user", "content": "Call a probe."});
        let encode = |messages: &[Value], add_generation_prompt: bool| -> Option<Vec<u32>> {
            let req =
                ChatRenderRequest { messages, tools: Some(&tools), add_generation_prompt, extra: Default::default() };
            tok.encode(&template.render(&req).ok()?, false).ok()
        };
        let prompt = encode(std::slice::from_ref(&user), true)?;
        let turn = |calls: Vec<Value>| -> Option<Vec<u32>> {
            let reply = json!({"role": "assistant", "content": "", "tool_calls": calls});
            let ids = encode(&[user.clone(), reply], false)?;
            ids.starts_with(&prompt).then(|| ids[prompt.len()..].to_vec())
        };
        let g1 = turn(vec![tool_call(n1, a1.clone())])?;
        let g2 = turn(vec![tool_call(n2, a1.clone())])?;
        let g3 = turn(vec![tool_call(n1, a2.clone())])?;
        let g4 = turn(vec![tool_call(n1, a1), tool_call(n2, a2)])?;
        // Opening: up to the name. After the name: the common tail of g1 and g2.
        let open = common_prefix(&g1, &g2);
        let after_name = g1.len() - common_suffix(&g1, &g2);
        // Between name and arguments: g1 and g3 agree until the arguments differ.
        let before_args = common_prefix(&g1, &g3).max(after_name);
        // Closing: the common tail of g1 and g3, as far as a second call leaves it unchanged.
        let close_start = (g1.len() - common_suffix(&g1, &g3)).max(before_args);
        let close_len = common_prefix(&g1[close_start..], g4.get(close_start..).unwrap_or_default());
        let mut close = g1[close_start..close_start + close_len].to_vec();
        if let Some(end) = close.iter().position(|t| ends.contains(t)) {
            close.truncate(end + 1);
        }
        if open == 0 || open > after_name || !tok.hf().get_added_tokens_decoder().contains_key(&g1[0]) {
            return None;
        }
        let segments = [&g1[..open], &g1[after_name..before_args], &close[..]]
            .into_iter()
            .filter(|run| !run.is_empty())
            .map(|run| Segment { trigger: run[0], rest: run[1..].to_vec() })
            .collect();
        Some(ToolScaffold { segments })
    }

    /// The tokens to assert after the model chose `token`, advancing `cursor`: the rest of the
    /// run it expects when `token` triggers it; an opening trigger anywhere starts a new call.
    pub fn after(&self, cursor: &mut ScaffoldCursor, token: u32) -> &[u32] {
        let n = self.segments.len();
        let stage = if self.segments[cursor.stage % n].trigger == token {
            cursor.stage % n
        } else if self.segments[0].trigger == token {
            0
        } else {
            return &[];
        };
        cursor.stage = (stage + 1) % n;
        &self.segments[stage].rest
    }

    /// The cursor after `tokens` (a prompt): a prompt that ends inside an opened call (a
    /// forced tool choice) continues the scaffold from there. Only whole runs count here — a
    /// system prompt that shows the syntax (`<tool_call>\n{"name": <function-name>, …`)
    /// opens no call, and must not leave the reply expecting a call's later runs.
    pub fn cursor_after(&self, tokens: &[u32]) -> ScaffoldCursor {
        let mut cursor = ScaffoldCursor::default();
        for (i, &t) in tokens.iter().enumerate() {
            let mut next = cursor;
            let rest = self.after(&mut next, t);
            if tokens[i + 1..].starts_with(rest) {
                cursor = next;
            }
        }
        cursor
    }

    /// The runs as token ids (trigger first), for display and tests.
    pub fn runs(&self) -> Vec<Vec<u32>> {
        self.segments.iter().map(|s| [vec![s.trigger], s.rest.clone()].concat()).collect()
    }
}
