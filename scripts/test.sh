#!/usr/bin/env bash
# The test suite, as CI runs it: fetch third-party test assets and the SmolLM2 model (cached
# under ~/.cache/ferrite), then build, test and lint the whole workspace in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch_test_assets.sh >/dev/null
cargo build --release --bin ferrite
./target/release/ferrite pull smollm2
cargo test --release --workspace
cargo clippy --release --workspace --all-targets -- -D warnings
