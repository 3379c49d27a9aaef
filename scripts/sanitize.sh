#!/usr/bin/env bash
# Builds everything with ASan + UBSan (preset "asan", gcc, RelWithDebInfo, without Diffract's CUDA
# kernels) and runs the tests under them: `scripts/sanitize.sh` runs the unit and parity labels,
# `scripts/sanitize.sh -L gui` or `-R test_safetensors` what CTest is given. Leak checking is
# off here (LibTorch and Qt keep their singletons); the fuzz harnesses check leaks in the parsers.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/env.sh
cmake --preset asan
cmake --build --preset asan -j "$jobs"
[ $# -gt 0 ] || set -- -L "unit|parity"
ctest --preset asan -j "$jobs" "$@"
