#!/usr/bin/env bash
# One call of under 10 minutes on the GPU machine: builds the `gpu` preset (diffract-bench and
# diffract-gpu-checks against the machine's PyTorch), then runs one plan (PLAN, default checks;
# several space-separated run one after the other, the first deciding the build and the logs'
# folder):
#   checks  any GPUs: the GPU checks, all of `ctest -L gpu` or those matching CHECKS (a ctest -R
#           pattern); the lines matching GREP are printed besides the verdicts. gpu_cancel_any
#           needs DIFFRACT_CANCEL_MODEL, a tiny SD folder (cp -r build/default/fixtures/tiny-sd
#           .carry/; DIFFRACT_CANCEL_MODEL=$PWD/.carry/tiny-sd), and skips without it.
#   lean    one GPU: the diffusers anchor (ANCHOR, default diffusers_sdxl_sd3.py; diffusers_flux.py
#           for the flux configs), then diffract-bench (LEAN_CONFIGS, default sdxl-1024) on the
#           same GPU, one after the other, and their ratios: a side-by-side of one run;
#           LEAN_STRATEGIES adds diffract-bench strategies (e.g. single@DIFFRACT_PRECISION=fp8);
#           LEAN_SETS="ANCHOR=CONFIGS;ANCHOR=CONFIGS" runs several such pairs, one after the other.
#   image   one GPU: diffusers' SDXL text-to-image, img2img and inpaint pipelines
#           (tests/gpu/diffusers_sdxl_image_inputs.py, img2img at STRENGTH, default 0.6), then
#           diffract-bench --image-inputs on sdxl-1024, and their ratios.
#   lora    one GPU: diffusers' load_lora_weights + fuse_lora of a random rank-RANK (default 32)
#           LoRA over SDXL's UNet and both encoders (tests/gpu/diffusers_sdxl_lora.py), then
#           diffract-bench --lora-rank on sdxl-1024 (apply, switch, remove), and their ratios.
#   controlnet one GPU: diffusers' SDXL ControlNet pipeline with one ControlNet made from the UNet
#           (tests/gpu/diffusers_sdxl_controlnet.py), then diffract-bench --controlnet on sdxl-1024.
#           CN_DEBUG=1 first runs diffract-bench --controlnet on the tiny config under cuda-gdb
#           (a crash's caller and backtrace), then once per CN_VARIANTS entry (';'-separated
#           environment settings); CN_ANCHOR=0 skips the anchor, CN_BENCH=0 the sdxl-1024 bench.
#   ab      one GPU: SDXL 1024² (AB_CONFIG; several comma-separated: each in turn) with AB_VAR set to
#           each of AB_VALUES, one after the other on the
#           same GPU, after the checks matching CHECKS if set; an AB_VALUES entry with "=" is
#           a comma-separated set of settings of its own (several variables A/B'd in one call);
#           AB_OPS=N lists each step's N largest kernels by the ATen op that launched them,
#           AB_STRATEGIES adds strategy runs.
#   pair    two GPUs: every 2-GPU check (NCCL, the strategies, cancel mid-job, a failing device,
#           out of memory on a rank), then the SDXL strategy bench (PAIR_STRATEGIES) and SD3's
#           (SD3_STRATEGIES; empty skips it) against our one GPU in the same run.
#   wide    four or eight GPUs: the link map, the checks over all GPUs, then the SDXL strategies
#           (WIDE_STRATEGIES), a batch of 8 data-parallel, SD3's strategies and SDXL 2048².
#   solo    one GPU: diffract-bench's plain job and each one-device strategy of SOLO_STRATEGIES
#           (default fbcache) on each config of SOLO_CONFIGS (default flux-1024,sd3-1024), in one run;
#           or SOLO_PLAN="CONFIG=STRATEGIES;..." (each config its own list, e.g. the step caches).
#   lanes   one GPU: diffract-cli lanes with the embedded model on cuda:0 for each shipped setup of
#           LANE_SETUPS (default steps-30-20-12, samplers-at-20-steps and the DRiffusion one, whose
#           2-GPU lane cannot run on one) at LANE_SIZE (default 256) px: the table of each. The
#           model (57.9 MB) and a benchmark's carry no longer fit the 64 MiB together: with
#           `scripts/device_tree.sh hide` and the model folder copied into .carry/ (with
#           LANE_MODEL pointing there), keep the rest of .carry under 6 MB.
#   tree    one GPU: another tree's diffract-bench (TREE, default .ab/old: an older commit's
#           sources, `git archive COMMIT CMakeLists.txt CMakePresets.json cmake core app tests/gpu
#           presets packaging`) against this tree's, taking turns on the same GPU (TREE_CONFIGS,
#           default sdxl-1024,sd3-1024): a before/after A/B of a change. TREE_BUILD_ONLY=1 only
#           builds both (a first call, when the builds and the runs do not fit in one).
#   sizes   one GPU: what a size not used before costs (diffract-bench --new-sizes SIZES, default
#           1152x896,768x768,1344x768, on SIZES_CONFIGS, default sdxl-1024), in three processes one
#           after the other: ATen's cuDNN benchmark mode with nothing kept (the tree before the tuning
#           store), the timed choices with an empty tuning store (a first start on this GPU), and the
#           same store again (a size tuned before), then nothing timed (cuDNN's heuristic plans and
#           at::linear: what the tuning buys); SIZES_RUNS names a subset. CHECKS: the GPU checks
#           matching it first. A run NAME@VAR=VALUE[@VAR=VALUE] adds those settings (e.g.
#           stored@DIFFRACT_GRAPH_WARMUPS=1).
# FUZZ=NAME...: while the plan runs, the fuzz harnesses (.carry/fuzz-bundle.tar.xz, from
# scripts/fuzz_bundle.sh) on the cores the benchmarks leave (4 and up; the benchmarks keep 0-3),
# niced, each for an equal share of the time left, their corpora in /tmp/fuzz-corpus (kept on a
# warm machine from one call to the next); their logs come back in $OUT/fuzz_PLAN.tar.
# Strategy specs are diffract-bench's NAME[:N][@VAR=VALUE...]; only job-scope options
# (core/util/options.h: DIFFRACT_DRIFFUSION_PAIRS, DIFFRACT_PARALLEL_VAE, DIFFRACT_BATCH_VAE) can
# follow an @: the others are read once per process, so `ab` compares them in separate runs.
# Needs .carry/ in the call's carry list (scripts/prepare_carry.sh): CLI11's headers, the shared
# data, the diffusers anchor script (from ../shared/anchors) and the diffusers wheel.
# scripts/gpu_common.sh exports NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NVSHMEM_DISABLE_NVLS=1, which keep NVLink multicast off on the GPU machines.
# Leaves $OUT/logs.tar: every log and JSON of the plan. SKIP_CHECKS skips a plan's checks.
# END_S (default 560): the second by which all is done, so the call ends inside its limit with
# the logs written.
set -uo pipefail
export PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( ${END_S:-560} - $(elapsed) - ${1:-0} )); }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/gpu_common.sh
plans="${PLAN:-checks}"  # several, space-separated, run one after the other (e.g. "lean sizes")
plan="${plans%% *}"
out="${OUT:-/tmp/gpu_session}"
logs=/tmp/gpu_session_logs/$plan
mkdir -p "$out" "$logs"
finish() {
  if [ -n "${fuzz_pid:-}" ]; then
    wait "$fuzz_pid"
    tar -C "$out" -cf "$out/fuzz_$plan.tar" fuzz 2>/dev/null && rm -rf "$out/fuzz"
  fi
  tar -C /tmp/gpu_session_logs -cf "$out/logs.tar" .
  ls -la "$out"
  echo "done at $(elapsed) s"
}
trap finish EXIT

