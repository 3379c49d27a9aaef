#!/usr/bin/env bash
# Packs the fuzz harnesses for a machine with more cores than this one (the GPU machine has 16):
# builds them as scripts/fuzz.sh does but without ICU (that machine's ICU has another soname;
# the CLIP tokenizer then refuses non-ASCII text by name, so run `prompt` here), strips their
# debug sections (reproduce a finding here, with symbols, from its artifact) and writes
# .carry/fuzz-bundle.tar.xz: the harnesses, the shared libraries that machine lacks, the seeds,
# the dictionaries, the regression corpus and run.sh. There:
#   tar xf .carry/fuzz-bundle.tar.xz -C /tmp && /tmp/fuzz-bundle/run.sh SECONDS JOBS NAME...
# run.sh runs each harness over its regressions, then in libFuzzer's fork mode with JOBS
# processes for SECONDS, and prints executions, coverage and findings; artifacts and logs are
# left in $OUT/fuzz when OUT is set.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/env.sh
build=build/fuzz-bundle
cmake --preset fuzz -B "$build" -DCMAKE_DISABLE_FIND_PACKAGE_ICU=ON > /dev/null
cmake --build "$build" -j "$jobs" > "$build/build.log" 2>&1 || { tail -40 "$build/build.log"; exit 1; }

stage="$(mktemp -d)/fuzz-bundle"
mkdir -p "$stage/bin" "$stage/lib"
for exe in "$build"/tests/fuzz/fuzz_*; do
  [ -x "$exe" ] && [ -f "$exe" ] || continue
  strip --strip-debug -o "$stage/bin/$(basename "$exe")" "$exe"
done
# Libraries from Debian that an Ubuntu machine with LibTorch does not have at these sonames.
for lib in libspdlog.so.1.10 libfmt.so.9 libpng16.so.16 libjpeg.so.62; do
  cp -L "/lib/x86_64-linux-gnu/$lib" "$stage/lib/"
done
# Without the fixtures the seeds are a few made-up files, and single_file, safetensors and pth
# stay near their header checks (a bundle built so ran single_file at coverage 963 where the
# fixtures' seeds reach 3 737).
if [ ! -d build/default/fixtures/flux_single_file ]; then
  echo "build/default/fixtures is missing or incomplete: run the default preset's tests once" \
       "(ctest --preset default -L parity) so the bundle's seeds include every fixture" >&2
  exit 1
fi
.venv/bin/python tests/fuzz/make_seeds.py --out "$stage/seeds" --fixtures build/default/fixtures > /dev/null
cp -r tests/fuzz/regressions "$stage/regressions"
cp tests/fuzz/json.dict tests/fuzz/pickle.dict tests/fuzz/lsan.supp "$stage/"
cat > "$stage/run.sh" << 'EOF'
#!/usr/bin/env bash
# run.sh SECONDS JOBS NAME...: see scripts/fuzz_bundle.sh in the repository.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
seconds="$1"; jobs="$2"; shift 2
torch_lib="$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__) + "/lib")' 2>/dev/null || true)"
export LD_LIBRARY_PATH="$here/lib:$torch_lib:${LD_LIBRARY_PATH:-}"
export ASAN_OPTIONS="allocator_may_return_null=1:detect_leaks=1:abort_on_error=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$here/lsan.supp:print_suppressions=0"
work="${OUT:-/tmp}/fuzz"
mkdir -p "$work/artifacts"
status=0
for name in "$@"; do
  exe="$here/bin/fuzz_$name"
  dict=()
  case "$name" in
    safetensors|json|png_parameters|single_file|lora) dict=(-dict="$here/json.dict") ;;
    # LibTorch's zip-reader leak (lsan.supp) is matched by function name, and that machine has
    # no symbolizer: the exit-time leak check is off for this harness there.
    pth) dict=(-dict="$here/pickle.dict" -detect_leaks=0) ;;
  esac
  asan="$ASAN_OPTIONS"
  [ "$name" != pth ] || asan="${asan/detect_leaks=1/detect_leaks=0}"
  flags=(-max_len=65536 -rss_limit_mb=3072 -malloc_limit_mb=2048 -timeout=20 -artifact_prefix="$work/artifacts/$name-")
  if [ -d "$here/regressions/$name" ]; then
    ASAN_OPTIONS="$asan" "$exe" "${flags[@]}" "$here/regressions/$name"/* > "$work/$name-regressions.log" 2>&1 \
      || { echo "[fuzz] $name: a regression input fails again"; status=1; continue; }
  fi
  corpus="${FUZZ_CORPUS:-/tmp/fuzz-corpus}/$name"
  mkdir -p "$corpus"
  log="$work/$name.log"
  start=$(date +%s)
  ASAN_OPTIONS="$asan" "$exe" "${flags[@]}" "${dict[@]}" -fork="$jobs" -max_total_time="$seconds" "$corpus" "$here/seeds/$name" > "$log" 2>&1
  rc=$?
  last="$(grep -E '^#[0-9]+: cov:' "$log" | tail -1)"
  echo "[fuzz] $name: rc $rc, $(( $(date +%s) - start )) s, $jobs processes, corpus $(ls "$corpus" | wc -l): $last"
  if [ $rc -ne 0 ] || ls "$work/artifacts/$name-"* > /dev/null 2>&1; then
    echo "[fuzz] $name: FINDINGS"; grep -m5 -E "ERROR|runtime error|SUMMARY" "$log"; status=1
  fi
done
exit $status
EOF
chmod +x "$stage/run.sh"
mkdir -p .carry
tar -C "$(dirname "$stage")" -cJf .carry/fuzz-bundle.tar.xz fuzz-bundle
rm -rf "$(dirname "$stage")"
echo ".carry/fuzz-bundle.tar.xz: $(du -h .carry/fuzz-bundle.tar.xz | cut -f1)"
