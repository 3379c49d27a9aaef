#!/usr/bin/env bash
# Fills .carry/ (git-ignored) with what the GPU machine lacks, for scripts/gpu_check.sh and
# scripts/gpu_bench.sh: CLI11's headers, the shared data, the diffusers anchor scripts and
# the diffusers wheel (Python 3.12); for scripts/gpu_train.sh also the emoji atlas. Pass `.carry` in the device call's carry list.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
shared="${DIFFRACT_SHARED:-$root/../shared}"
cd "$root"
mkdir -p .carry/include .carry/shared/data .carry/whl
cp -r /usr/include/CLI .carry/include/
cp -r "$shared/data/clip" "$shared/data/taesd" .carry/shared/data/
cp "$shared/anchors/"*.py .carry/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .carry/whl diffusers==0.42.1 importlib_metadata peft==0.21.2 accelerate==1.15.0
# The emoji atlas diffract-train needs (scripts/gpu_train.sh), from this machine's Debian fonts.
if [[ ! -f .carry/emoji/atlas.json ]]; then
  if [[ -x build/default/app/diffract-dataset ]]; then
    QT_QPA_PLATFORM=offscreen build/default/app/diffract-dataset --out .carry/emoji
  else
    echo "no emoji atlas: build diffract-dataset (cmake --build build/default --target diffract-dataset) for gpu_train.sh" >&2
  fi
fi
du -sh .carry
