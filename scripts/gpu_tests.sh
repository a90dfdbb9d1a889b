#!/usr/bin/env bash
# The CUDA tests: built on a machine with Rust (no GPU needed), run on one with an NVIDIA GPU.
#
#   bash scripts/gpu_tests.sh build   # here: build the ferrite-runtime test binaries and copy
#                                     # the CUDA ones into .gpu/ (git-ignored)
#   bash scripts/gpu_tests.sh run     # there: run .gpu/cuda_* with FERRITE_TEST_CUDA=1 (CUDA op
#                                     # tests against the CPU ops, then the ceiling and baseline
#                                     # measurements), logs under $OUT (or /tmp), table last
#
# The binaries load the driver, NVRTC and cuBLASLt at run time; the first one to open the
# device compiles the kernels into a fresh $FERRITE_HOME/kernels, the later ones read them.
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
build)
    set -e
    log=$(mktemp)
    cargo test --release -p ferrite-runtime --no-run 2>&1 | tee "$log"
    rm -rf .gpu && mkdir -p .gpu
    # "Executable tests/cuda_ops.rs (target/release/deps/cuda_ops-0123abcd)"
    sed -n 's/.*Executable tests\/\(cuda_[a-z_]*\)\.rs (\(.*\))$/\1 \2/p' "$log" | while read -r name path; do
        cp "$path" ".gpu/$name"
    done
    rm -f "$log"
    ls -l .gpu
    ;;
run)
    out=${OUT:-/tmp/ferrite-gpu}
    mkdir -p "$out"
    export FERRITE_TEST_CUDA=1
    export FERRITE_HOME=${FERRITE_HOME:-$(mktemp -d)}
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true
    failed=()
    # Correctness first; the measurements last, on a warm device.
    for name in cuda_ops cuda_attention cuda_sampling cuda_ceiling; do
        [ -x ".gpu/$name" ] || { echo "missing .gpu/$name: run 'scripts/gpu_tests.sh build' first"; failed+=("$name"); continue; }
        echo "=== $name"
        start=$(date +%s%N)
        ".gpu/$name" --test-threads=1 --nocapture > "$out/$name.log" 2>&1
        rc=$?
        grep -E '^(test |SKIP|FAIL|.*: seed [0-9]+)' "$out/$name.log" | head -60
        grep -A2 'panicked at' "$out/$name.log" | head -12
        echo "$name: exit $rc in $(( ($(date +%s%N) - start) / 1000000 )) ms"
        [ "$rc" -eq 0 ] || failed+=("$name")
    done
    echo
    echo "=== summary (tolerance checks: max abs error, relative L2 error; measurements: medians)"
    table=$(grep -h '^TABLE|' "$out"/cuda_*.log | sed 's/^TABLE|//')
    if command -v column >/dev/null; then echo "$table" | column -t -s '|'; else echo "$table" | sed 's/|/   /g'; fi
    if [ ${#failed[@]} -gt 0 ]; then
        echo "FAILED: ${failed[*]}"
        exit 1
    fi
    echo "all CUDA tests passed"
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
