#!/usr/bin/env bash
# Installs whatever Diffract needs that is missing, and nothing else; safe to run again.
#   Debian packages (compilers, Qt 6, spdlog, ...), the project venv .venv with the pinned
#   torch wheel (LibTorch) and the reference oracle's Python packages.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

log() { printf '[setup] %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root to run: $*"; exit 1; fi
}

packages=(
  build-essential cmake ninja-build ccache git pkg-config python3 python3-venv
  qt6-base-dev libgl-dev libspdlog-dev libfmt-dev nlohmann-json3-dev libcli11-dev libicu-dev
  zlib1g-dev libpng-dev libjpeg-dev libssl-dev libopencv-dev libsentencepiece-dev xvfb xauth fonts-noto-color-emoji unicode-data
  clang libclang-rt-14-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  log "Debian packages: all present"
fi

python="${DIFFRACT_SYSTEM_PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($python --version)"
  "$python" -m venv .venv
fi
stamp=.venv/.diffract-requirements
want="$(sha256sum scripts/requirements.txt | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing Python packages (torch 2.11.0 is large: several GB with its CUDA libraries)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r scripts/requirements.txt
  echo "$want" > "$stamp"
else
  log "Python packages: up to date"
fi

# LibTorch's CMake files need a CUDA 13 toolkit (the wheel is a CUDA build). Use the system
# one when present, otherwise NVIDIA's PyPI packages inside the venv.
if ! { [ -x /usr/local/cuda/bin/nvcc ] || command -v nvcc >/dev/null; }; then
  if [ ! -x .venv/lib/python3*/site-packages/nvidia/cu13/bin/nvcc ]; then
    log "no CUDA toolkit found: installing nvcc and headers from PyPI into .venv"
    .venv/bin/python -m pip install -q "cuda-toolkit[nvcc,cccl,cudart]==13.0.2"
  fi
fi
log "done"
