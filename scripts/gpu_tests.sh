#!/usr/bin/env bash
# The CUDA tests: built on a machine with Rust (no GPU needed), run on one with an NVIDIA GPU.
#
#   bash scripts/gpu_tests.sh build   # here: build the CUDA test binaries (ferrite-runtime ops,
#                                     # ferrite-engine's cuda_model, cuda_goldens, cuda_lora, ...) and the ferrite binary, and
#                                     # copy them into .gpu/ (git-ignored)
#   bash scripts/gpu_tests.sh run     # there: run .gpu/cuda_* with FERRITE_TEST_CUDA=1 (CUDA op
#                                     # and quantized-kernel tests against the CPU ops, the
#                                     # model against the CPU model and against transformers
#                                     # (scripts/hf_cuda_parity.py, when python3 has torch and
#                                     # transformers), the engine invariants on the GPU, then
#                                     # the ceiling and baseline measurements), logs under $OUT
#                                     # (or /tmp), table last
#   bash scripts/gpu_tests.sh bench   # there: `ferrite bench` on synthetic models (decode at
#                                     # B=1 greedy and sampled, 2,048-token prefill, throughput,
#                                     # start-up, the prefix cache's tiers), table last
#   bash scripts/gpu_tests.sh all     # there: run, then bench
#   bash scripts/gpu_tests.sh moe     # there: the mixture-of-experts tests (cuda_moe,
#                                     # cuda_goldens) and benches (qwen3-30b-a3b and
#                                     # gemma-4-26b-a4b, bf16 and Q4_K) alone
#
# The binaries load the driver, NVRTC and cuBLASLt at run time; the first one to open the
# device compiles the kernels into a fresh $FERRITE_HOME/kernels, the later ones read them.
set -uo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
build)
    set -e
    log=$(mktemp)
    # The whole workspace's test binaries, as the CPU suite builds them: selecting packages
    # with -p unifies features differently and rebuilds the dependencies.
    cargo test --release --workspace --no-run 2>&1 | tee "$log"
    cargo build --release --bin ferrite
    rm -rf .gpu && mkdir -p .gpu
    cp target/release/ferrite .gpu/ferrite
    # "Executable tests/cuda_ops.rs (target/release/deps/cuda_ops-0123abcd)"
    sed -n 's/.*Executable tests\/\(cuda_[a-z0-9_]*\)\.rs (\(.*\))$/\1 \2/p' "$log" | while read -r name path; do
        cp "$path" ".gpu/$name"
    done
    rm -f "$log"
    # The vocabularies and chat templates synthetic models take (scripts/fetch_test_assets.sh).
    assets=${FERRITE_TEST_ASSETS:-${FERRITE_HOME:-$HOME/.cache/ferrite}/test-assets}/llama.cpp-models
    mkdir -p .gpu/assets/llama.cpp-models/templates
    for f in ggml-vocab-llama-bpe.gguf ggml-vocab-qwen2.gguf ggml-vocab-gemma-4.gguf; do
        cp "$assets/$f" .gpu/assets/llama.cpp-models/
    done
    for t in meta-llama-Llama-3.1-8B-Instruct meta-llama-Llama-3.2-3B-Instruct Qwen-Qwen2.5-7B-Instruct google-gemma-4-31B-it; do
        cp "$assets/templates/$t.jinja" .gpu/assets/llama.cpp-models/templates/
    done
    ls -l .gpu
    ;;