gpu_python_packages
gpu_info "$logs/gpu.txt"
if [ "$plan" = tree ]; then
  # The other tree builds beside this one, half the cores each.
  tree="${TREE:-.ab/old}"
  ( cd "$tree" && cmake --preset gpu -DDIFFRACT_BUILD_CLI=ON -DCLI11_INCLUDE_DIR="$root/.carry/include" \
      -DDIFFRACT_PYTHON="$(command -v python3)" -DCMAKE_CXX_COMPILER_LAUNCHER= -DCMAKE_CUDA_COMPILER_LAUNCHER= \
      -DDIFFRACT_CUDA_ARCHITECTURES=90-real > "$logs/tree_configure.log" 2>&1 &&
    cmake --build build/gpu -j "$(( $(nproc) / 2 ))" --target diffract-bench > "$logs/tree_build.log" 2>&1 ) &
  tree_build=$!
fi
targets="diffract-bench diffract-gpu-checks"
[ "$plan" = tree ] && targets=diffract-bench
[ "$plan" = sizes ] && [ -z "${CHECKS:-}" ] && targets=diffract-bench
targets="${TARGETS:-$targets}"  # e.g. TARGETS=diffract-bench: a shorter build where no check runs
[ "$plan" = lanes ] && targets=diffract-cli
gpu_build "$logs" $targets || exit 1
echo "built at $(elapsed) s"
bench=build/gpu/app/diffract-bench
if [ -n "${FUZZ:-}" ] && [ "$(nproc)" -gt 8 ]; then
  [ -x /tmp/fuzz-bundle/run.sh ] || tar xf .carry/fuzz-bundle.tar.xz -C /tmp
  names=(${FUZZ//,/ })
  share=$(( ($(left 25)) / ${#names[@]} ))
  ( cd /tmp && OUT="$out" nice -n 10 taskset -c 4-$(( $(nproc) - 1 )) /tmp/fuzz-bundle/run.sh "$share" $(( $(nproc) - 4 )) \
      "${names[@]}" > "$logs/fuzz.log" 2>&1 ) &
  fuzz_pid=$!
  echo "fuzzing ${names[*]} on cores 4-$(( $(nproc) - 1 )), $share s each"
  taskset -pc 0-3 $$ > /dev/null  # this script and all it starts from here on
fi

# checks LOG REGEX [TIMEOUT] [MORE]: the GPU checks matching REGEX into $logs/LOG.log, their
# verdict lines printed (and the lines matching MORE).
checks() {
  ctest --test-dir build/gpu -R "$2" -V --timeout "${3:-90}" > "$logs/$1.log" 2>&1
  grep -E "  FAIL  |tests passed|Timeout|Failed|Passed|skipped" "$logs/$1.log" | cut -c1-300 | head -40
  echo "  ($(grep -c '  ok  ' "$logs/$1.log") ok lines)"
  [ -n "${4:-}" ] && grep -E "$4" "$logs/$1.log" | grep -v "  FAIL  " | cut -c1-300 | head -60
  echo "checks ($1) at $(elapsed) s"
}

# ratios: bench_single.json against the anchor's RES lines (anchor.json; an anchor cut off by
# its timeout still gives what it reached), figure by figure.
ratios() {
  python3 - "$logs" "${1:-}" <<'PY'
import json, sys
d, tag = sys.argv[1], sys.argv[2]
def value(v):
    try:
        return float(v)
    except ValueError:
        return v.strip()
anchor = {k: value(v) for _, k, v in (l.split(" ", 2) for l in open(f"{d}/anchor{tag}.log") if l.startswith("RES "))}
json.dump(anchor, open(f"{d}/anchor{tag}.json", "w"))
print("anchor", anchor)
try:
    ours = json.load(open(f"{d}/bench_single{tag}.json"))
except Exception as e:
    print("no bench JSON:", e); sys.exit(0)
print("versions:", {k: ours.get(k) for k in ("diffract", "torch", "nccl")})
rows = []
for r in ours["results"]:
    print(json.dumps({k: v for k, v in r.items() if not k.startswith("unet_step_variants")})[:1500])
    step = r["denoiser_step_ms"]["mean"]
    if r["config"] == "sdxl-1024":
        rows += [("SDXL 1024 30 steps end to end (s)", r["end_to_end_ms"]["median"] / 1e3, anchor.get("pipe_sdxl_1024_30steps_pil_bf16vae_s")),
                 ("UNet step batch 2 vs eager (ms)", step, anchor.get("unet_step_b2_ms")),
                 ("UNet step batch 2 vs CUDA graph (ms)", step, anchor.get("unet_step_b2_cudagraph_ms")),
                 ("VAE decode 1024 (ms)", r["vae_decode_ms"], anchor.get("vae_decode_bf16_ms")),
                 ("peak VRAM (GiB)", r.get("peak_vram_gib", 0), anchor.get("pipe_mem_GiB"))]
    if r["config"] == "sd3-1024":
        rows.append(("SD3 transformer step batch 2 (ms)", step, anchor.get("sd3_step_b2_ms")))
        # diffusers_sd3_best.py's keys: eager, CUDA graph, torch.compile
        for key, label in (("sd3_b2_eager_ms", "eager"), ("sd3_b2_graph_ms", "CUDA graph"), ("sd3_b2_compiled_ms", "compiled")):
            rows.append((f"SD3 step batch 2 vs {label} (ms)", step, anchor.get(key)))
    if r["config"] == "flux-1024":
        rows += [("Flux-dev step batch 1 vs eager (ms)", step, anchor.get("flux_b1_eager_ms")),
                 ("Flux-dev step batch 1 vs CUDA graph (ms)", step, anchor.get("flux_b1_graph_ms")),
                 ("Flux-dev step batch 1 vs compiled (ms)", step, anchor.get("flux_b1_compiled_ms"))]
print(f"{'figure':40s} {'ours':>10s} {'diffusers':>10s} {'ratio':>7s}")
for name, a, b in rows:
    if isinstance(b, float) and b:
        print(f"{name:40s} {a:10.3f} {b:10.3f} {a / b:7.3f}")
PY
}

# strategy_bench TAG CONFIG BATCH STRATEGIES [TIMEOUT]: diffract-bench's one-GPU job and each
# strategy against it in the same run (speed-ups, PSNR / SSIM against the one-GPU image), then
# each strategy's time outside its loop.
strategy_bench() {
  local tag="$1" config="$2" batch="$3" strategies="$4"
  timeout "${5:-$(left 5)}" "$bench" --device cuda:0 --config "$config" --batch "$batch" --runs "${BENCH_RUNS:-2}" \
    --strategies "$strategies" > "$logs/bench_$tag.json" 2> "$logs/bench_$tag.log"
  echo "strategy bench ($tag) rc $? at $(elapsed) s"
  python3 - "$logs/bench_$tag.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no strategy JSON:", e); sys.exit(0)
for x in r["results"]:
    print(f"  {x['config']} batch {x['batch']}, one GPU: e2e {x['end_to_end_ms']['median']:.1f} ms, step {x['denoiser_step_ms']['mean']:.2f} ms, "
          f"vae {x['vae_decode_ms']:.1f} ms, {x.get('images_per_s', 0):.3f} img/s, repeatable {x.get('repeatable')}")
    for s in x.get("strategies", []):
        st = s.get("stats", {})
        print(f"  {s.get('spec', s['strategy'])}: e2e {s['end_to_end_ms']:.1f} ms, x{s['speedup_end_to_end']:.2f} e2e, "
              f"x{s['speedup_denoising']:.2f} denoising, PSNR {s['psnr_db'] or float('inf'):.1f} dB, SSIM {s['ssim']:.4f}, "
              f"rel-L2 {s['latents_rel_l2']:.4f}, {s.get('images_per_s', 0):.3f} img/s, vae {s.get('vae_decode_ms', 0):.1f} ms, "
              f"rounds {st.get('rounds')} (paired {st.get('paired_rounds', 0)}), loop {st.get('loop_ms', 0):.0f} ms")
        print(f"    outside the loop: before the call {st.get('before_call_ms', 0):.2f} ms, set-up {st.get('setup_ms', 0):.2f}, "
              f"finish {st.get('finish_ms', 0):.2f}, call - loop {st.get('call_ms', 0) - st.get('loop_ms', 0):.2f}, "
              f"after the call {st.get('after_call_ms', 0):.2f}")
PY
}

for plan in $plans; do
case "$plan" in
checks)
  if [ -n "${CHECKS:-}" ]; then
    checks checks "$CHECKS" 150 "${GREP:-}"
  else
    # The NCCL basics first: if they fail, the other multi-GPU checks would only wait out
    # their timeouts, so then only the single-GPU ones run.
    if ctest --test-dir build/gpu -R gpu_nccl -V > "$logs/checks_gpu.log" 2>&1; then
      ctest --test-dir build/gpu -L gpu -E gpu_nccl -V >> "$logs/checks_gpu.log" 2>&1
    else
      echo "gpu_nccl failed: the single-GPU checks only"
      ctest --test-dir build/gpu -L gpu -LE multigpu -V >> "$logs/checks_gpu.log" 2>&1
    fi
    grep -E "  FAIL  |tests passed|Timeout|Failed|skipped" "$logs/checks_gpu.log" | cut -c1-300 | head -60
    if [ -n "${GREP:-}" ]; then grep -E "$GREP" "$logs/checks_gpu.log" | cut -c1-300 | head -60; fi
  fi
  ;;

lean)
  export CUDA_VISIBLE_DEVICES=0
  # LEAN_SETS="ANCHOR=CONFIGS;...": several side-by-sides in one call (files tagged _1, _2, ...).
  sets="${LEAN_SETS:-${ANCHOR:-diffusers_sdxl_sd3.py}=${LEAN_CONFIGS:-sdxl-1024}}"
  IFS=';' read -ra lean_sets <<< "$sets"
  k=0
  for set in "${lean_sets[@]}"; do
    tag=""
    [ ${#lean_sets[@]} -gt 1 ] && k=$((k + 1)) && tag="_$k"
    timeout "${ANCHOR_S:-150}" python3 ".carry/${set%%=*}" > "$logs/anchor$tag.log" 2>&1
    echo "anchor ${set%%=*} rc $? at $(elapsed) s"
    timeout "$(left 3)" "$bench" --device cuda:0 --config "${set#*=}" --batch 1 --runs 2 \
      ${LEAN_STRATEGIES:+--strategies "$LEAN_STRATEGIES"} > "$logs/bench_single$tag.json" 2> "$logs/bench_single$tag.log"
    echo "single-GPU bench ${set#*=} rc $? at $(elapsed) s"
    ratios "$tag"
    python3 - "$logs/bench_single$tag.json" <<'PY'
import json, sys
try:
    results = json.load(open(sys.argv[1]))["results"]
except Exception:
    sys.exit(0)
for r in results:
    for s in r.get("strategies", []):
        steps = s.get("step_ms", [])
        print(f"{r['config']} {s['spec']}: e2e {s['end_to_end_ms']:.1f} ms (x{s['speedup_end_to_end']:.3f}), "
              f"step mean {sum(steps) / max(1, len(steps)):.2f} ms against {r['denoiser_step_ms']['mean']:.2f}, "
              f"PSNR {s['psnr_db'] or float('inf'):.1f} dB, SSIM {s['ssim']:.4f}, rel-L2 {s['latents_rel_l2']:.4f}")
PY
  done
  ;;

solo)
  export CUDA_VISIBLE_DEVICES=0
  # SOLO_PLAN="CONFIG=STRATEGIES;CONFIG=STRATEGIES...": each config its own strategies.
  plan_entries="${SOLO_PLAN:-}"
  if [ -z "$plan_entries" ]; then
    for c in $(echo "${SOLO_CONFIGS:-flux-1024,sd3-1024}" | tr ',' ' '); do
      plan_entries="$plan_entries;$c=${SOLO_STRATEGIES:-fbcache}"
    done
  fi
  IFS=';' read -ra entries <<< "$plan_entries"
  for e in "${entries[@]}"; do
    [ -n "$e" ] || continue
    strategy_bench "solo_${e%%=*}" "${e%%=*}" 1 "${e#*=}"
  done
  ;;

lora)
  export CUDA_VISIBLE_DEVICES=0
  RANK="${RANK:-32}" timeout 240 python3 tests/gpu/diffusers_sdxl_lora.py > "$logs/anchor_lora.log" 2>&1
  echo "lora anchor rc $? at $(elapsed) s"
  timeout "$(left 3)" "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 1 --lora-rank "${RANK:-32}" \
    --scratch /tmp/diffract-bench > "$logs/bench_lora.json" 2> "$logs/bench_lora.log"
  echo "lora bench rc $? at $(elapsed) s"
  python3 - "$logs" <<'PY'
import json, sys
d = sys.argv[1]
anchor = {k: float(v) for _, k, v in (l.split(" ", 2) for l in open(f"{d}/anchor_lora.log") if l.startswith("RES "))}
print("anchor", anchor)
try:
    r = json.load(open(f"{d}/bench_lora.json"))["results"][0]["lora"]
except Exception as e:
    print("no bench JSON:", e); sys.exit(0)
print("ours", json.dumps(r))
for name, ours, theirs in (("apply (read + patch) vs load + fuse", r["apply_ms"] / 1e3, anchor.get("load_and_fuse_s")),
                           ("switch weight", r["switch_ms"] / 1e3, anchor.get("switch_s")),
                           ("remove", r["remove_ms"] / 1e3, anchor.get("remove_s"))):
    if theirs:
        print(f"{name:40s} ours {ours:7.3f} s diffusers {theirs:7.3f} s ratio {ours / theirs:6.3f}")
PY
  ;;

controlnet)
  export CUDA_VISIBLE_DEVICES=0
  if [ "${CN_DEBUG:-0}" = 1 ]; then
    # The caller of a jump to address 0 is the return address on top of the stack.
    timeout 150 cuda-gdb -batch -ex "set pagination off" -ex run -ex "x/12a \$sp" -ex "info symbol *(long*)\$sp" \
      -ex "thread apply 1 bt 30" --args "$bench" --device cuda:0 --config tiny --batch 1 --runs 1 --controlnet -v \
      --scratch /tmp/diffract-bench-debug > "$logs/debug_controlnet.log" 2>&1
    echo "debug rc $? at $(elapsed) s"
    grep -E "SIGSEGV|signal|^#[0-9]+ |^0x|in section|No symbol" "$logs/debug_controlnet.log" | grep -v gomp | head -40
    grep -v "New Thread\|exited\|gomp" "$logs/debug_controlnet.log" | grep "diffract\." | tail -8 | cut -c1-250
    # CN_VARIANTS: ';'-separated environment settings, each a run of the tiny config without the debugger.
    IFS=';' read -ra variants <<< "${CN_VARIANTS:-}"
    for v in "${variants[@]}"; do
      env $v timeout 120 "$bench" --device cuda:0 --config tiny --batch 1 --runs 1 --controlnet \
        --scratch /tmp/diffract-bench-debug > "$logs/variant.json" 2> "$logs/variant.log"
      echo "variant [$v] rc $? at $(elapsed) s"
    done
  fi
  : > "$logs/anchor_controlnet.log"
  if [ "${CN_ANCHOR:-1}" = 1 ]; then
    timeout 300 python3 tests/gpu/diffusers_sdxl_controlnet.py > "$logs/anchor_controlnet.log" 2>&1
    echo "controlnet anchor rc $? at $(elapsed) s"
  fi
  [ "${CN_BENCH:-1}" = 1 ] || exit 0
  timeout "$(left 3)" "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 3 --controlnet \
    --scratch /tmp/diffract-bench > "$logs/bench_controlnet.json" 2> "$logs/bench_controlnet.log"
  echo "controlnet bench rc $? at $(elapsed) s"
  python3 - "$logs" <<'PY'
import json, sys
d = sys.argv[1]
anchor = {k: float(v) for _, k, v in (l.split(" ", 2) for l in open(f"{d}/anchor_controlnet.log") if l.startswith("RES "))}
print("anchor", anchor)
try:
    r = json.load(open(f"{d}/bench_controlnet.json"))["results"][0]
except Exception as e:
    print("no bench JSON:", e); sys.exit(0)
c = r["controlnet"]
print("ours", json.dumps(c))
print(f"ControlNet job end to end: ours {c['end_to_end_ms'] / 1e3:.3f} s, diffusers {anchor.get('controlnet_s', 0):.3f} s")
print(f"step with / without ControlNet: {c['step_ms']:.2f} / {c['plain_step_ms']:.2f} ms = {c['step_ratio']:.3f} (target <= 1.5)")
PY
  ;;

image)
  export CUDA_VISIBLE_DEVICES=0
  STRENGTH="${STRENGTH:-0.6}" timeout 240 python3 tests/gpu/diffusers_sdxl_image_inputs.py > "$logs/anchor_image.log" 2>&1
  echo "image anchor rc $? at $(elapsed) s"
  timeout "$(left 3)" "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 3 --image-inputs "${STRENGTH:-0.6}" \
    > "$logs/bench_image.json" 2> "$logs/bench_image.log"
  echo "image bench rc $? at $(elapsed) s"
  python3 - "$logs" <<'PY'
