//! The safetensors header reader on arbitrary bytes (`SafetensorsDir::from_bytes`): the
//! header length, the JSON header and every entry's dtype, shape and offsets against the
//! data. Any outcome but a panic, an overflow or a hang is fine.
#![no_main]

use std::path::Path;

use ferrite_models::safetensors::SafetensorsDir;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(dir) = SafetensorsDir::from_bytes(Path::new("fuzz.safetensors"), data) {
        assert!(dir.total_bytes() >= data.len());
    }
});
