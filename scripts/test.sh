#!/usr/bin/env bash
# Sets everything up, builds Diffract and runs every test through CTest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
source scripts/env.sh
cmake --preset default
cmake --build --preset default -j "$jobs"
ctest --preset default -j "$jobs"
