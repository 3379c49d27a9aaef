#!/usr/bin/env bash
# Remakes docs/screenshots/: the real window under Xvfb after two generations with the shipped
# emoji model (the tiny random test model when it is absent), the compare view and the gallery.
# Needs a build (cmake --build --preset default) and .venv (scripts/setup.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/env.sh
app=build/default/app/diffract
models=build/default/fixtures
out=docs/screenshots
if [ ! -x "$app" ]; then
  echo "[screenshots] $app is missing: build first (cmake --build --preset default)" >&2
  exit 1
fi
if [ ! -f "$models/STAMP" ]; then
  echo "[screenshots] making the tiny reference models (diffusers, CPU, seeded)"
  .venv/bin/python tests/reference/make_fixtures.py --out "$models" --shared "$root/../shared" >/dev/null 2>&1
fi
if [ -f resources/models/diffract-emoji/model_index.json ]; then
  job=(--model resources/models/diffract-emoji --prompt "a large red apple in the centre on a light blue background"
       --negative "" --size 128 --steps 20 --inpaint-prompt "a large glowing star in the centre on a light blue background")
else
  job=(--model "$models/tiny-sd")
fi
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
# A real X server (xcb), not the offscreen platform env.sh picks for the tests.
# One OpenMP thread: with Xvfb on a two-core machine, spinning OpenMP threads made the jobs several times slower.
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" QT_QPA_PLATFORM=xcb xvfb-run -a -s "-screen 0 1600x1000x24" \
  "$app" --screenshots "$raw" "${job[@]}" --timeout 300
mkdir -p "$out"
# 128 colours, no dithering: the UI's flat areas stay exact and the files stay small.
.venv/bin/python - "$raw" "$out" <<'PY'
import sys
from pathlib import Path
from PIL import Image
raw, out = Path(sys.argv[1]), Path(sys.argv[2])
for name in ("main-window.png", "compare.png", "gallery.png", "inpaint-mask.png", "inpaint.png", "lanes.png",
             "lanes-compare.png"):
    image = Image.open(raw / name).convert("RGB")
    image.quantize(128, dither=Image.Dither.NONE).save(out / name, optimize=True)
    print(f"[screenshots] {out / name}: {image.width}x{image.height}, {(out / name).stat().st_size // 1024} KiB")
PY
