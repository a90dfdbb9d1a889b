//! Streaming detokenization: the pushes of an `IncrementalDecoder` add up to the batch
//! decode — from the start of the text, and after a prompt, where
//! `decode(prompt) + stream == decode(prompt + generated)` — on every tokenizer kind ferrite
//! reads, and never put U+FFFD mid-stream in valid text.

use ferrite_models::tokenizer::IncrementalDecoder;
use rand::{Rng, SeedableRng};

use super::*;

const REPLACEMENT: char = '\u{FFFD}';

/// One vocab of each kind: GGUF gpt2-style BPE, llama SPM, Gemma; `tokenizer.json` with a
/// ByteLevel decoder, an SPM one (Replace/ByteFallback/Fuse/Strip) and a Metaspace one.
/// `true` for byte-level vocabs (any id sequence streams as its decode).
pub(super) fn vocabs() -> Vec<(&'static str, &'static Tokenizer, bool)> {
    vec![
        ("llama-bpe", gguf_tokenizer("llama-bpe"), true),
        ("qwen2", gguf_tokenizer("qwen2"), true),
        ("gpt-2", gguf_tokenizer("gpt-2"), true),
        ("llama-spm", gguf_tokenizer("llama-spm"), false),
        ("phi-3", gguf_tokenizer("phi-3"), false),
        ("gemma-4", gguf_tokenizer("gemma-4"), false),
        ("hf llama3", hf_tokenizer("llama3"), true),
        ("hf llama2", hf_tokenizer("llama2"), false),
        ("hf metaspace", metaspace_llama2(), false),
        ("hf gemma3", hf_tokenizer("gemma3"), false),
    ]
}

/// Llama 2's `tokenizer.json` with the `Metaspace` decoder (prepend scheme `first`, as
/// Mistral- and TinyLlama-style files have it) in place of Replace/Strip.
fn metaspace_llama2() -> &'static Tokenizer {
    cached("hf:llama2-metaspace".into(), || {
        let src = assets().join("lenml").join("llama2").join("models");
        let mut json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).expect("read")).expect("json");
        json["decoder"] = serde_json::json!({"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
            {"type": "ByteFallback"}, {"type": "Fuse"}]});
        let dir = std::env::temp_dir().join(format!("ferrite-metaspace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::copy(src.join("tokenizer_config.json"), dir.join("tokenizer_config.json")).expect("copy");
        std::fs::write(dir.join("tokenizer.json"), json.to_string()).expect("write");
        let tok = Tokenizer::from_file(&dir.join("tokenizer.json")).expect("metaspace tokenizer");
        std::fs::remove_dir_all(&dir).ok();
        tok
    })
}

/// Push every id of `ids[k..]` to a decoder seeded with the prompt `ids[..k]` (`new` when
/// `k` is 0), then finish; returns the chunks (finish's last).
fn stream_after(tok: &Tokenizer, ids: &[u32], k: usize, skip: bool) -> Vec<String> {
    let mut dec =
        if k == 0 { IncrementalDecoder::new(skip) } else { IncrementalDecoder::with_prompt(tok, &ids[..k], skip) };
    let mut out: Vec<String> = ids[k..].iter().map(|&id| dec.push(tok, id).expect("push")).collect();
    out.push(dec.finish(tok).expect("finish"));
    out
}

fn stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> Vec<String> {
    stream_after(tok, ids, 0, skip)
}

/// The prompt's text when the stream continues `ids[..k]` into `want`: its decode, or, when
/// the prompt ends inside a character (its decode is then no prefix of `want`), the text of
/// its complete characters — for byte-level vocabs the decode without its trailing U+FFFD,
/// for byte-fallback ones the decode of the prompt without the character's last ids.
fn prompt_text(tok: &Tokenizer, ids: &[u32], k: usize, skip: bool, want: &str, byte_level: bool) -> String {
    let decode = |j: usize| tok.decode(&ids[..j], skip).expect("decode");
    let whole = decode(k);
    if want.starts_with(&whole) {
        return whole;
    }
    if byte_level {
        return whole.trim_end_matches(REPLACEMENT).to_string();
    }
    (k.saturating_sub(3)..k)
        .rev()
        .map(decode)
        .find(|p| !p.ends_with(REPLACEMENT) && want.starts_with(p.as_str()))
        .unwrap_or(whole)
}

