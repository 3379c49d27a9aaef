#!/usr/bin/env bash
# Builds the libFuzzer harnesses (tests/fuzz, preset "fuzz": clang, ASan + UBSan) and runs each:
# first over its regression corpus (tests/fuzz/regressions/<name>: inputs that once crashed),
# then for SECONDS (default 10) from seeds made by tests/fuzz/make_seeds.py. A crash, a leak or
# an undefined behaviour fails the script, leaving the input under build/fuzz/artifacts/ (add it
# to the regression corpus with the fix).
#   scripts/fuzz.sh [SECONDS] [NAME...]     e.g. scripts/fuzz.sh 600 pth
#   FUZZ_RUNS=10000000 scripts/fuzz.sh 0 safetensors   (a fixed number of executions instead)
#   FUZZ_JOBS=2 scripts/fuzz.sh 3600 prompt             (libFuzzer's fork mode, 2 processes; a time)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/env.sh
seconds="${1:-10}"
shift || true
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(safetensors pth json image png_parameters prompt single_file lora)

build=build/fuzz
mkdir -p "$build"
cmake --preset fuzz > "$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
cmake --build --preset fuzz -j "$jobs" > "$build/build.log" 2>&1 || { tail -40 "$build/build.log"; exit 1; }
seeds="$build/seeds"
rm -rf "$seeds"
.venv/bin/python tests/fuzz/make_seeds.py --out "$seeds" $( [ -d build/default/fixtures ] && echo --fixtures build/default/fixtures )
export DIFFRACT_CLIP_BPE="$root/../shared/data/clip/bpe_simple_vocab_16e6.txt.gz"
# A huge allocation is an error the loaders must report, not a crash; leaks are checked.
export ASAN_OPTIONS="allocator_may_return_null=1:detect_leaks=1:abort_on_error=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$root/tests/fuzz/lsan.supp:print_suppressions=0"
mkdir -p "$build/artifacts"
status=0
for name in "${names[@]}"; do
  exe="$build/tests/fuzz/fuzz_$name"
  dict=()
  case "$name" in
    safetensors|json|png_parameters|single_file|lora) dict=(-dict=tests/fuzz/json.dict) ;;
    # LibTorch's zip reader leaks on every damaged archive (tests/fuzz/lsan.supp), and libFuzzer
    # then scans the whole heap after each such input: 80 runs a second instead of thousands.
    # Leaks are not checked for this harness.
    pth) dict=(-dict=tests/fuzz/pickle.dict -detect_leaks=0) ;;
  esac
  flags=(-max_len=65536 -rss_limit_mb=3072 -malloc_limit_mb=2048 -timeout=20 -artifact_prefix="$build/artifacts/$name-")
  regressions="tests/fuzz/regressions/$name"
  if [ -d "$regressions" ] && [ -n "$(ls -A "$regressions")" ]; then
    if ! "$exe" "${flags[@]}" "$regressions"/* > "$build/$name-regressions.log" 2>&1; then
      echo "[fuzz] $name: a regression input fails again (see $build/$name-regressions.log)"
      status=1
      continue
    fi
  fi
  corpus="$build/corpus/$name"
  mkdir -p "$corpus"
  run=(-max_total_time="$seconds")
  [ -z "${FUZZ_RUNS:-}" ] || run=(-runs="$FUZZ_RUNS")
  [ -z "${FUZZ_JOBS:-}" ] || run+=(-fork="$FUZZ_JOBS")  # processes sharing the corpus (libFuzzer's fork mode)
  log="$build/$name.log"
  if "$exe" "${flags[@]}" "${dict[@]}" "${run[@]}" -print_final_stats=1 "$corpus" "$seeds/$name" > "$log" 2>&1; then
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo "?")
    echo "[fuzz] $name: ok, $execs executions, coverage $cov edges, corpus $(ls "$corpus" | wc -l) inputs"
  else
    echo "[fuzz] $name: FAILED (the input is in $build/artifacts/, the report in $log):"
    grep -m3 -E "ERROR|runtime error|SUMMARY" "$log" || tail -5 "$log"
    status=1
  fi
done
exit $status
