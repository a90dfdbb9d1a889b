//! The GGUF reader on arbitrary bytes: header, metadata and tensor infos
//! (`GgufFile::from_bytes`), the model config read from the metadata (with its range checks),
//! the tokenizer built from the vocab metadata, and every tensor fetched (small ones
//! dequantized). Any outcome but a panic, an overflow or a hang is fine.
#![no_main]

use std::path::Path;

use ferrite_models::config::ModelConfig;
use ferrite_models::gguf::GgufFile;
use ferrite_models::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(Path::new("fuzz.gguf"), data) else { return };
    let _ = ModelConfig::from_gguf(&file);
    let _ = Tokenizer::from_gguf(&file);
    for info in &file.tensors {
        if let Ok(t) = file.tensor(&info.name) {
            if t.bytes().len() <= 1 << 16 {
                let _ = t.to_f32_vec();
            }
        }
    }
});
