#!/usr/bin/env bash
# Two ferrite binaries side by side on the GPU, in one run: B=1 decode of the synthetic
# llama-3.1-8b, llama-3.2-1b and gemma-4-e4b (bf16, 512-token prompt, 128 tokens) and the
# 128-in/128-out throughput of the 8B, each measurement alternating the binaries for ROUNDS
# rounds. Prints one line per (binary, measurement, round) and a median table.
#
#   bash scripts/bench_cuda_ab.sh OLD_BINARY NEW_BINARY [ROUNDS]
set -uo pipefail
old=$1 new=$2 rounds=${3:-2}
export FERRITE_HOME=${FERRITE_HOME:-$(mktemp -d)}
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
out=$(mktemp)
run() { # label binary args...
    local label=$1 bin=$2
    shift 2
    local line
    line=$(timeout 200 "$bin" "$@" --json 2>/dev/null | tail -1)
    echo "$label $line"
    echo "$label $line" >> "$out"
}
for r in $(seq 1 "$rounds"); do
    for which in old new; do
        bin=$old
        [ "$which" = new ] && bin=$new
        for m in llama-3.1-8b llama-3.2-1b gemma-4-e4b; do
            run "$which decode-$m" "$bin" bench decode --synthetic "$m" --dtype bf16 --prompt-tokens 512 --gen-tokens 128 --reps 3
        done
        run "$which throughput-8b" "$bin" bench throughput --synthetic llama-3.1-8b --dtype bf16 --num-requests 768 \
            --input-len 128 --output-len 128 --concurrency 256 --max-num-seqs 256 --max-num-batched-tokens 8192 \
            --max-model-len 512
    done
done
python3 - "$out" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    which, what, js = line.split(" ", 2)
    try:
        r = json.loads(js)
    except ValueError:
        continue
    key = "decode_tok_s" if what.startswith("decode") else "output_tok_s"
    rows.setdefault(what, {}).setdefault(which, []).append(r.get(key, float("nan")))
print(f"{'measurement':<28}{'old (median)':>14}{'new (median)':>14}{'new/old':>9}")
for what, v in rows.items():
    o, n = statistics.median(v.get("old", [float("nan")])), statistics.median(v.get("new", [float("nan")]))
    print(f"{what:<28}{o:>14.1f}{n:>14.1f}{n / o:>9.3f}")
PY
