#!/usr/bin/env bash
# ferrite vs llama.cpp's CUDA backend on the same shapes, side by side (issue 6's peer).
#
#   bash scripts/bench_cuda_vs_llamacpp.sh pack [OUT.tar.gz]
#       here (any machine with Python and the sdist): llama.cpp's sources from the
#       llama-cpp-python==0.3.36 sdist (77 MB), trimmed to what a CUDA build of llama-bench
#       needs (3.4 MB: no models, docs, tests, other backends or tools), plus gguf-py for the
#       random GGUFs; then checks the trimmed tree with a CPU-only cmake configure.
#       Default OUT: .gpu/llama-cpp-cuda-src.tar.gz. LLAMA_CPP_SDIST may name an unpacked
#       sdist directory or its .tar.gz (otherwise it is fetched with pip into $LLAMA_CPP_HOME).
#   bash scripts/bench_cuda_vs_llamacpp.sh build TARBALL
#       there (the GPU machine; ~6 minutes on 16 cores): unpack into $WORK (default
#       /tmp/llama-cuda) and build llama-bench with -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a.
#   bash scripts/bench_cuda_vs_llamacpp.sh bench
#       there: for each case (shape + dtype) write a random-weight GGUF with scripts/random_gguf.py
#       (under $WORK/gguf), run `llama-bench -ngl 99 -fa 1` (decode of 128 tokens after a
#       512-token context, and a 2,048-token prefill) and `ferrite bench decode --synthetic`
#       on the same shape and dtype, and print the table (tokens/s, ratio ferrite / llama.cpp).
#       CASES overrides the list ("llama-3.1-8b:q4_0 llama-3.2-1b:bf16 ...", and the MoE
#       "qwen3-30b-a3b:q4_k": an 18 GB file, generated in host memory; its bf16 is 61 GB, more
#       than the 64 GB disk holds beside the build); FERRITE_BIN
#       picks the ferrite binary (default .gpu/ferrite); REPS (default 3).
#   bash scripts/bench_cuda_vs_llamacpp.sh all TARBALL     # build, then bench
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
version=0.3.36
work=${WORK:-/tmp/llama-cuda}
cases=${CASES:-"llama-3.1-8b:bf16 llama-3.1-8b:q4_0 llama-3.2-1b:bf16 llama-3.2-1b:q4_0"}
reps=${REPS:-3}

# The llama.cpp tree of the sdist, unpacked (fetched with pip when LLAMA_CPP_SDIST is unset).
sdist_tree() {
  local src=${LLAMA_CPP_SDIST:-}
  if [ -z "$src" ]; then
    local home=${LLAMA_CPP_HOME:-$HOME/.cache/ferrite/llama.cpp}
    src="$home/llama_cpp_python-$version.tar.gz"
    if [ ! -f "$src" ]; then
      mkdir -p "$home"
      python3 -m pip download -q --no-deps -d "$home" "llama-cpp-python==$version" >&2
    fi
  fi
  if [ -f "$src" ]; then
    local dir
    dir=$(mktemp -d)
    tar -xzf "$src" -C "$dir"
    src="$dir/llama_cpp_python-$version"
  fi
  [ -f "$src/vendor/llama.cpp/CMakeLists.txt" ] || { echo "no llama.cpp sources in $src" >&2; exit 1; }
  echo "$src/vendor/llama.cpp"
}

pack() {
  local out=${1:-$root/.gpu/llama-cpp-cuda-src.tar.gz}
  local tree stage
  tree=$(sdist_tree)
  stage=$(mktemp -d)
  mkdir -p "$stage/llama.cpp/tools"
  # The library, ggml (CPU + CUDA backends only), the common helpers llama-bench links,
  # the vendored headers, gguf-py, and the licences.
  for p in CMakeLists.txt cmake common ggml include src vendor gguf-py licenses LICENSE tools/llama-bench; do
    cp -a "$tree/$p" "$stage/llama.cpp/$p"
  done
  for d in "$stage"/llama.cpp/ggml/src/ggml-*/; do
    case "$(basename "$d")" in ggml-cuda | ggml-cpu) ;; *) rm -rf "$d" ;; esac
  done
  # tools/ holds only llama-bench now.
  printf '%s\n' '# trimmed by ferrite scripts/bench_cuda_vs_llamacpp.sh: llama-bench only' \
    'llama_add_compile_flags()' 'add_subdirectory(llama-bench)' > "$stage/llama.cpp/tools/CMakeLists.txt"
  mkdir -p "$(dirname "$out")"
  tar -czf "$out" -C "$stage" llama.cpp
  echo "packed $out ($(du -h "$out" | cut -f1)) from $tree"
  # The trimmed tree must still configure (CPU only here; the CUDA backend's sources are whole).
  if command -v cmake > /dev/null; then
    cmake -S "$stage/llama.cpp" -B "$stage/build" $(cmake_flags) -DGGML_CUDA=OFF -DGGML_NATIVE=OFF > "$stage/configure.log" 2>&1 ||
      { tail -20 "$stage/configure.log"; echo "the trimmed tree does not configure" >&2; exit 1; }
    echo "the trimmed tree configures (CPU-only check)"
  fi
  rm -rf "$stage"
}