import json, sys
d = sys.argv[1]
anchor = {k: float(v) for _, k, v in (l.split(" ", 2) for l in open(f"{d}/anchor_image.log") if l.startswith("RES "))}
print("anchor", anchor)
try:
    r = json.load(open(f"{d}/bench_image.json"))["results"][0]
except Exception as e:
    print("no bench JSON:", e); sys.exit(0)
im = r["image_inputs"]
print("ours: txt2img e2e", r["end_to_end_ms"]["median"], "step", round(r["denoiser_step_ms"]["mean"], 3), json.dumps(im))
rows = [("text-to-image end to end (s)", r["end_to_end_ms"]["median"] / 1e3, anchor.get("txt2img_s")),
        ("img2img end to end (s)", im["img2img"]["end_to_end_ms"] / 1e3, anchor.get("img2img_s")),
        ("inpaint end to end (s)", im["inpaint"]["end_to_end_ms"] / 1e3, anchor.get("inpaint_s"))]
for name, a, b in rows:
    if b:
        print(f"{name:32s} ours {a:8.3f} diffusers {b:8.3f} ratio {a / b:6.3f}")
print("inpainting added to denoising:", round(im["inpaint"]["added_to_denoising_pct"], 2), "%")
PY
  ;;

ab)
  # One after the other on the same GPU: runs on two GPUs at once share the host CPU, which
  # the eager parts of a job feel, so they would not compare.
  # An AB_VALUES entry holding "=" is a set of settings of its own, e.g.
  # AB_VALUES="DIFFRACT_X=1,DIFFRACT_Y=0 DIFFRACT_X=0,DIFFRACT_Y=0" (AB_VAR unused).
  case "${AB_VALUES:-}" in *=*) ;; *) : "${AB_VAR:?set AB_VAR (and AB_VALUES, e.g. \"1 0\")}" ;; esac
  export CUDA_VISIBLE_DEVICES=0
  AB_CONFIG="${AB_CONFIG:-sdxl-1024}"
  if [ -n "${CHECKS:-}" ] && [ -z "${SKIP_CHECKS:-}" ]; then checks checks_ab "$CHECKS" 150 "${GREP:-rel-L2}"; fi
  run=0
  for config in ${AB_CONFIG//,/ }; do
  for value in ${AB_VALUES:-1 0}; do
    run=$((run + 1))
    case "$value" in *=*) settings=(${value//,/ }) ;; *) settings=("$AB_VAR=$value") ;; esac
    label="$config ${settings[*]}"
    [ "$(left)" -gt "${AB_MIN_LEFT:-70}" ] || { echo "no time left for $label"; break 2; }
    env "${settings[@]}" timeout "$(left 2)" "$bench" --device cuda:0 --config "$config" --batch 1 --runs 2 \
      ${AB_STRATEGIES:+--strategies "$AB_STRATEGIES"} > "$logs/bench_$run.json" 2> "$logs/bench_$run.log"
    echo "$label rc $? at $(elapsed) s"
    python3 - "$logs/bench_$run.json" "$label" <<'PY'
import json, os, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
except Exception as e:
    print(sys.argv[2], "no JSON:", e); sys.exit(0)
print(sys.argv[2], "e2e", r["end_to_end_ms"]["median"], "step", round(r["denoiser_step_ms"]["mean"], 3),
      "vae", r.get("vae_decode_ms"), "peak GiB", r.get("peak_vram_gib"), "repeatable", r.get("repeatable"))
# Batch 2 is both CFG branches (one GPU's step), batch 1 one branch (a CFG-parallel rank's).
for name in ("unet_step_variants", "unet_step_variants_one_branch"):
    v = r.get(name, {})
    k = v.get("kernels_channels_last", {})
    print("  ", name, {a: round(b, 3) for a, b in v.items() if a.endswith("_ms")},
          "device", k.get("device_ms_per_call"), "kernels", k.get("kernels_per_call"))
    print("     families:", {a: round(b, 3) for a, b in k.get("families_ms", {}).items()})
    for t in k.get("top_by_op", [])[:int(os.environ.get("AB_OPS") or 0)]:
        print(f"      {t[1]:7.3f} {t[2]:>5} {t[0][:230]}")
# AB_STRATEGIES' runs (e.g. single@DIFFRACT_PRECISION=fp8) against this process's plain job.
for s in r.get("strategies", []):
    steps = s.get("step_ms") or []
    print("   strategy", s.get("spec"), "e2e", round(s.get("end_to_end_ms", 0), 1),
          "step", round(sum(steps) / len(steps), 3) if steps else None, "speed-up", round(s.get("speedup_end_to_end", 0), 3),
          "PSNR", s.get("psnr_db"), "SSIM", s.get("ssim"), "rel-L2", s.get("latents_rel_l2"))
if "fp8_rows" in r:
    print("   fp8 rows", r["fp8_rows"], "GEMMs kept in fp8:",
          sum(1 for g in r.get("fp8_gemms", []) if g.get("fp8")), "of", len(r.get("fp8_gemms", [])))
# The DiTs (SD3: batch 2, Flux: batch 1): one transformer step, eager and graphed, profiled eager.
t = r.get("transformer_step_profile")
if t:
    k = t.get("kernels", {})
    print("   transformer step: eager", round(t.get("eager_ms", 0), 3), "graph", round(t.get("graph_ms", 0), 3),
          "device", k.get("device_ms_per_call"), "kernels", k.get("kernels_per_call"))
    print("     families:", {a: round(b, 3) for a, b in k.get("families_ms", {}).items()})
    for e in k.get("top_by_op", [])[:int(os.environ.get("AB_OPS") or 0)]:
        print(f"      {e[1]:7.3f} {e[2]:>5} {e[0][:230]}")
PY
  done
  done
  ;;

pair)
  # The VAE decode overlapped over both GPUs and DRiffusion without its paired rounds, each
  # beside the default in the same run.
  if [ -z "${SKIP_CHECKS:-}" ]; then
    checks checks_pair "gpu_(nccl|strategies|parallel_vae|sd3|cancel|failure|cfg_pipefusion|oom_parallel)$" 150 \
      "rel-L2|rounds|paired|overlapped|decode|out of memory|cancelled"
  fi
  o=@DIFFRACT_PARALLEL_VAE=overlap
  sd3="${SD3_STRATEGIES-cfg-parallel,pipefusion:2}"
  BENCH_RUNS=3 strategy_bench sdxl sdxl-1024 1 \
    "${PAIR_STRATEGIES:-cfg-parallel,cfg-parallel$o,driffusion-aggressive:2@DIFFRACT_DRIFFUSION_PAIRS=0,driffusion-aggressive:2,driffusion-aggressive:2$o,driffusion:2$o,hybrid-cfg$o,hybrid-cfg}" \
    "$(left "${sd3:+120}")"
  if [ -n "$sd3" ] && [ "$(left)" -gt 60 ]; then strategy_bench sd3 sd3-1024 1 "$sd3"; fi
  ;;

wide)
  # gpu_wide runs 4 ranks, and 8 on an 8-GPU machine; the strategies' :N say how many GPUs.
  nvidia-smi topo -m > "$logs/topo.txt" 2>&1
  head -10 "$logs/topo.txt"
  if [ -z "${SKIP_CHECKS:-}" ]; then checks checks_wide "gpu_nccl|gpu_wide|gpu_cfg_pipefusion" 150 "rel-L2|rounds"; fi
  strategy_bench sdxl sdxl-1024 1 \
    "${WIDE_STRATEGIES:-cfg-parallel,driffusion-aggressive:2,driffusion-aggressive:4,driffusion:4,cfg-driffusion-aggressive:4,cfg-driffusion:4,distrifusion:4,asyncdiff:4}" 170
  strategy_bench batch8 sdxl-1024 8 "${BATCH_STRATEGIES:-data-parallel:4,data-parallel:2}" 150
  if [ "$(left)" -gt 100 ]; then
    strategy_bench sd3 sd3-1024 1 \
      "${SD3_STRATEGIES:-cfg-parallel,pipefusion:4,cfg-pipefusion:4,driffusion-aggressive:4,cfg-driffusion-aggressive:4}"
  fi
  # At 2048² the row-band VAE decode is on by default (3 MP or more).
  if [ "$(left)" -gt 120 ]; then
    BENCH_RUNS=1 strategy_bench big sdxl-2048 1 \
      "${BIG_STRATEGIES:-cfg-driffusion-aggressive:4,driffusion-aggressive:4,distrifusion:4,hybrid-cfg}"
  fi
  ;;

