#!/usr/bin/env bash
# Serving benchmark, ferrite against llama.cpp's llama-server on the same GGUF and threads, both
# driven by the same harness (`ferrite bench serve`: streaming /v1/completions, random-word
# prompts sized with each server's /tokenize, ignore_eos, greedy), plus the HTTP overhead of a
# single request against `ferrite bench throughput --concurrency 1` in-process.
#
#   scripts/bench_serve_vs_llamacpp.sh [--threads 2] [--concurrency "1 8 32"] [--input-len 256]
#                                      [--output-len 128] [--requests-per-client 3] [--overhead-rounds 9]
#                                      [--overhead-requests 3] [--only ferrite|llama]
#
# What it does:
#   1. Builds `ferrite` (cargo build --release) unless $FERRITE_BIN is set, pulls smollm2.
#   2. If $LLAMA_CPP_BUILD/bin/llama-server is missing, builds it from the llama-cpp-python sdist
#      the same way scripts/bench_llamacpp.sh builds llama-bench (outside the repository).
#   3. Starts both servers on free ports of 127.0.0.1 (ferrite: `serve smollm2 --threads T`;
#      llama-server: `-t T -np MAXC -c MAXC*1024`), waits for /health, then at each concurrency
#      C runs `ferrite bench serve --json` with max(8, C × requests-per-client) requests against
#      one and then the other, and stops them.
#   4. Server overhead: --overhead-rounds rounds, each --overhead-requests sequential requests
#      through HTTP (`bench serve --concurrency 1` against the ferrite server) followed at once
#      by the same workload in-process (`bench throughput --concurrency 1`: same engine
#      settings, prompt and output lengths, greedy, EOS ignored). Decode tok/s is 1000 / TPOT
#      p50 on both sides; the overhead is the median of the per-round ratios (short pairs run
#      back to back, so a change in the machine's load hits both alike).
#   5. Prints a Markdown table; the raw JSON lines go to $OUT (default
#      $FERRITE_HOME/bench-serve-vs-llamacpp.jsonl).
#
# $LLAMA_ARGS adds llama-server flags, e.g. --no-kv-unified (one KV stream per slot instead of
# the default single cache shared by all slots, which slows it sharply at high concurrency).
#
# Run it on a quiet machine: it prints `uptime` first, and the numbers mean little under load.
set -euo pipefail
cd "$(dirname "$0")/.."

FERRITE_HOME="${FERRITE_HOME:-$HOME/.cache/ferrite}"
LLAMA_CPP_PY_VERSION=0.3.36
LLAMA_CPP_HOME="${LLAMA_CPP_HOME:-$FERRITE_HOME/llama.cpp}"
LLAMA_CPP_BUILD="${LLAMA_CPP_BUILD:-$LLAMA_CPP_HOME/build}"
OUT="${OUT:-$FERRITE_HOME/bench-serve-vs-llamacpp.jsonl}"
GGUF="$FERRITE_HOME/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

threads=2
levels="1 8 32"
input_len=256
output_len=128
per_client=3
overhead_rounds=9
overhead_requests=3
only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads="${2:?}"; shift 2 ;;
    --concurrency) levels="${2:?}"; shift 2 ;;
    --input-len) input_len="${2:?}"; shift 2 ;;
    --output-len) output_len="${2:?}"; shift 2 ;;
    --requests-per-client) per_client="${2:?}"; shift 2 ;;
    --overhead-rounds) overhead_rounds="${2:?}"; shift 2 ;;
    --overhead-requests) overhead_requests="${2:?}"; shift 2 ;;
    --only) only="${2:?}"; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
maxc=$(printf '%s\n' $levels | sort -n | tail -1)

# ---- 1. ferrite -------------------------------------------------------------------------------
if [ -z "${FERRITE_BIN:-}" ]; then
  cargo build --release --bin ferrite >&2
  FERRITE_BIN=target/release/ferrite
fi
"$FERRITE_BIN" pull smollm2 >&2

# ---- 2. llama-server (once) --------------------------------------------------------------------
server="$LLAMA_CPP_BUILD/bin/llama-server"
if [ "$only" != ferrite ] && [ ! -x "$server" ]; then
  src="$LLAMA_CPP_HOME/llama_cpp_python-$LLAMA_CPP_PY_VERSION/vendor/llama.cpp"
  if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$LLAMA_CPP_HOME"
    python3 -m pip download -q --no-deps --no-binary :all: -d "$LLAMA_CPP_HOME" \
      "llama-cpp-python==$LLAMA_CPP_PY_VERSION"
    tar -xzf "$LLAMA_CPP_HOME/llama_cpp_python-$LLAMA_CPP_PY_VERSION.tar.gz" -C "$LLAMA_CPP_HOME"
  fi
  command -v cmake >/dev/null || { echo "cmake is required (e.g. apt-get install cmake)" >&2; exit 1; }
  cmake -S "$src" -B "$LLAMA_CPP_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
  nice -n 10 cmake --build "$LLAMA_CPP_BUILD" --config Release -j "$(nproc)" --target llama-server >&2
fi