cmake_flags() {
  echo -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF
}

build() {
  local tarball=${1:?usage: $0 build TARBALL}
  mkdir -p "$work"
  tar -xzf "$tarball" -C "$work"
  local nvcc=${CUDACXX:-/usr/local/cuda/bin/nvcc}
  cmake -S "$work/llama.cpp" -B "$work/build" $(cmake_flags) -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DCMAKE_CUDA_COMPILER="$nvcc" > "$work/configure.log" 2>&1 || { tail -30 "$work/configure.log"; exit 1; }
  cmake --build "$work/build" --config Release -j "$(nproc)" --target llama-bench > "$work/build.log" 2>&1 ||
    { tail -30 "$work/build.log"; exit 1; }
  echo "built $work/build/bin/llama-bench"
}

bench() {
  local llama=${LLAMA_BENCH:-$work/build/bin/llama-bench}
  local ferrite=${FERRITE_BIN:-$root/.gpu/ferrite}
  [ -x "$llama" ] || { echo "no llama-bench at $llama: run '$0 build TARBALL' first" >&2; exit 1; }
  [ -x "$ferrite" ] || { echo "no ferrite at $ferrite (set FERRITE_BIN)" >&2; exit 1; }
  export PYTHONPATH="$work/llama.cpp/gguf-py${PYTHONPATH:+:$PYTHONPATH}"
  mkdir -p "$work/gguf" "$work/results"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  for c in $cases; do
    local shape=${c%%:*} dtype=${c##*:}
    local gguf="$work/gguf/$shape-$dtype.gguf" tag="$shape-$dtype"
    [ -f "$gguf" ] || python3 "$root/scripts/random_gguf.py" "$shape" "$dtype" "$gguf"
    # llama.cpp: decode of 128 tokens after a 512-token context, and a 2,048-token prefill.
    "$llama" -m "$gguf" -ngl 99 -fa 1 -p 2048 -n 128 -d 0,512 -r "$reps" -o json > "$work/results/$tag.llama.json"
    "$ferrite" bench decode --synthetic "$shape" --dtype "$dtype" --prompt-tokens 512 --gen-tokens 128 \
      --reps "$reps" --json > "$work/results/$tag.decode.json"
    "$ferrite" bench decode --synthetic "$shape" --dtype "$dtype" --prompt-tokens 2048 --gen-tokens 2 \
      --reps "$reps" --json > "$work/results/$tag.prefill.json"
  done
  python3 - "$work/results" $cases <<'PY'
import json, sys
results, cases = sys.argv[1], sys.argv[2:]
last = lambda p: json.loads(open(p).read().strip().splitlines()[-1])
print(f"{'shape':14} {'dtype':6} {'test':22} {'llama.cpp':>10} {'ferrite':>10} {'ratio':>6}")
for c in cases:
    shape, dtype = c.split(":")
    tag = f"{results}/{shape}-{dtype}"
    llama = json.load(open(f"{tag}.llama.json"))
    # llama-bench -d 0,512: decode at depth 512, the 2,048-token prefill at depth 0.
    tg = next(r["avg_ts"] for r in llama if r["n_gen"] > 0 and r["n_depth"] == 512)
    pp = next(r["avg_ts"] for r in llama if r["n_prompt"] > 0 and r["n_depth"] == 0)
    dec, pre = last(f"{tag}.decode.json")["decode_tok_s"], last(f"{tag}.prefill.json")["prompt_tok_s"]
    for test, a, b in [("decode B=1 @ ctx 512", tg, dec), ("prefill 2048", pp, pre)]:
        print(f"{shape:14} {dtype:6} {test:22} {a:10.1f} {b:10.1f} {b / a:6.2f}")
PY
}

case "${1:-}" in
  pack) pack "${2:-}" ;;
  build) build "${2:-}" ;;
  bench) bench ;;
  all) build "${2:-}"; bench ;;
  *) sed -n '2,25p' "$0" >&2; exit 2 ;;
esac