run | bench | all | moe)
    out=${OUT:-/tmp/ferrite-gpu}
    mkdir -p "$out"
    export FERRITE_TEST_CUDA=1
    export FERRITE_HOME=${FERRITE_HOME:-$(mktemp -d)}
    [ -d .gpu/assets ] && export FERRITE_TEST_ASSETS=$PWD/.gpu/assets
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true
    failed=()
    tests=(cuda_ops cuda_layer_ops cuda_memory cuda_quant cuda_moe cuda_deltanet cuda_attention cuda_kv_quant cuda_sampling
           cuda_lora_ops cuda_fp8 cuda_model cuda_goldens cuda_verify cuda_hybrid cuda_kv_quant_model
           cuda_lora cuda_tiers cuda_ceiling)
    [ "$1" = bench ] && tests=()
    [ "$1" = moe ] && tests=(cuda_moe cuda_goldens)
    # cuda_model's comparison with Hugging Face transformers needs their reference, made here
    # (a 1B-class random llama and transformers' log-probabilities; ~30 s, 2.5 GB of disk).
    if [ ${#tests[@]} -gt 0 ] && python3 -c 'import torch, transformers' 2>/dev/null; then
        hf_dir=$(mktemp -d)
        if python3 scripts/hf_cuda_parity.py "$hf_dir" > "$out/hf_reference.log" 2>&1; then
            export FERRITE_HF_REFERENCE=$hf_dir
        else
            tail -5 "$out/hf_reference.log"
            failed+=("hf_cuda_parity.py")
        fi
    fi
    # Correctness first; the measurements last, on a warm device.
    for name in "${tests[@]}"; do
        [ -x ".gpu/$name" ] || { echo "missing .gpu/$name: run 'scripts/gpu_tests.sh build' first"; failed+=("$name"); continue; }
        echo "=== $name"
        start=$(date +%s%N)
        timeout 240 ".gpu/$name" --test-threads=1 --nocapture > "$out/$name.log" 2>&1
        rc=$?
        grep -E '^(test |SKIP|FAIL|.*: seed [0-9]+)' "$out/$name.log" | head -60
        grep -A2 'panicked at' "$out/$name.log" | head -12
        echo "$name: exit $rc in $(( ($(date +%s%N) - start) / 1000000 )) ms"
        [ "$rc" -eq 0 ] || failed+=("$name")
    done
    if [ "$1" != run ]; then
        # Each bench prints one JSON line; the table keeps the headline numbers.
        bench() {
            local label=$1
            shift
            echo "=== bench $label: ferrite $*"
            if timeout "${BENCH_TIMEOUT:-150}" .gpu/ferrite "$@" --json > "$out/bench_$label.json" 2> "$out/bench_$label.err"; then
                python3 - "$label" "$out/bench_$label.json" >> "$out/bench.table" <<'PY'
import json, sys
label, path = sys.argv[1], sys.argv[2]
r = json.loads(open(path).read().strip().splitlines()[-1])
keys = ["prompt_tok_s", "decode_tok_s", "output_tok_s", "total_tok_s", "tpot_ms_p50", "ttft_ms_p50", "load_ms", "ready_ms",
        "weight_bytes", "kv_bytes_per_token", "ttft_ms_pool", "ttft_ms_host", "ttft_ms_ssd", "ttft_ms_ssd_disk", "ttft_ms_cold",
        "ssd_write_mb_per_s", "decode_busy_over_idle", "base_output_tok_s", "lora_ratio"]
fmt = lambda k: f"{k} {r[k]:.3f}" if k.endswith("ratio") else f"{k} {r[k]:.1f}"
print("TABLE|bench " + label + "|" + "|".join(fmt(k) for k in keys if r.get(k) is not None))
PY
                cat "$out/bench_$label.json"
            else
                tail -5 "$out/bench_$label.err"
                failed+=("bench $label")
            fi
        }
        # HTTP serving: `ferrite serve` on a synthetic model (its family's tokenizer) under
        # `ferrite bench serve` (streaming completions, EOS ignored).
        serve_bench() {
            local label=$1 model=$2
            shift 2
            local log="$out/serve_$label.log"
            .gpu/ferrite serve --synthetic "$model" --port 0 --max-num-seqs 256 > "$log" 2>&1 &
            local pid=$! url=
            for _ in $(seq 240); do
                url=$(grep -oE 'listening on http://[0-9.:]+' "$log" | head -1 | sed 's/listening on //') || true
                [ -n "$url" ] && break
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.5
            done
            if [ -n "$url" ]; then bench "$label" bench serve --url "$url" "$@"; else tail -5 "$log"; failed+=("serve $label"); fi
            kill "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
        }
        # Mixtures of experts: B=1 decode, a 2,048-token prefill and max-load throughput (128/128
        # and 1,000/1,000) of Qwen3-30B-A3B in bf16 and Q4_K; Gemma 4 26B-A4B decode; Qwen3-30B-A3B
        # decode and prefill in MLX 4-bit and in FP8.
        moe_benches() {
            local d sq
            for d in bf16 q4_k; do
                sq=(--synthetic qwen3-30b-a3b --dtype "$d")
                bench "decode-qwen3-30b-a3b-$d" bench decode "${sq[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3
                bench "prefill-qwen3-30b-a3b-$d" bench decode "${sq[@]}" --prompt-tokens 2048 --gen-tokens 2 --reps 3
                BENCH_TIMEOUT=600 bench "throughput-qwen3-30b-a3b-$d-128" bench throughput "${sq[@]}" \
                    --num-requests 768 --input-len 128 --output-len 128 --concurrency 256 --max-num-seqs 256 \
                    --max-num-batched-tokens 8192 --max-model-len 512
                BENCH_TIMEOUT=600 bench "throughput-qwen3-30b-a3b-$d-1000" bench throughput "${sq[@]}" \
                    --num-requests 256 --input-len 1000 --output-len 1000 --concurrency 256 --max-num-seqs 256 \
                    --max-num-batched-tokens 8192 --max-model-len 2048
                bench "decode-gemma-4-26b-a4b-$d" bench decode --synthetic gemma-4-26b-a4b --dtype "$d" \
                    --prompt-tokens 512 --gen-tokens 128 --reps 3
            done
            # MLX 4-bit experts (the experts' kernels of the mlx4 module): B=1 decode and a prefill.
            sq=(--synthetic qwen3-30b-a3b --dtype mlx4)
            bench decode-qwen3-30b-a3b-mlx4 bench decode "${sq[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3
            bench prefill-qwen3-30b-a3b-mlx4 bench decode "${sq[@]}" --prompt-tokens 2048 --gen-tokens 2 --reps 3
            # FP8 experts and attention (the experts' kernels of the moe_fp8 module, a scale a row):
            # B=1 decode and a prefill.
            sq=(--synthetic qwen3-30b-a3b --dtype fp8)
            bench decode-qwen3-30b-a3b-fp8 bench decode "${sq[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3
            bench prefill-qwen3-30b-a3b-fp8 bench decode "${sq[@]}" --prompt-tokens 2048 --gen-tokens 2 --reps 3
        }
        if [ "$1" = moe ]; then
            moe_benches
        else
            s8=(--synthetic llama-3.1-8b --dtype bf16)
            s1=(--synthetic llama-3.2-1b --dtype bf16)
            # The first start compiles the kernels into $FERRITE_HOME; every later one reads them.
            bench decode-8b bench decode "${s8[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3
            bench decode-1b bench decode "${s1[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3
            # The same with each step waited for before the next is scheduled (no overlap).
            bench decode-1b-no-overlap bench decode "${s1[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3 --no-overlap
            bench decode-8b-no-overlap bench decode "${s8[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3 --no-overlap
            # And with every kernel launched fully serialized (no programmatic dependent launch).
            FERRITE_PDL=0 bench decode-1b-no-pdl bench decode "${s1[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3
            FERRITE_PDL=0 bench decode-8b-no-pdl bench decode "${s8[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3
            bench decode-8b-q4_0 bench decode --synthetic llama-3.1-8b --dtype q4_0 --prompt-tokens 512 --gen-tokens 128 \
                --reps 3
            # MLX affine 4- and 8-bit groups of 64 (bf16 scales), as the mlx-community checkpoints hold them.
            bench decode-8b-mlx4 bench decode --synthetic llama-3.1-8b --dtype mlx4 --prompt-tokens 512 --gen-tokens 128 \
                --reps 3
            bench decode-8b-mlx8 bench decode --synthetic llama-3.1-8b --dtype mlx8 --prompt-tokens 512 --gen-tokens 128 \
                --reps 3
            bench prefill-8b-mlx4 bench decode --synthetic llama-3.1-8b --dtype mlx4 --prompt-tokens 2048 --gen-tokens 2 \
                --reps 3
            # Seeded sampling drawn on the device (only ids come back), against the greedy line.
            bench decode-1b-sampled bench decode "${s1[@]}" --prompt-tokens 512 --gen-tokens 128 --reps 3 \
                --temperature 0.8 --top-p 0.9
            bench prefill-8b bench decode "${s8[@]}" --prompt-tokens 2048 --gen-tokens 2 --reps 3
            # B=1 decode at a 32k context per KV cache dtype (bf16 first: the baseline).
            for kv in bf16 int8 int4 fp8; do
                bench "decode-8b-32k-$kv" bench decode "${s8[@]}" --prompt-tokens 32768 --prefill-chunk 8192 \
                    --gen-tokens 128 --reps 2 --kv-cache-dtype "$kv"
            done
            bench throughput-8b bench throughput "${s8[@]}" --num-requests 768 --input-len 128 --output-len 128 \
                --concurrency 256 --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 512
            bench throughput-8b-no-overlap bench throughput "${s8[@]}" --num-requests 768 --input-len 128 \
                --output-len 128 --concurrency 256 --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 512 \
                --no-overlap
            # Multi-LoRA: 64 concurrent rows over 4 synthetic rank-16 adapters (all 7 projections)
            # against the base alone on the same engine (goal: lora_ratio >= 0.85).
            bench throughput-8b-lora4 bench throughput "${s8[@]}" --num-requests 256 --input-len 128 --output-len 128 \
                --concurrency 64 --max-num-seqs 64 --max-num-batched-tokens 8192 --max-model-len 512 --lora 4
            bench decode-qwen bench decode --synthetic qwen2.5-1.5b --prompt-tokens 512 --gen-tokens 64 --reps 2
            bench decode-smollm bench decode --synthetic smollm2-135m --prompt-tokens 512 --gen-tokens 64 --reps 2
            bench decode-gemma4-e4b bench decode --synthetic gemma-4-e4b --dtype bf16 --prompt-tokens 512 --gen-tokens 128 \
                --reps 3
            # The prefix cache's tiers (pool, host RAM, SSD under $TMPDIR, cold), resume, writer.
            BENCH_TIMEOUT=600 bench tiers-8b-8k bench tiers "${s8[@]}" --prefix-len 8192 --reps 2
            BENCH_TIMEOUT=600 bench tiers-8b-32k bench tiers "${s8[@]}" --prefix-len 32768 --reps 1
            serve_bench serve-8b-c64 llama-3.1-8b --concurrency 64 --num-requests 256 --input-len 128 --output-len 128
            serve_bench serve-1b-c256 llama-3.2-1b --concurrency 256 --num-requests 1024 --input-len 128 --output-len 128
            moe_benches
        fi
    fi
    echo
    echo "=== summary (tolerance checks: max abs error, relative L2 error; measurements: medians)"
    table=$(cat "$out"/cuda_*.log "$out"/bench.table 2>/dev/null | grep -h '^TABLE|' | sed 's/^TABLE|//')
    if command -v column >/dev/null; then echo "$table" | column -t -s '|'; else echo "$table" | sed 's/|/   /g'; fi
    # The logs come back as one archive ($OUT returns at most 8 files); other files there stay.
    (cd "$out" && tar czf logs.tgz -- cuda_*.log bench* 2>/dev/null && rm -f -- cuda_*.log bench*)
    if [ ${#failed[@]} -gt 0 ]; then
        echo "FAILED: ${failed[*]}"
        exit 1
    fi
    echo "all CUDA tests passed"
    ;;
*)
    echo "usage: $0 build|run|bench|all|moe" >&2
    exit 2
    ;;
esac
