#!/usr/bin/env bash
# The device tool sends the working tree (at most 64 MiB with the carry); the shipped models
# under resources/models (about 95 MB) do not fit beside it. `hide` takes them out of the working
# tree with a sparse checkout (git keeps them; nothing is deleted from the repository), `show`
# brings them back. Device calls that need none of them (benchmarks, checks, fuzzing, training
# with TAEF2 from .carry) run between the two.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-}" in
  hide) git sparse-checkout set --no-cone '/*' '!/resources/models/' ;;
  show) git sparse-checkout disable ;;
  *) echo "usage: $0 hide|show" >&2; exit 2 ;;
esac
du -sh --exclude=.git --exclude=build --exclude=.venv --exclude=out --exclude=.carry . | sed 's/\t.*/ working tree (without build\/, .venv\/, out\/, .carry\/)/'
