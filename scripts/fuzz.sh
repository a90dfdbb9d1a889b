#!/usr/bin/env bash
# Build the fuzz targets in fuzz/ (cargo-fuzz, libFuzzer) and run each for SECONDS (default
# 60), seeded from the test fixtures (scripts/fuzz_seeds.py); the corpora grow in
# fuzz/corpus/<target> across runs. Prints a table of inputs run per target; exits non-zero
# when a target crashed (the input is in fuzz/artifacts/<target>/, replay it with
# `cargo fuzz run --fuzz-dir fuzz TARGET FILE`).
#
# usage: bash scripts/fuzz.sh [SECONDS] [TARGET...]
#   FUZZ_SANITIZER=address  build with AddressSanitizer (default none: the code under test is
#                           safe Rust, and ASan doubles the build and run time)
# Needs cargo-fuzz (installed here with `cargo install cargo-fuzz` when missing) on the stable
# toolchain: RUSTC_BOOTSTRAP=1 lets stable rustc take the -Z flags libFuzzer builds use.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
export RUSTC_BOOTSTRAP=1
sanitizer=${FUZZ_SANITIZER:-none}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
python3 scripts/fuzz_seeds.py fuzz/corpus >/dev/null
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi
cargo fuzz build -O -a -s "$sanitizer" --fuzz-dir fuzz 2>&1 | tail -3
failed=0
summary=""
for t in "${targets[@]}"; do
    log=fuzz/artifacts/$t.log
    mkdir -p "fuzz/artifacts/$t"
    status=ok
    cargo fuzz run -O -a -s "$sanitizer" --fuzz-dir fuzz "$t" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -max_len=65536 -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
        >"$log" 2>&1 || { status=CRASH; failed=1; }
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    corpus=$(ls "fuzz/corpus/$t" | wc -l)
    summary+=$(printf '%-16s %12s inputs  %6s corpus  %s' "$t" "${runs:-?}" "$corpus" "$status")$'\n'
done
printf '%s' "$summary"
exit $failed
