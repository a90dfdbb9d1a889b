//! The README's first command, run as written (its defaults, no flags added): it answers the
//! factual question (greedy decoding, the fallback when the model's files give no sampling
//! settings), and stderr carries no note the user did not ask for.

use std::path::Path;
use std::process::Command;

/// The arguments after `--` of the first `cargo run ... --bin ferrite -- ARGS` line of the
/// README, split as the shell does for plain words and double-quoted strings.
fn readme_first_command() -> Vec<String> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md")).unwrap();
    let line = readme
        .lines()
        .find(|l| l.starts_with("cargo run") && l.contains("--bin ferrite --"))
        .expect("the README has a `cargo run --bin ferrite --` command");
    let args = line.split_once("--bin ferrite --").unwrap().1;
    let mut out = Vec::new();
    for (i, part) in args.split('"').enumerate() {
        if i % 2 == 1 {
            out.push(part.to_string());
        } else {
            out.extend(part.split_whitespace().map(String::from));
        }
    }
    out
}

#[test]
fn the_readme_first_command_answers() {
    let args = readme_first_command();
    assert_eq!(args[..2], ["run", "smollm2"], "{args:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite")).args(&args).output().expect("run ferrite");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("Paris"), "stdout: {stdout}\nstderr: {stderr}");
    assert!(!stderr.lines().any(|l| l.starts_with("note:")), "a note nobody asked for: {stderr}");
}

#[test]
fn a_fill_the_user_asks_for_gets_its_note() {
    // SmolLM2's template has no tool-call scaffold: said when --fill is given, not by default.
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["run", "smollm2", "-p", "Hi", "-n", "1", "--fill", "strict", "--top-k", "5"])
        .output()
        .expect("run ferrite");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("note: this model's chat template has no tool-call scaffold"), "{stderr}");
    assert!(stderr.contains("note: --top-k has no effect when decoding greedily"), "{stderr}");
}