/// After the prompt `ids[..k]`: `prompt text + stream == decode(ids)` (see `prompt_text`:
/// a prompt that ends inside a character streams that whole character), and for valid text
/// no chunk holds U+FFFD. For byte-level vocabs the equality holds for any ids.
fn check_after(what: &str, tok: &Tokenizer, ids: &[u32], k: usize, skip: bool, byte_level: bool) {
    let chunks = stream_after(tok, ids, k, skip);
    let want = tok.decode(ids, skip).expect("decode");
    let valid = !want.contains(REPLACEMENT);
    if byte_level || valid {
        let prompt = prompt_text(tok, ids, k, skip, &want, byte_level);
        assert_eq!(prompt + &chunks.concat(), want, "{what}: split after {k} of {ids:?} (skip {skip})");
    }
    if valid {
        assert!(chunks.iter().all(|c| !c.contains(REPLACEMENT)), "{what}: U+FFFD mid-stream: {chunks:?}");
    }
}

/// From the start of the text the stream is the decode, for any ids (as for a byte-level
/// vocab after a prompt).
fn check_stream(what: &str, tok: &Tokenizer, ids: &[u32], skip: bool) {
    check_after(what, tok, ids, 0, skip, true);
}

/// Texts whose characters are split over tokens: byte-fallback runs in SentencePiece vocabs
/// (the CJK and math letters are not in Llama 2's vocab), multi-token emoji in byte-level ones.
const MULTIBYTE: &[&str] =
    &["🦙🦙🦙 and 中文字符测试文本 then 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 é", "The capital of France is Paris. 東京は日本の首都です。👍🏽👍🏽"];

#[test]
fn stream_equals_decode_on_real_text() {
    let mut texts: Vec<String> = goldens("llama-bpe").into_iter().map(|(t, _)| t).collect();
    texts.extend(ROUNDTRIP.iter().chain(MULTIBYTE).map(|s| s.to_string()));
    for (name, tok, _) in vocabs() {
        for text in &texts {
            let ids = tok.encode(text, true).unwrap();
            check_stream(name, tok, &ids, false);
            check_stream(name, tok, &ids, true);
        }
    }
    let chat = "<|im_start|>user\nHi 🦙!<|im_end|>\n<|im_start|>assistant\nHello — ça va?<|im_end|>";
    let ids = smollm2().encode(chat, false).unwrap();
    check_stream("smollm2", smollm2(), &ids, false);
    check_stream("smollm2", smollm2(), &ids, true);
    assert_eq!(stream(smollm2(), &ids, true).concat(), "user\nHi 🦙!\nassistant\nHello — ça va?");
}

/// Every split of real text into a prompt and (up to 24 ids of) a continuation: inside words,
/// after spaces, between the bytes of one character, in runs of byte tokens.
#[test]
fn stream_after_a_prompt_equals_the_decode_of_everything() {
    let mut texts: Vec<String> = goldens("llama-bpe").into_iter().map(|(t, _)| t).take(24).collect();
    texts.extend(ROUNDTRIP.iter().chain(MULTIBYTE).map(|s| s.to_string()));
    for (name, tok, byte_level) in vocabs() {
        for text in &texts {
            let ids = tok.encode(text, true).unwrap();
            for k in 1..ids.len() {
                let end = (k + 24).min(ids.len());
                check_after(name, tok, &ids[..end], k, true, byte_level);
                check_after(name, tok, &ids[..end], k, false, byte_level);
            }
        }
    }
}

/// Issue 25 (9): after `The capital of France is` the first generated token keeps its space.
#[test]
fn stream_after_a_prompt_keeps_the_leading_space() {
    for (name, tok, _) in vocabs() {
        let prompt = tok.encode("The capital of France is", true).unwrap();
        let all = tok.encode("The capital of France is Paris, of course.", true).unwrap();
        assert_eq!(all[..prompt.len()], prompt[..], "{name}: the prompt's ids are a prefix");
        let chunks = stream_after(tok, &all, prompt.len(), true);
        assert_eq!(chunks.concat(), " Paris, of course.", "{name}");
        assert!(chunks[0].starts_with(' '), "{name}: {chunks:?}");
    }
    // Without the prompt's context a SentencePiece `▁Paris` is the text's start.
    let tok = hf_tokenizer("llama2");
    let all = tok.encode("The capital of France is Paris", true).unwrap();
    let alone = stream(tok, &all[all.len() - 1..], true).concat();
    assert_eq!(alone, "Paris");
}

/// The `<0xNN>` ids of a character's UTF-8 bytes (SentencePiece byte fallback).
fn byte_tokens(tok: &Tokenizer, c: char) -> Vec<u32> {
    let mut buf = [0u8; 4];
    c.encode_utf8(&mut buf).bytes().map(|b| tok.token_to_id(&format!("<0x{b:02X}>")).expect("byte token")).collect()
}

