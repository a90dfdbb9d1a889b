//! Pre-tokenizer split rules for GGUF byte-level BPE vocabularies, by `tokenizer.ggml.pre`.
//!
//! A GGUF file names its pre-tokenizer (`llama-bpe`, `qwen2`, `gpt-2`, ...) instead of storing
//! it. Each name maps to the list of split regexes llama.cpp uses for it (`llama-vocab.cpp`):
//! every regex splits every piece left by the previous one, keeping both the matches and the
//! text between them as pieces — exactly a sequence of Hugging Face `Split(.., Isolated)`
//! pre-tokenizers. Where llama.cpp rewrote the model's original `tokenizer.json` regex to suit
//! `std::regex` (case-insensitive groups, lookaheads), we keep the original: our regex engine
//! (fancy-regex) runs it as Hugging Face does.

/// How a byte-level BPE vocabulary splits text before the merges run.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PreTokenizerSpec {
    /// Split regexes, applied in order.
    pub regexes: &'static [&'static str],
    /// Whole pieces found in the vocab are taken as one token without running the merges
    /// (Hugging Face BPE `ignore_merges`).
    pub ignore_merges: bool,
    /// NFC-normalize the text first (the Qwen2 tokenizers do).
    pub nfc: bool,
    /// Add BOS when the GGUF does not say (`tokenizer.ggml.add_bos_token` overrides).
    pub default_add_bos: bool,
}

const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const JAIS2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}";

const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const QWEN35: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const DEEPSEEK_LLM: &[&str] = &[
    r"[\r\n]",
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+",
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    r"\s+$",
    r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
    r"\p{N}+",
];

const DEEPSEEK_V3: &[&str] = &[
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const SPARK2_5: &[&str] = &[
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##,
    r"\p{N}",
];

const YOUTU: &[&str] = &[
    r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

const DEEPSEEK_CODER: &[&str] =
    &[r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+", r"\p{N}"];

const FALCON: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|`]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"[0-9][0-9][0-9]",
];

const STARCODER: &[&str] = &[r"\p{N}", GPT2];

const BLOOM: &[&str] = &[r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"];

const VIKING: &[&str] = &[r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+", r"\p{N}"];

const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const CHAMELEON: &[&str] = &[
    r"<sentinel:[0-9]+>",
    r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    r"([\t\n]|    |  )",
    r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]",
    GPT2,
];

const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const TINY_AYA: &[&str] = &[r"\d{1,3}(?=(?:\d{3})*\b)", GPT4O];

const BAILINGMOE: &str = r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+";

const SEED_CODER: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";

const UFAKZEKA: &str = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const LAGUNA: &[&str] = &[r"[^\n]+|[\n]+", QWEN2];

const EXAONE_MOE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+";

const MINICPM5: &[&str] = &[
    r"\p{N}{1,3}",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

const DEFAULT: &[&str] = &[
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
];

/// The split rules for a `tokenizer.ggml.pre` value (`None` when absent: llama.cpp's
/// default). `Err` names an unknown or unsupported pre-tokenizer.
pub(super) fn spec_for(pre: Option<&str>) -> Result<PreTokenizerSpec, String> {
    let spec = |regexes, ignore_merges, nfc, default_add_bos| PreTokenizerSpec {
        regexes,
        ignore_merges,
        nfc,
        default_add_bos,
    };
    let pre = match pre {
        None => return Ok(spec(DEFAULT, false, false, false)),
        Some(p) => p,
    };
    Ok(match pre {
        "default" => spec(DEFAULT, false, false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" => spec(&[LLAMA3], true, false, true),
        "dbrx" | "smaug-bpe" => spec(&[LLAMA3], false, false, false),
        "jais-2" => spec(&[JAIS2], false, false, false),
        "deepseek-llm" => spec(DEEPSEEK_LLM, false, false, false),
        "deepseek-coder" => spec(DEEPSEEK_CODER, false, false, false),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => spec(DEEPSEEK_V3, false, false, false),
        "spark2_5" => spec(SPARK2_5, false, false, false),
        "youtu" => spec(YOUTU, true, false, false),
        "falcon" => spec(FALCON, false, false, false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            spec(STARCODER, false, false, false)
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum"
        | "modern-bert" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo" | "jais" | "trillion"
        | "granite-docling" | "exaone4" => spec(&[GPT2], false, false, false),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan" | "solar-open" => {
            spec(&[QWEN2], false, pre != "stablelm2" && pre != "hunyuan" && pre != "solar-open", false)
        }
        "qwen35" => spec(&[QWEN35], false, false, false),
        "poro-chat" | "bloom" | "gpt3-finnish" => spec(BLOOM, false, false, false),
        "chatglm-bpe" | "glm4" | "glm5" => spec(&[LLAMA3], pre != "chatglm-bpe", false, false),
        "viking" => spec(VIKING, false, false, false),
        "tekken" => spec(&[TEKKEN], true, false, true),
        "chameleon" => spec(CHAMELEON, false, false, true),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => spec(&[GPT4O], false, false, false),
        "tiny_aya" | "cohere2moe" => spec(TINY_AYA, false, false, false),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => spec(&[BAILINGMOE], false, false, false),
        "seed-coder" => spec(&[SEED_CODER], false, false, false),
        "ufakzeka" => spec(&[UFAKZEKA], false, false, false),
        "grok-2" => spec(&[QWEN2], false, false, false),
        "laguna" => spec(LAGUNA, false, false, false),
        "exaone-moe" => spec(&[EXAONE_MOE], false, false, false),
        "minicpm5" => spec(MINICPM5, true, false, false),
        other => return Err(format!("unsupported pre-tokenizer tokenizer.ggml.pre = {other:?}")),
    })
}

/// Every pre-tokenizer name `spec_for` accepts (for tests).
#[cfg(test)]
pub(super) const KNOWN: &[&str] = &[
    "default",
    "llama-bpe",
    "dbrx",
    "jais-2",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "spark2_5",
    "youtu",
    "falcon",
    "starcoder",
    "gpt-2",
    "qwen2",
    "qwen35",
    "bloom",
    "glm4",
    "viking",
    "tekken",
    "chameleon",
    "gpt-4o",
    "tiny_aya",
    "bailingmoe",
    "seed-coder",
    "ufakzeka",
    "grok-2",
    "laguna",
    "exaone-moe",
    "minicpm5",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_regex_compiles() {
        for name in KNOWN {
            let spec = spec_for(Some(name)).expect(name);
            for re in spec.regexes {
                let pattern = tokenizers::pre_tokenizers::split::SplitPattern::Regex(re.to_string());
                tokenizers::pre_tokenizers::split::Split::new(
                    pattern,
                    tokenizers::SplitDelimiterBehavior::Isolated,
                    false,
                )
                .unwrap_or_else(|e| panic!("{name}: {re}: {e}"));
            }
        }
    }

    #[test]
    fn unknown_pre_is_an_error() {
        assert!(spec_for(Some("no-such-tokenizer")).is_err());
    }
}