lanes)
  export CUDA_VISIBLE_DEVICES=0
  size="${LANE_SIZE:-256}"
  for setup in $(echo "${LANE_SETUPS:-steps-30-20-12,samplers-at-20-steps,baseline-vs-driffusion-vs-step-skip}" | tr ',' ' '); do
    timeout "$(left 5)" build/gpu/app/diffract-cli lanes "$setup" --device cuda:0 --model "${LANE_MODEL:-resources/models/diffract-emoji}" \
      --prompt "${LANE_PROMPT:-a red apple on a light blue background}" --seed 3 --width "$size" --height "$size" \
      --out-dir "$logs/lanes_$setup" > "$logs/lanes_$setup.log" 2>&1
    echo "lanes $setup rc $? at $(elapsed) s"
    grep -vE "^\[|\) started$" "$logs/lanes_$setup.log" | cut -c1-200 | head -20
  done
  ;;

tree)
  wait "$tree_build" || { echo "the other tree did not build:"; grep -m20 -A5 error "$logs/tree_build.log" "$logs/tree_configure.log"; exit 1; }
  echo "other tree built at $(elapsed) s"
  [ -n "${TREE_BUILD_ONLY:-}" ] && exit 0
  export CUDA_VISIBLE_DEVICES=0
  for round in 1 2; do
    for side in before after; do
      [ "$(left)" -gt 60 ] || { echo "no time left for $side $round"; break 2; }
      exe="$bench"; [ "$side" = before ] && exe="$tree/build/gpu/app/diffract-bench"
      timeout "$(left 5)" "$exe" --device cuda:0 --config "${TREE_CONFIGS:-sdxl-1024,sd3-1024}" --batch 1 --runs 2 \
        > "$logs/tree_${side}_$round.json" 2> "$logs/tree_${side}_$round.log"
      echo "$side $round rc $? at $(elapsed) s"
      python3 - "$logs/tree_${side}_$round.json" "$side $round" <<'PY'
