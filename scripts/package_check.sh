#!/usr/bin/env bash
# CI's packaging check, after scripts/test.sh built build/default: makes the .deb and .tar.gz,
# installs the .deb with apt-get, links the build's own torch wheel as its LibTorch
# (diffract-setup-torch --link), runs the installed programs (--version, and one image with the
# installed emoji model), reports the package sizes and removes the package again. Needs root.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root/build/default"
[ "$(id -u)" = 0 ] || { echo "package_check: apt-get install needs root" >&2; exit 1; }
rm -f diffract_*.deb diffract-*.tar.gz
cpack -G "DEB;TGZ" > cpack.log 2>&1 || { tail -20 cpack.log; exit 1; }
deb=$(ls diffract_*.deb)
echo "package: $deb $(du -h "$deb" | cut -f1), $(ls diffract-*.tar.gz) $(du -h diffract-*.tar.gz | cut -f1)"
had_torch_root=0
[ -e /opt/diffract/torch ] && had_torch_root=1
cleanup() {
  apt-get remove -y -qq diffract > /dev/null 2>&1 || true
  [ "$had_torch_root" = 1 ] || rm -f /opt/diffract/torch
}
trap cleanup EXIT
apt-get install -y -qq "./$deb" 2>&1 | tail -3
dpkg-query -W -f='installed: ${Package} ${Version}, Installed-Size ${Installed-Size} KiB\n' diffract
# Before LibTorch is in place the setup check says what to do.
readelf -d /usr/bin/diffract-cli | grep -o "R.*PATH.*"
diffract-setup-torch --check || true
site="$("$root/.venv/bin/python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
diffract-setup-torch --link "$site"
diffract-setup-torch --check
QT_QPA_PLATFORM=offscreen diffract --version
diffract-cli --version
out="$(mktemp -d)"
diffract-cli generate --prompt "red apple" --steps 4 --width 128 --height 128 --out "$out/apple.png" > "$out/log" 2>&1 \
  || { cat "$out/log"; exit 1; }
grep -o "loaded [^ ]*diffract-emoji" "$out/log"
grep -q "loaded /usr/share/diffract/models/diffract-emoji" "$out/log" \
  || { echo "the installed diffract-cli did not use the installed model" >&2; exit 1; }
echo "installed diffract-cli generated $(du -h "$out/apple.png" | cut -f1) with the installed emoji model"
# Its companions: the inpainting variant (whose other parts are links to the model's) takes an
# inpainting job, and the shipped LoRA is found by its tag.
"$root/.venv/bin/python" -c "from PIL import Image, ImageDraw; m = Image.new('L', (128, 128)); \
ImageDraw.Draw(m).rectangle([32, 32, 96, 96], fill=255); m.save('$out/mask.png')"
diffract-cli generate --prompt "a large rocket in the centre on a light blue background" --image "$out/apple.png" \
  --mask "$out/mask.png" --steps 4 --out "$out/rocket.png" > "$out/log" 2>&1 || { cat "$out/log"; exit 1; }
grep -q "loaded /usr/share/diffract/models/diffract-emoji-inpaint" "$out/log" \
  || { cat "$out/log"; echo "the installed diffract-cli did not inpaint with the installed inpainting model" >&2; exit 1; }
diffract-cli generate --prompt "red apple <lora:diffract-emoji-outline:1>" --steps 4 --width 128 --height 128 \
  --out "$out/outline.png" > "$out/log" 2>&1 || { cat "$out/log"; exit 1; }
grep -q "LoRAs applied" "$out/log" || { cat "$out/log"; echo "the installed LoRA was not applied" >&2; exit 1; }
echo "installed diffract-cli inpainted with diffract-emoji-inpaint and applied diffract-emoji-outline"
rm -rf "$out"
