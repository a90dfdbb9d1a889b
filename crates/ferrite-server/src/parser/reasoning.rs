//! `ReasoningParser`: splits reasoning blocks (`<think>…</think>`, or the family's tags) out
//! of generated text as `Delta::Reasoning`, and hands the rest to an inner parser (tool
//! calls or plain content). A reply may start inside a block the prompt opened (a template
//! that writes `<think>\n` after the generation prompt); a block never closed is reasoning
//! to the end. Blanks just inside the tags and just after the closing one are dropped.

use super::family::ReasoningTags;
use super::scan::{find, Found};
use super::{Delta, Finished, OutputParser};

pub struct ReasoningParser {
    tags: ReasoningTags,
    inner: Box<dyn OutputParser>,
    inside: bool,
    buf: String,
    /// Drop blanks at the start of what comes next (after a tag).
    skip_blanks: bool,
    /// Trailing blanks of the reasoning so far, held back (dropped at the closing tag).
    held_ws: String,
}

impl ReasoningParser {
    /// `opened`: the prompt ends inside a reasoning block.
    pub fn new(tags: ReasoningTags, opened: bool, inner: Box<dyn OutputParser>) -> ReasoningParser {
        ReasoningParser { tags, inner, inside: opened, buf: String::new(), skip_blanks: opened, held_ws: String::new() }
    }

    fn strip<'t>(&mut self, text: &'t str) -> &'t str {
        if !self.skip_blanks {
            return text;
        }
        let rest = text.trim_start();
        self.skip_blanks = rest.is_empty();
        rest
    }

    fn reasoning(&mut self, text: &str, closing: bool, out: &mut Vec<Delta>) {
        let text = self.strip(text);
        let s = std::mem::take(&mut self.held_ws) + text;
        let keep = s.trim_end().len();
        if keep > 0 {
            out.push(Delta::Reasoning(s[..keep].to_string()));
        }
        if !closing {
            self.held_ws = s[keep..].to_string();
        }
    }

    fn content(&mut self, text: &str, out: &mut Vec<Delta>) {
        let text = self.strip(text);
        if !text.is_empty() {
            out.extend(self.inner.push(text));
        }
    }

    fn run(&mut self, out: &mut Vec<Delta>) {
        loop {
            let tag = if self.inside { self.tags.close } else { self.tags.open };
            let found = find(&self.buf, &[tag]);
            let upto = match found {
                Found::Tag { at, .. } | Found::Partial { at } => at,
                Found::Nothing => self.buf.len(),
            };
            let piece: String = self.buf.drain(..upto).collect();
            let closing = matches!(found, Found::Tag { .. });
            if self.inside {
                self.reasoning(&piece, closing, out);
            } else {
                self.content(&piece, out);
            }
            if !closing {
                return;
            }
            self.buf.drain(..tag.len());
            self.inside = !self.inside;
            self.skip_blanks = true;
        }
    }
}

impl OutputParser for ReasoningParser {
    fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(&mut out);
        out
    }

    fn finish(&mut self) -> Finished {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.inside {
            self.reasoning(&rest, true, &mut out);
        } else {
            self.content(&rest, &mut out);
        }
        Finished::after(out, self.inner.finish())
    }
}