#[test]
fn stream_equals_decode_on_random_ids() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
    for (name, tok, byte_level) in vocabs() {
        let n = tok.vocab_size() as u32;
        for _ in 0..150 {
            let len = rng.random_range(1..48);
            let mut ids: Vec<u32> = (0..len).map(|_| rng.random_range(0..n)).collect();
            // Any id sequence: never a panic, and the same text whenever it is valid (for
            // byte-level vocabs: always), from the start and after a prompt of any length.
            let chunks = stream(tok, &ids, false);
            let want = tok.decode(&ids, false).unwrap();
            if byte_level || !want.contains(REPLACEMENT) {
                assert_eq!(chunks.concat(), want, "{name}: {ids:?}");
            }
            check_after(name, tok, &ids, rng.random_range(0..ids.len()), false, byte_level);
            if !byte_level {
                // Valid text: no stray byte tokens, but multi-byte characters split over
                // byte-fallback tokens at random places (next to each other too), and the
                // prompt cut anywhere, inside a character too.
                ids.retain(|&id| !tok.id_to_token(id).is_some_and(|t| t.starts_with("<0x")));
                let mut units: Vec<Vec<u32>> = ids.iter().map(|&id| vec![id]).collect();
                for _ in 0..rng.random_range(1..6) {
                    let c = ['é', '中', '🦙', '𝔘', 'ß'][rng.random_range(0..5)];
                    let at = rng.random_range(0..=units.len());
                    units.insert(at, byte_tokens(tok, c));
                }
                let ids = units.concat();
                check_stream(name, tok, &ids, false);
                check_stream(name, tok, &ids, true);
                for _ in 0..4 {
                    let k = rng.random_range(1..ids.len());
                    check_after(name, tok, &ids, k, false, false);
                    check_after(name, tok, &ids, k, true, false);
                }
            }
        }
    }
}

#[test]
fn stream_holds_incomplete_characters() {
    let tok = gguf_tokenizer("llama-spm");
    let mut dec = IncrementalDecoder::new(false);
    assert_eq!(dec.push(tok, tok.token_to_id("▁I").unwrap()).unwrap(), "I");
    let llama = byte_tokens(tok, '𝔘');
    for &b in &llama[..3] {
        assert_eq!(dec.push(tok, b).unwrap(), "", "an incomplete character must be held back");
    }
    assert_eq!(dec.push(tok, llama[3]).unwrap(), "𝔘");
    // An incomplete character at the end comes out of finish (as U+FFFD, like decode).
    dec.push(tok, llama[0]).unwrap();
    assert_eq!(dec.finish(tok).unwrap(), "\u{FFFD}");

    // A prompt that ends inside a character: the stream starts with the whole character.
    let mut prompt = tok.encode("I like", true).unwrap();
    prompt.extend(&llama[..2]);
    let mut dec = IncrementalDecoder::with_prompt(tok, &prompt, true);
    assert_eq!(dec.push(tok, llama[2]).unwrap(), "");
    assert_eq!(dec.push(tok, llama[3]).unwrap(), "𝔘");
    assert_eq!(dec.push(tok, tok.token_to_id("▁a").unwrap()).unwrap(), " a");

    // Byte-level: a 4-byte emoji split over tokens.
    let tok = gguf_tokenizer("llama-bpe");
    let ids = tok.encode(" this is 🦙.cpp", false).unwrap();
    let chunks = stream(tok, &ids, false);
    assert!(chunks.iter().any(|c| c.is_empty()), "{chunks:?}");
    assert_eq!(chunks.concat(), " this is 🦙.cpp");
}

#[test]
fn stream_through_long_runs_of_skipped_or_invalid_ids() {
    for (name, tok, _) in vocabs() {
        let special = tok.bos_token_id().or(tok.eos_token_id()).expect("a special token");
        let mut ids = tok.encode("Hello there", false).unwrap();
        ids.extend(std::iter::repeat_n(special, 100));
        ids.extend(tok.encode("Hello world, again 🦙", false).unwrap());
        check_stream(name, tok, &ids, true);
        check_stream(name, tok, &ids, false);
        // After a prompt that ends in a long run of skipped special tokens.
        check_after(name, tok, &ids, ids.len() - 6, true, false);
        check_after(name, tok, &ids, 2 + 100, true, false);
    }
    // 100 lone continuation bytes: invalid text, streamed without a panic and in full.
    let tok = gguf_tokenizer("llama-bpe");
    let cont = tok.encode("\u{80}", false).unwrap()[0];
    let ids = vec![cont; 100];
    let chunks = stream(tok, &ids, false);
    assert_eq!(chunks.concat(), tok.decode(&ids, false).unwrap());
    assert!(chunks.iter().filter(|c| !c.is_empty()).count() > 1, "long invalid runs are not held to the end");
}
