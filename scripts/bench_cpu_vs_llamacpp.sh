#!/usr/bin/env bash
# ferrite vs llama.cpp on the CPU: the same GGUF file, thread count and lengths, back to back.
#
#   scripts/bench_cpu_vs_llamacpp.sh MODEL [--threads 2] [--prompt 512] [--gen 128] [--reps 3]
#
# MODEL is a named model (smollm2, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, ...; fetched with
# `ferrite pull`) or a .gguf path. Three tests, each reported by both tools in tokens/s:
#   ppP      prompt processing of P tokens     llama-bench -p P        ferrite prompt_tok_s
#   tgG      G decode steps from an empty      llama-bench -n G        ferrite decode_tok_s
#            context                                                   with a 1-token prompt
#   tgG@dP   G decode steps after P tokens     llama-bench -n G -d P   ferrite decode_tok_s
#            of context                                                with a P-token prompt
# (`ferrite bench decode` reports decode after its prompt, so tgG@dP is its headline number;
# llama-bench's default tgG starts from an empty KV cache.) The table shows both tools, the
# ratio ferrite / llama.cpp, and the load average before and after: other work on the machine
# skews both tools (llama.cpp's spinning threads suffer most), so re-run on a quiet machine.
#
# llama.cpp's llama-bench comes from scripts/bench_llamacpp.sh, built once outside the
# repository (set LLAMA_CPP_BUILD to reuse an existing build directory). FERRITE_BIN picks a
# ferrite binary (default: `cargo build --release` and target/release/ferrite).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
usage() {
  echo "usage: $0 MODEL [--threads N] [--prompt N] [--gen N] [--reps N]" >&2
  exit 2
}
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

if [ -z "${FERRITE_BIN:-}" ]; then
  (cd "$root" && cargo build --release --bin ferrite >&2)
  FERRITE_BIN="$root/target/release/ferrite"
fi
if [ -f "$model" ]; then
  path="$model"
else
  path="$("$FERRITE_BIN" pull "$model")"
fi

# The same defaults as scripts/bench_llamacpp.sh, to find the llama-bench it builds.
FERRITE_HOME="${FERRITE_HOME:-$HOME/.cache/ferrite}"
LLAMA_CPP_HOME="${LLAMA_CPP_HOME:-$FERRITE_HOME/llama.cpp}"
export LLAMA_CPP_BUILD="${LLAMA_CPP_BUILD:-$LLAMA_CPP_HOME/build}"

load_before="$(cut -d' ' -f1-3 /proc/loadavg)"
llama="$("$root/scripts/bench_llamacpp.sh" "$path" --threads "$threads" --prompt "$prompt" --gen "$gen" --reps "$reps")"
llama_depth="$("$LLAMA_CPP_BUILD/bin/llama-bench" -m "$path" -t "$threads" -p 0 -n "$gen" -d "$prompt" -r "$reps" -o json)"
ferrite="$("$FERRITE_BIN" bench decode "$path" --threads "$threads" --prompt-tokens "$prompt" --gen-tokens "$gen" --reps "$reps" --json)"
ferrite_empty="$("$FERRITE_BIN" bench decode "$path" --threads "$threads" --prompt-tokens 1 --gen-tokens "$gen" --reps "$reps" --json)"
load_after="$(cut -d' ' -f1-3 /proc/loadavg)"

python3 - "$llama" "$llama_depth" "$ferrite" "$ferrite_empty" "$prompt" "$gen" "$threads" "$path" "$load_before" "$load_after" <<'EOF'
import json, os, sys
llama, llama_depth, fer, fer_empty = (json.loads(a) for a in sys.argv[1:5])
prompt, gen, threads, path, before, after = sys.argv[5:11]
depth = next(r["avg_ts"] for r in llama_depth if r["n_gen"] > 0)
rows = [
    (f"pp{prompt}", fer["prompt_tok_s"], llama[f"pp{prompt}"]["avg_ts"]),
    (f"tg{gen}", fer_empty["decode_tok_s"], llama[f"tg{gen}"]["avg_ts"]),
    (f"tg{gen}@d{prompt}", fer["decode_tok_s"], depth),
]
print(f"{os.path.basename(path)}, {threads} threads, load average {before} -> {after}")
print(f"{'test':<14}{'ferrite':>10}{'llama.cpp':>11}{'ratio':>8}")
for name, f, l in rows:
    print(f"{name:<14}{f:>10.1f}{l:>11.1f}{f / l:>7.2f}x")
print(json.dumps({"model": os.path.basename(path), "threads": int(threads), "load_before": before,
                  "load_after": after, "tests": {n: {"ferrite": round(f, 2), "llama_cpp": round(l, 2)}
                                                  for n, f, l in rows}}))
EOF
