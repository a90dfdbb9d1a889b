//! `ferrite run` on a hostile or unverifiable model file, or over a broken CUDA driver library,
//! exits 1 with a one-line error on stderr and no panic or backtrace (even with
//! `RUST_BACKTRACE=1`).

use std::path::Path;
use std::process::Command;

/// A GGUF v3 header with no tensors and one key `evil` holding arrays nested `depth` deep.
fn nested_arrays_gguf(depth: usize) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // metadata keys
    b.extend(4u64.to_le_bytes());
    b.extend(b"evil");
    b.extend(9u32.to_le_bytes());
    for _ in 1..depth {
        b.extend(9u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
    }
    b.extend(4u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b
}

/// A GGUF v3 header with one f32 tensor of 32 values whose offset makes its end wrap.
fn wrapping_offset_gguf() -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(17u64.to_le_bytes());
    b.extend(b"token_embd.weight");
    b.extend(1u32.to_le_bytes());
    b.extend(32u64.to_le_bytes());
    b.extend(0u32.to_le_bytes());
    let data_start = (b.len() as u64 + 8).div_ceil(32) * 32;
    b.extend(0u64.wrapping_sub(data_start).wrapping_sub(64).to_le_bytes());
    b.resize(data_start as usize + 128, 0);
    b
}

/// Run `ferrite run MODEL -p hi --device cpu EXTRA` and return its stderr (`fails`).
fn run_fails(model: &Path, extra: &[&str]) -> String {
    fails(
        Command::new(env!("CARGO_BIN_EXE_ferrite"))
            .arg("run")
            .arg(model)
            .args(["-p", "hi", "--device", "cpu"])
            .args(extra),
    )
}

/// Run `cmd` (a `ferrite` command) on one thread and return its stderr, checked to be one
/// `error:` line from a process that exited 1.
fn fails(cmd: &mut Command) -> String {
    let out = cmd.args(["--threads", "1"]).env("RUST_BACKTRACE", "1").output().expect("run ferrite");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "exit status {:?}, stderr: {stderr}", out.status);
    assert!(out.stdout.is_empty(), "stdout: {}", String::from_utf8_lossy(&out.stdout));
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "stderr is not one line: {stderr}");
    assert!(
        lines[0].starts_with("error: ") && !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
    stderr
}

#[test]
fn run_on_a_bad_model_file_is_a_one_line_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let nested = tmp.path().join("nested.gguf");
    std::fs::write(&nested, nested_arrays_gguf(200_000)).expect("write");
    assert!(run_fails(&nested, &[]).contains("nest deeper than"));

    let wrap = tmp.path().join("wrap.gguf");
    std::fs::write(&wrap, wrapping_offset_gguf()).expect("write");
    assert!(run_fails(&wrap, &[]).contains("token_embd.weight"));

    // --verify-weights on a file that has no digest to check against.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama");
    let msg = run_fails(&fixture, &["--verify-weights"]);
    assert!(msg.contains("model.safetensors") && msg.contains("no digest"), "{msg}");
}

/// A `libcuda.so` that loads but has none of the driver's entry points (a stub or a broken
/// install found first on the library path) is a one-line error for `--device cuda`, where
/// cudarc would panic at its first driver call.
#[test]
fn a_driver_library_without_entry_points_is_a_one_line_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let source = tmp.path().join("stub.c");
    std::fs::write(&source, "int ferrite_stub(void) { return 0; }\n").expect("write");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(tmp.path().join("libcuda.so"))
        .arg(&source)
        .status()
        .expect("run cc");
    assert!(built.success(), "cc failed");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/llama");
    let msg = fails(
        Command::new(env!("CARGO_BIN_EXE_ferrite"))
            .arg("run")
            .arg(&fixture)
            .args(["-p", "hi", "--device", "cuda"])
            .env("LD_LIBRARY_PATH", tmp.path()),
    );
    assert!(msg.contains("libcuda.so") && msg.contains("has no cuInit"), "{msg}");
}
