#!/usr/bin/env bash
# The test suite, as CI runs it: fetch third-party test assets and the SmolLM2 model (cached
# under ~/.cache/ferrite), build, test and lint the whole workspace in release mode, then drive
# the web chat page of `ferrite serve` in headless Chromium (scripts/web_chat_test.py installs
# chromium and selenium if missing). scripts/e2e_sdk.py (official OpenAI/Anthropic SDKs) and
# scripts/load_test.py (2,000 requests with disconnects) run the server harder; they are not
# in this suite yet (see BENCHMARKS.md / the issue notes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch_test_assets.sh >/dev/null
cargo build --release --bin ferrite
./target/release/ferrite pull smollm2
cargo test --release --workspace
cargo clippy --release --workspace --all-targets -- -D warnings
python3 scripts/web_chat_test.py