# ---- 3. the runs ------------------------------------------------------------------------------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_health() { # url pid
  for _ in $(seq 1 600); do
    kill -0 "$2" 2>/dev/null || { echo "the server exited early" >&2; return 1; }
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1/health")" = 200 ] && return 0
    sleep 0.5
  done
  echo "the server at $1 never became healthy" >&2
  return 1
}
stop_servers() {
  for p in $fpid $lpid; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  fpid="" lpid=""
}
trap stop_servers EXIT

echo "load before: $(uptime)" >&2
: > "$OUT"
label() { # engine [round]: tag the JSON object on stdin
  python3 -c 'import json,sys; d=json.load(sys.stdin); d["engine"]=sys.argv[1]; d["round"]=int(sys.argv[2]); print(json.dumps(d))' "$@"
}
run_level() { # engine url concurrency [round requests]
  local n=${5:-$(( $3 * per_client > 8 ? $3 * per_client : 8 ))}
  echo "$1: concurrency $3, $n requests ($(cut -d' ' -f1-3 /proc/loadavg))" >&2
  "$FERRITE_BIN" bench serve --url "$2" --num-requests "$n" --input-len "$input_len" \
    --output-len "$output_len" --concurrency "$3" --json | label "$1" "${4:-0}" >> "$OUT"
}
run_in_process() { # round
  echo "ferrite in-process: concurrency 1, $overhead_requests requests ($(cut -d' ' -f1-3 /proc/loadavg))" >&2
  "$FERRITE_BIN" bench throughput smollm2 --threads "$threads" --num-requests "$overhead_requests" --input-len "$input_len" \
    --output-len "$output_len" --concurrency 1 --json | label ferrite-in-process "$1" >> "$OUT"
}

# Both servers stay up and the levels alternate between them, so a change in the machine's load
# hits both alike.
fpid="" lpid=""
if [ "$only" != llama ]; then
  fport=$(free_port)
  "$FERRITE_BIN" serve smollm2 --threads "$threads" --host 127.0.0.1 --port "$fport" 2>/dev/null &
  fpid=$!
  wait_health "http://127.0.0.1:$fport" "$fpid"
fi
if [ "$only" != ferrite ]; then
  lport=$(free_port)
  LD_LIBRARY_PATH="$LLAMA_CPP_BUILD/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$server" -m "$GGUF" -t "$threads" \
    --host 127.0.0.1 --port "$lport" -np "$maxc" -c $(( maxc * 1024 )) --log-disable ${LLAMA_ARGS:-} >/dev/null 2>&1 &
  lpid=$!
  wait_health "http://127.0.0.1:$lport" "$lpid"
fi
for c in $levels; do
  if [ -n "$fpid" ]; then run_level ferrite "http://127.0.0.1:$fport" "$c"; fi
  if [ -n "$lpid" ]; then run_level llama-server "http://127.0.0.1:$lport" "$c"; fi
done

# ---- 4. server overhead: single request through HTTP vs in-process, back to back ---------------
if [ -n "$fpid" ]; then
  for r in $(seq 1 "$overhead_rounds"); do
    run_level ferrite-http-overhead "http://127.0.0.1:$fport" 1 "$r" "$overhead_requests"
    run_in_process "$r"
  done
fi
stop_servers
echo "load after: $(uptime)" >&2

# ---- 5. the table -----------------------------------------------------------------------------
python3 - "$OUT" "$threads" "$input_len" "$output_len" <<'EOF'
import json, statistics, sys
path, threads, inp, outp = sys.argv[1:]
rows = [json.loads(l) for l in open(path) if l.strip()]
print(f"smollm2 Q4_1, {threads} threads, {inp} prompt tokens / {outp} output tokens, streaming /v1/completions\n")
print("| server | conc | requests | errors | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    if r["engine"] not in ("ferrite", "llama-server"):
        continue
    print(f"| {r['engine']} | {r['concurrency']} | {r['num_requests']} | {r['errors']} | {r['request_s']:.2f} | "
          f"{r['output_tok_s']:.1f} | {r['ttft_ms_p50']:.0f} | {r['ttft_ms_p99']:.0f} | {r['tpot_ms_p50']:.1f} | "
          f"{r['tpot_ms_p99']:.1f} | {r['itl_ms_p99']:.1f} |")
rate = lambda r: 1000 / r["tpot_ms_p50"]  # noqa: E731 - decode tok/s of the median request
http = {r["round"]: rate(r) for r in rows if r["engine"] == "ferrite-http-overhead"}
inproc = {r["round"]: rate(r) for r in rows if r["engine"] == "ferrite-in-process"}
pairs = [(http[k], inproc[k]) for k in sorted(http) if k in inproc]
if pairs:
    print("\nsingle-request decode tok/s (1000 / TPOT p50), HTTP vs in-process, back to back:\n")
    print("| round | HTTP | in-process | HTTP / in-process |")
    print("|---:|---:|---:|---:|")
    for k, (h, i) in enumerate(pairs, 1):
        print(f"| {k} | {h:.1f} | {i:.1f} | {100 * h / i:.1f} % |")
    print(f"\nmedian ratio {100 * statistics.median(h / i for h, i in pairs):.1f} % (floor 95 %)")
EOF
