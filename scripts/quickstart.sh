#!/usr/bin/env bash
# Sets everything up, builds Diffract and runs the main job on a tiny model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
./scripts/setup.sh
user_qpa="${QT_QPA_PLATFORM-}"  # env.sh sets offscreen for the tests; the window needs the user's
source scripts/env.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$jobs"

cli=build/default/app/diffract-cli
models=build/default/fixtures
if [ ! -f "$models/STAMP" ]; then
  echo "[quickstart] making the tiny reference models (diffusers, CPU, seeded)"
  .venv/bin/python tests/reference/make_fixtures.py --out "$models" --shared "$root/../shared" >/dev/null 2>&1
fi
mkdir -p out
"$cli" info
"$cli" inspect "$models/tiny-sdxl"
emoji=resources/models/diffract-emoji
if [ -f "$emoji/model_index.json" ]; then
  # The embedded model, generate's default (trained by diffract-train; see its README.md): real pictures on CPU.
  "$cli" inspect "$emoji"
  "$cli" generate --prompt "a red apple on a light blue background" \
    --steps 20 --cfg 5 --seed 42 --width 128 --height 128 --preview-dir out/previews --out out/apple.png
else
  "$cli" generate --model "$models/tiny-sdxl" --prompt "a studio packshot of a red apple on a white background" \
    --negative "blurry" --steps 20 --cfg 7 --seed 42 --scheduler dpmpp-2m-karras \
    --preview-dir out/previews --out out/apple.png
fi
echo "[quickstart] the image (with its parameters in PNG text chunks) is out/apple.png, each step's preview in out/previews/"

# With a display and a terminal (a person, not a script waiting on it), the desktop app opens
# next (its first start selects the embedded model); otherwise, or with DIFFRACT_QUICKSTART_GUI=0,
# the CLI job above is the whole run.
app=build/default/app/diffract
if [ "${DIFFRACT_QUICKSTART_GUI:-1}" != 0 ] && { [ -n "${DISPLAY:-}" ] || [ -n "${WAYLAND_DISPLAY:-}" ]; } &&
   [ -t 0 ] && [ -x "$app" ]; then
  echo "[quickstart] opening the window ($app); close it to end"
  if [ -n "$user_qpa" ]; then export QT_QPA_PLATFORM="$user_qpa"; else unset QT_QPA_PLATFORM; fi
  "$app" || echo "[quickstart] the window did not open ($app exited with $?); run it yourself to see why"
else
  echo "[quickstart] to see the window: $app on a desktop (the embedded model is selected on its first start)"
fi