import json, sys
try:
    results = json.load(open(sys.argv[1]))["results"]
except Exception as e:
    print(sys.argv[2], "no JSON:", e); sys.exit(0)
for r in results:
    print(sys.argv[2], r["config"], "e2e", round(r["end_to_end_ms"]["median"], 1), "step", round(r["denoiser_step_ms"]["mean"], 3),
          "vae", round(r.get("vae_decode_ms", 0), 1), "peak GiB", r.get("peak_vram_gib"), "repeatable", r.get("repeatable"))
PY
    done
  done
  ;;

sizes)
  export CUDA_VISIBLE_DEVICES=0
  [ -z "${CHECKS:-}" ] || checks checks "$CHECKS" 150 "${GREP:-}"
  store=/tmp/diffract-tuning
  rm -rf "$store"
  for run in ${SIZES_RUNS:-benchmark-mode empty-store stored untuned}; do
    extra=()
    [[ "$run" == *@* ]] && IFS='@' read -ra extra <<< "${run#*@}"
    case "${run%%@*}" in
      benchmark-mode) env=(DIFFRACT_CONV_TUNING=benchmark DIFFRACT_TUNING_STORE=0) ;;
      untuned) env=(DIFFRACT_CONV_TUNING=heuristic DIFFRACT_GEMM_TUNING=0 DIFFRACT_TUNING_STORE=0) ;;
      *) env=(DIFFRACT_TUNING_DIR="$store") ;;
    esac
    env "${env[@]}" "${extra[@]}" timeout "$(left 5)" "$bench" --device cuda:0 --config "${SIZES_CONFIGS:-sdxl-1024}" --runs 2 \
      --new-sizes "${SIZES:-1152x896,768x768,1344x768}" > "$logs/sizes_$run.json" 2> "$logs/sizes_$run.log"
    echo "$run rc $? at $(elapsed) s"
    python3 - "$logs/sizes_$run.json" "$run" <<'PY'
