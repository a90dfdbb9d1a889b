//! Tokenizers: HF tokenizer.json or a GGUF vocab, and incremental detokenization.
