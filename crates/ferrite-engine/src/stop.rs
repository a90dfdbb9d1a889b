//! Stop strings matched on decoded text. Text that might be the start of a stop string is
//! held back while streaming, so a partial stop string is never emitted.

#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> StopStrings {
        StopStrings { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), pending: String::new() }
    }

    /// Feed newly decoded text. Returns the text that is safe to emit and, when a stop string
    /// appeared, that string (the emitted text then ends right before it).
    pub fn push(&mut self, text: &str) -> (String, Option<String>) {
        if self.stops.is_empty() {
            return (text.to_string(), None);
        }
        self.pending.push_str(text);
        let hit =
            self.stops.iter().filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s))).min_by_key(|(at, _)| *at);
        if let Some((at, s)) = hit {
            let out = self.pending[..at].to_string();
            let s = s.clone();
            self.pending.clear();
            return (out, Some(s));
        }
        let keep = self.held_suffix_len();
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, None)
    }

    /// The longest suffix of `pending` (at a char boundary) that begins some stop string.
    fn held_suffix_len(&self) -> usize {
        let p = &self.pending;
        (1..=p.len())
            .rev()
            .filter(|&n| p.is_char_boundary(p.len() - n))
            .find(|&n| {
                let suffix = &p[p.len() - n..];
                self.stops.iter().any(|s| s.len() > n && s.starts_with(suffix))
            })
            .unwrap_or(0)
    }

    /// Text still held back (emitted when generation ends for another reason).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_and_cuts_at_stop() {
        let mut s = StopStrings::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(s.push("hello E"), ("hello ".into(), None));
        assert_eq!(s.push("N"), ("".into(), None));
        assert_eq!(s.push("X"), ("ENX".into(), None));
        assert_eq!(s.push(" a\n"), (" a".into(), None));
        assert_eq!(s.push("\nrest"), ("".into(), Some("\n\n".into())));
        let mut s = StopStrings::new(vec!["stop".into()]);
        assert_eq!(s.push("ab st"), ("ab ".into(), None));
        assert_eq!(s.flush(), "st");
        let mut s = StopStrings::new(vec!["é!".into()]);
        assert_eq!(s.push("café"), ("caf".into(), None));
        assert_eq!(s.push("!x"), ("".into(), Some("é!".into())));
    }
}