import json, sys
try:
    results = json.load(open(sys.argv[1]))["results"]
except Exception as e:
    print(sys.argv[2], "no JSON:", e); sys.exit(0)
def brief(t):
    return ", ".join(f"{k} {v['timed']} timed / {v['from_store']} stored / {v['ms']:.0f} ms" for k, v in t.items())
for r in results:
    print(f"{sys.argv[2]} {r['config']}: warm-up {r['warm_up_ms']:.0f} ms ({brief(r['warm_up_tuning'])})")
    for s in r["sizes"]:
        g = s.get("unet_graphs", {})
        print(f"  {s['size']}: first {s['first_image_ms']:.0f} ms, later {s['later_ms']:.0f} ms, added {s['added_ms']:.0f} ms, "
              f"capture {g.get('last_capture_ms', 0):.0f} ms, repeatable {s.get('repeatable')}; {brief(s['tuning'])}")
        c = g.get("last_capture")
        if c:
            print(f"    {c['warmups']} eager calls {c['warm_up_ms']:.0f} ms (host), capture {c['capture_ms']:.0f} ms, "
                  f"redone {c['redone']}")
    plans = r.get("conv_plans", [])
    bench = [p for p in plans if p["plan"] == "benchmark"]
    print(f"  conv plans: {len(plans)} shapes, {len(bench)} benchmarked; gain where kept: "
          + ", ".join(f"{p['heuristic_ms']:.3f}->{p['benchmark_ms']:.3f}" for p in bench[:12]))
    print("  stores:", json.dumps(r["tuning_stats"].get("stores")))
PY
  done
  ls -la "$store"
  ;;

*) echo "unknown PLAN=$plan (checks, lean, image, lora, controlnet, ab, pair, wide, solo, lanes, tree, sizes)" >&2; exit 2 ;;
esac
done
