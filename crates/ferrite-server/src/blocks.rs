//! Parsed output as an ordered list of blocks — text, reasoning, one per tool call — for
//! the APIs whose replies are lists of parts (Anthropic content blocks, Responses output
//! items). `Blocks::feed` turns parser deltas into block events as they stream: a block
//! starts when the kind of output changes (or a new call begins) and stops when the next
//! one starts or the reply ends. The finished blocks stay in `blocks` for the whole reply.

use crate::parser::Delta;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Text,
    Reasoning,
    ToolCall,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub kind: BlockKind,
    /// The text, the reasoning, or the call's JSON arguments.
    pub text: String,
    /// A tool call's id and function name (empty for other blocks).
    pub call_id: String,
    pub name: String,
}

/// A change to the block at an index of `Blocks::blocks`.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockEvent {
    Start(usize),
    Delta(usize, String),
    Stop(usize),
}

#[derive(Debug, Default)]
pub struct Blocks {
    pub blocks: Vec<Block>,
    /// The last block is still open.
    open: bool,
}

impl Blocks {
    pub fn feed(&mut self, deltas: Vec<Delta>) -> Vec<BlockEvent> {
        let mut events = Vec::new();
        for d in deltas {
            let (kind, text, call) = match d {
                Delta::Content(t) => (BlockKind::Text, t, None),
                Delta::Reasoning(t) => (BlockKind::Reasoning, t, None),
                Delta::ToolCall(c) => {
                    let first = c.id.is_some() || c.name.is_some();
                    let start = first.then(|| (c.id.unwrap_or_default(), c.name.unwrap_or_default()));
                    (BlockKind::ToolCall, c.arguments, start)
                }
            };
            let continues = self.open && self.blocks.last().is_some_and(|b| b.kind == kind) && call.is_none();
            if !continues {
                if text.is_empty() && call.is_none() {
                    continue;
                }
                events.extend(self.close());
                let (call_id, name) = call.unwrap_or_default();
                self.blocks.push(Block { kind, text: String::new(), call_id, name });
                self.open = true;
                events.push(BlockEvent::Start(self.blocks.len() - 1));
            }
            if !text.is_empty() {
                let at = self.blocks.len() - 1;
                self.blocks[at].text.push_str(&text);
                events.push(BlockEvent::Delta(at, text));
            }
        }
        events
    }

    /// Stop the open block, if any.
    pub fn close(&mut self) -> Vec<BlockEvent> {
        if !std::mem::take(&mut self.open) {
            return Vec::new();
        }
        vec![BlockEvent::Stop(self.blocks.len() - 1)]
    }

    pub fn has_tool_calls(&self) -> bool {
        self.blocks.iter().any(|b| b.kind == BlockKind::ToolCall)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parser::ToolCallDelta;

    fn call(index: usize, first: bool, args: &str) -> Delta {
        Delta::ToolCall(ToolCallDelta {
            index,
            id: first.then(|| format!("call_{index}")),
            name: first.then(|| "f".to_string()),
            arguments: args.into(),
        })
    }

    #[test]
    fn blocks_follow_the_kind_of_output() {
        let mut b = Blocks::default();
        let mut events = b.feed(vec![Delta::Reasoning("hm".into()), Delta::Content(String::new())]);
        events.extend(b.feed(vec![Delta::Content("Hi".into()), Delta::Content(" there".into())]));
        events.extend(b.feed(vec![call(0, true, ""), call(0, false, "{}"), call(1, true, "{\"a\":1}")]));
        events.extend(b.close());
        use BlockEvent as E;
        assert_eq!(
            events,
            vec![
                E::Start(0),
                E::Delta(0, "hm".into()),
                E::Stop(0),
                E::Start(1),
                E::Delta(1, "Hi".into()),
                E::Delta(1, " there".into()),
                E::Stop(1),
                E::Start(2),
                E::Delta(2, "{}".into()),
                E::Stop(2),
                E::Start(3),
                E::Delta(3, "{\"a\":1}".into()),
                E::Stop(3),
            ]
        );
        assert_eq!(b.blocks[1].text, "Hi there");
        assert_eq!((b.blocks[3].call_id.as_str(), b.blocks[3].name.as_str()), ("call_1", "f"));
        assert!(b.has_tool_calls());
        assert!(b.close().is_empty());
    }
}
