//! Finding tags in text that arrives in pieces: `find` reports the earliest complete tag in
//! a buffer, or where a suffix of the buffer could still grow into one (that text must be
//! held back until the next piece decides it).

/// What `find` saw in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// `tags[tag]` starts at byte `at`.
    Tag { at: usize, tag: usize },
    /// No complete tag, but the text from byte `at` to the end is the start of one.
    Partial { at: usize },
    /// Nothing tag-like: all of the buffer is plain text.
    Nothing,
}

/// The earliest complete tag of `tags` in `buf`, else the earliest suffix that is a proper
/// prefix of a tag.
pub fn find(buf: &str, tags: &[&str]) -> Found {
    let earliest =
        tags.iter().enumerate().filter(|(_, t)| !t.is_empty()).filter_map(|(i, t)| buf.find(t).map(|at| (at, i))).min();
    if let Some((at, tag)) = earliest {
        return Found::Tag { at, tag };
    }
    let partial = buf
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| tags.iter().any(|t| t.len() > buf.len() - i && t.starts_with(&buf[i..])));
    match partial {
        Some(at) => Found::Partial { at },
        None => Found::Nothing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_partial_and_plain() {
        let tags = ["<tool_call>", "<think>"];
        assert_eq!(find("ab<think>cd", &tags), Found::Tag { at: 2, tag: 1 });
        assert_eq!(find("<think><tool_call>", &tags), Found::Tag { at: 0, tag: 1 });
        assert_eq!(find("hello <too", &tags), Found::Partial { at: 6 });
        assert_eq!(find("hello <", &tags), Found::Partial { at: 6 });
        assert_eq!(find("a < b", &tags), Found::Nothing);
        assert_eq!(find("héllo ✓", &tags), Found::Nothing);
        assert_eq!(find("", &tags), Found::Nothing);
    }

    #[test]
    fn a_whole_tag_is_not_partial() {
        assert_eq!(find("x<think", &["<think>"]), Found::Partial { at: 1 });
        assert_eq!(find("x<think>", &["<think>"]), Found::Tag { at: 1, tag: 0 });
    }
}
