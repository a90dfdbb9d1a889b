#!/usr/bin/env bash
# Reference throughput from llama.cpp's `llama-bench`, for comparing ferrite against it on the
# same GGUF file, thread count and prompt/generation lengths.
#
#   scripts/bench_llamacpp.sh MODEL.gguf [--threads 2] [--prompt 512] [--gen 128] [--reps 3]
#
# What it does:
#   1. If $LLAMA_CPP_BUILD/bin/llama-bench is missing, downloads the llama-cpp-python==0.3.36
#      sdist (which vendors llama.cpp) with pip, extracts it, and builds llama-bench with CMake:
#      Release, CPU backend only, GGML_NATIVE=ON (-march=native), no CURL. Everything lives in
#      $LLAMA_CPP_HOME (default: ${FERRITE_HOME:-$HOME/.cache/ferrite}/llama.cpp), OUTSIDE the
#      repository: no llama.cpp source or binary ever enters ferrite.
#   2. Runs `llama-bench -m MODEL -t THREADS -p PROMPT -n GEN -r REPS -o json` and prints one
#      line of JSON: prompt-processing (ppPROMPT) and decode (tgGEN) tokens/s, avg and stddev
#      over the repetitions as reported by llama-bench. The raw llama-bench JSON is kept in
#      $LLAMA_CPP_HOME/last-bench.json.
#
# Environment overrides:
#   LLAMA_CPP_HOME   cache dir for the sdist and the build   (default above)
#   LLAMA_CPP_BUILD  CMake build dir                         (default $LLAMA_CPP_HOME/build)
#   LLAMA_CPP_JOBS   parallel compile jobs                   (default: nproc)
#
# Needs: python3 with pip, cmake, a C/C++ compiler. The build takes ~10+ minutes on 2 cores.
set -euo pipefail

LLAMA_CPP_PY_VERSION=0.3.36
FERRITE_HOME="${FERRITE_HOME:-$HOME/.cache/ferrite}"
LLAMA_CPP_HOME="${LLAMA_CPP_HOME:-$FERRITE_HOME/llama.cpp}"
LLAMA_CPP_BUILD="${LLAMA_CPP_BUILD:-$LLAMA_CPP_HOME/build}"
LLAMA_CPP_JOBS="${LLAMA_CPP_JOBS:-$(nproc)}"

usage() {
  echo "usage: $0 MODEL.gguf [--threads N] [--prompt N] [--gen N] [--reps N]" >&2
  exit 2
}

# ---- arguments ------------------------------------------------------------------------------
[ $# -ge 1 ] || usage
model="$1"
shift
threads=2
prompt=512
gen=128
reps=3
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads="${2:?}"; shift 2 ;;
    --prompt)  prompt="${2:?}";  shift 2 ;;
    --gen)     gen="${2:?}";     shift 2 ;;
    --reps)    reps="${2:?}";    shift 2 ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
[ -f "$model" ] || { echo "model not found: $model" >&2; exit 1; }

# ---- 1. build llama-bench (once) ------------------------------------------------------------
bench="$LLAMA_CPP_BUILD/bin/llama-bench"
if [ ! -x "$bench" ]; then
  src="$LLAMA_CPP_HOME/llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    echo "fetching llama-cpp-python==$LLAMA_CPP_PY_VERSION sdist into $LLAMA_CPP_HOME" >&2
    mkdir -p "$LLAMA_CPP_HOME"
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d "$LLAMA_CPP_HOME" \
      "llama-cpp-python==$LLAMA_CPP_PY_VERSION"
    tar -xzf "$LLAMA_CPP_HOME/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz" -C "$LLAMA_CPP_HOME"
  fi
  command -v cmake >/dev/null || { echo "cmake is required (e.g. apt-get install cmake)" >&2; exit 1; }
  echo "building llama-bench in $LLAMA_CPP_BUILD (takes a while)" >&2
  # LLAMA_CURL=OFF: no model downloading; newer llama.cpp ignores the flag (harmless warning).
  cmake -S "$src" -B "$LLAMA_CPP_BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  nice -n 10 cmake --build "$LLAMA_CPP_BUILD" --config Release -j "$LLAMA_CPP_JOBS" \
    --target llama-bench >&2
fi

# ---- 2. benchmark ---------------------------------------------------------------------------
mkdir -p "$LLAMA_CPP_HOME"
raw="$LLAMA_CPP_HOME/last-bench.json"
"$bench" -m "$model" -t "$threads" -p "$prompt" -n "$gen" -r "$reps" -o json > "$raw"

# llama-bench emits one record per test: a prompt test (n_prompt>0, n_gen=0) and a decode test
# (n_prompt=0, n_gen>0). Summarise them on one line.
python3 - "$raw" "$model" <<'EOF'
import json, os, sys
raw, model = sys.argv[1], sys.argv[2]
records = json.load(open(raw))
out = {"engine": "llama.cpp", "model": os.path.basename(model)}
for r in records:
    if r["n_prompt"] > 0 and r["n_gen"] == 0:
        key = f"pp{r['n_prompt']}"
    elif r["n_gen"] > 0 and r["n_prompt"] == 0:
        key = f"tg{r['n_gen']}"
    else:
        key = f"pp{r['n_prompt']}+tg{r['n_gen']}"
    out[key] = {"avg_ts": round(r["avg_ts"], 2), "stddev_ts": round(r["stddev_ts"], 2)}
first = records[0]
out.update({
    "threads": first.get("n_threads"),
    "reps": len(first.get("samples_ts", [])),
    "model_type": first.get("model_type"),
    "build_commit": first.get("build_commit"),
    "cpu_info": first.get("cpu_info"),
})
print(json.dumps(out))
EOF
