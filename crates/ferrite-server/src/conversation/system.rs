//! System messages past the start of a conversation (Claude Code sends one at `messages[1]`
//! of every turn). They are rendered where they stand when the chat template takes them
//! there; a template that refuses them (one that raises on a system message after the
//! first) gets them merged into the leading system message instead, in order, each on its
//! own paragraph.

use serde_json::{json, Value};

use super::text_of;

/// `messages` with every system message after the first non-system one merged into the
/// leading system message (made when there is none); `None` when there is no such message.
pub fn merge_late_system(messages: &[Value]) -> Option<Vec<Value>> {
    let lead = messages.iter().take_while(|m| m["role"] == "system").count();
    let late: Vec<String> =
        messages[lead..].iter().filter(|m| m["role"] == "system").map(|m| text_of(&m["content"])).collect();
    if late.is_empty() {
        return None;
    }
    let mut texts: Vec<String> = messages[..lead].iter().map(|m| text_of(&m["content"])).collect();
    texts.extend(late);
    let mut out = vec![json!({"role": "system", "content": texts.join("\n\n")})];
    out.extend(messages[lead..].iter().filter(|m| m["role"] != "system").cloned());
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn late_system_messages_join_the_leading_one() {
        let user = json!({"role": "user", "content": "hi"});
        let late = json!({"role": "system", "content": [{"type": "text", "text": "Be brief."}]});
        assert_eq!(merge_late_system(&[json!({"role": "system", "content": "Lead."}), user.clone()]), None);
        assert_eq!(
            merge_late_system(&[json!({"role": "system", "content": "Lead."}), user.clone(), late.clone()]),
            Some(vec![json!({"role": "system", "content": "Lead.\n\nBe brief."}), user.clone()])
        );
        assert_eq!(
            merge_late_system(&[user.clone(), late]),
            Some(vec![json!({"role": "system", "content": "Be brief."}), user])
        );
    }
}
