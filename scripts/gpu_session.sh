#!/usr/bin/env bash
# A session's GPU work on a 2-GPU machine (nvidia-h200-x2), as two calls of under 10 minutes
# made back to back on the same warm machine (its build/ folder survives between them):
#   PLAN=single (first call): builds the tools; the second GPU trains the emoji model while the
#     first runs the diffusers anchor, then diffract-bench in the same run (ratios side by side),
#     the kernel profiles of both UNet steps and the single-GPU checks.
#   PLAN=multi (second call): the multi-GPU checks and the strategy bench on both GPUs, then the
#     second GPU resumes training while the first benches sdxl-768 and batch 4.
#   PLAN=one (one H200, no training): the GroupNorm kernel check, the diffusers anchor, then
#     diffract-bench on the same GPU (side by side in one run), the single-GPU checks, batch 4.
#   PLAN=multi2 (two GPUs, no training, no anchor): the single-GPU bench on the first GPU, then the
#     multi-GPU checks and the strategy bench (hybrid last, its NCCL stale window on).
#   PLAN=short (two GPUs, what a few minutes allow): the 2-GPU strategy check, then the strategy
#     bench for BENCH_STRATEGIES (default asyncdiff:2,cfg-parallel) against our one GPU.
#   PLAN=hang (two GPUs): why AsyncDiff / hybrid CFG's point-to-point strategies hang on NCCL at
#     SDXL 1024²: the same bench under settings that each remove one suspect (HANG_CASES), each
#     cut off after HANG_TIMEOUT s; a hung run's last NCCL operations per rank and, where
#     cuda-gdb can attach, its threads' stacks go to the logs.
#   PLAN=three (two GPUs): the 2-GPU strategy and cfg-pipefusion checks, the SDXL bench of the eager strategies
#     (DistriFusion, AsyncDiff, hybrid) with their time split, SD3 eager against graphed, and
#     SDXL 2048² with the patch strategies if time is left.
#   PLAN=two (two GPUs): the SDXL strategy bench (SDXL_STRATEGIES), then PLAN=sd3's work, then
#     the multi-GPU checks if time is left.
#   PLAN=sd3 (two GPUs, not run yet): our sd3-1024 bench on the first GPU beside the anchor on
#     the second, then SD3's strategies (cfg-parallel, pipefusion, DRiffusion) on both.
#   PLAN=final (a later, shorter call, no training; carry .carry without emoji/): the single-GPU
#     bench on the first GPU beside the anchor on the second, then the multi-GPU checks and the
#     strategy bench.
# Leaves in $OUT: logs.tar (every log and JSON) and the exported model as
# diffract-emoji.tar.part-* (join with cat, then tar -x).
#   Carried in .carry/ (scripts/prepare_carry.sh): CLI11 headers, shared data, the emoji atlas,
#   the anchor script and the diffusers wheel.
#   END_S (default 560): the second by which everything must be done; training gets what is left.
#   TRAIN_SCHEDULE_MINUTES (default 11.5): the cosine LR's length over both calls.
set -uo pipefail
export PYTHONUNBUFFERED=1
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( ${END_S:-560} - $(elapsed) - ${1:-0} )); }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
source scripts/gpu_common.sh
plan="${PLAN:-single}"
out="${OUT:-/tmp/gpu_session}"
logs=/tmp/gpu_session_logs/$plan
mkdir -p "$out" "$logs"
finish() {
  tar -C /tmp/gpu_session_logs -cf "$out/logs.tar" .
  ls -la "$out"
  echo "done at $(elapsed) s"
}
trap finish EXIT

gpu_python_packages
gpu_info "$logs/gpu.txt"
gpu_build "$logs" diffract-bench diffract-gpu-checks diffract-train || exit 1
echo "built at $(elapsed) s"
bench=build/gpu/app/diffract-bench

# train GPU MINUTES [--resume]: the emoji model on one GPU in the background; $trainer is its pid.
train() {
  local gpu="$1" minutes="$2"
  shift 2
  echo "training for $minutes minutes on GPU $gpu $*"
  (
    CUDA_VISIBLE_DEVICES=$gpu build/gpu/app/diffract-train train --device cuda:0 --atlas .carry/emoji \
      --holdout resources/training/holdout.tsv --shared .carry/shared --out build/gpu-train --minutes "$minutes" \
      --schedule-minutes "${TRAIN_SCHEDULE_MINUTES:-11.5}" --batch "${TRAIN_BATCH:-1024}" --lr "${TRAIN_LR:-6e-4}" \
      --log-every 100 "$@" >> "$logs/train.log" 2>&1
    echo "trainer rc $?" >> "$logs/train.log"
    cp build/gpu-train/loss.csv build/gpu-train/summary.json "$logs/" 2>/dev/null
    tar -C build/gpu-train -cf - model | split -b 15M - "$out/diffract-emoji.tar.part-"
  ) &
  trainer=$!
}
# Training gets what is left but 80 s (bank encoding before; checkpoint, export and evaluation after).
train_minutes() { python3 -c "print(round(max(0.5, ($(left 80)) / 60), 2))"; }

ratios() {
python3 - "$logs" <<'PY'
import json, sys
d = sys.argv[1]
try:
  ours = json.load(open(f"{d}/bench_single.json"))
except Exception as e:
  print("no single-GPU bench JSON:", e); sys.exit(0)
anchor = json.load(open(f"{d}/anchor.json"))
for r in ours["results"]:
  print(json.dumps({k: v for k, v in r.items() if k != "unet_step_variants"}))
  v = r.get("unet_step_variants", {})
  print("  step variants:", {k: v[k] for k in v if not k.startswith("kernels")})
  for name in ("kernels", "kernels_channels_last"):
      if name in v:
          print(f"  {name}:", json.dumps({k: v[name][k] for k in ("device_ms_per_call", "kernels_per_call", "families_ms")}))
          print("    top:", json.dumps(v[name]["top_ms"][:12])[:1500])
x = next((r for r in ours["results"] if r["config"] == "sdxl-1024"), None)
if x and anchor:
  rows = [("SDXL 1024 30 steps end to end (s)", x["end_to_end_ms"]["median"] / 1e3, anchor.get("pipe_sdxl_1024_30steps_pil_bf16vae_s")),
          ("denoiser step batch 2 (ms)", x["denoiser_step_ms"]["mean"], anchor.get("unet_step_b2_ms")),
          ("denoiser step vs diffusers graph (ms)", x["denoiser_step_ms"]["mean"], anchor.get("unet_step_b2_cudagraph_ms")),
          ("VAE decode 1024 (ms)", x["vae_decode_ms"], anchor.get("vae_decode_bf16_ms")),
          ("peak VRAM (GiB)", x.get("peak_vram_gib", 0), anchor.get("pipe_mem_GiB"))]
  print(f"{'figure':40s} {'ours':>10s} {'diffusers':>10s} {'ratio':>7s}")
  for name, a, b in rows:
      if isinstance(b, float) and b: print(f"{name:40s} {a:10.3f} {b:10.3f} {a / b:7.3f}")
PY
}

# anchor_json: the RES lines of anchor.log as anchor.json (a cut-off anchor still gives what it reached).
anchor_json() {
  python3 -c "
import json
r = {}
for line in open('$logs/anchor.log'):
    if line.startswith('RES '):
        _, k, v = line.split(' ', 2)
        try:
            r[k] = float(v)
        except ValueError:
            r[k] = v.strip()
json.dump(r, open('$logs/anchor.json', 'w'))
print('anchor', r)"
}

# strategies: the multi-GPU checks, then the strategy bench against our one GPU.
strategies() {
  multigpu_checks
  strategy_bench "$@"
}
multigpu_checks() {
  ctest --test-dir build/gpu -L multigpu -V --timeout 45 > "$logs/checks_multigpu.log" 2>&1
  grep -E "  (ok|FAIL)  |skipped|tests passed|Timeout|rel-L2|rounds|error:|steps reported|stale" "$logs/checks_multigpu.log"
  echo "multi-GPU checks done at $(elapsed) s"
}
strategy_bench() { strategy_bench_batch 1 "$@"; }
# strategy_bench_batch BATCH [TIMEOUT]: strategy_bench for BATCH images per prompt.
strategy_bench_batch() {
  local tag="${BENCH_TAG:-strategies}" batch="$1"
  shift
  timeout "${1:-180}" "$bench" --device cuda:0 --config "${BENCH_CONFIG:-sdxl-1024}" --batch "$batch" --runs "${BENCH_RUNS:-3}" \
    --strategies "${BENCH_STRATEGIES:-cfg-parallel,driffusion-aggressive:2,driffusion:2,step-skip:2,hybrid-cfg}" \
    > "$logs/bench_$tag.json" 2> "$logs/bench_$tag.log"
  echo "strategy bench ($tag) rc $? at $(elapsed) s"
  python3 - "$logs/bench_$tag.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no strategy JSON:", e); sys.exit(0)
for x in r["results"]:
    print(f"  {x['config']} batch {x['batch']}, one GPU: e2e {x['end_to_end_ms']['median']:.1f} ms, {x.get('images_per_s', 0):.3f} images/s")
    for s in x.get("strategies", []):
        print(f"  {s.get('spec', s['strategy'] + ':' + str(s['n']))} {s.get('images_per_s', 0):.3f} img/s e2e {s['end_to_end_ms']:7.1f} ms  speed-up e2e {s['speedup_end_to_end']:.2f}x "
              f"denoise {s['speedup_denoising']:.2f}x  PSNR {s['psnr_db'] or float('inf'):.1f} dB  SSIM {s['ssim']:.4f}  rel-L2 {s['latents_rel_l2']:.4f}"
              f"  {s.get('stats', {}).get('note', '')[:150]}")
PY
}

if [ "$plan" = one ]; then
  export CUDA_VISIBLE_DEVICES=0
  if [ -z "${SKIP_GROUPNORM:-}" ]; then
    ctest --test-dir build/gpu -R gpu_groupnorm -V --timeout 60 > "$logs/checks_groupnorm.log" 2>&1
    grep -E "  (ok|FAIL)  |tests passed" "$logs/checks_groupnorm.log" | grep -v "^.*ok.*diff" | head -30
    grep -c "  ok  " "$logs/checks_groupnorm.log"
  fi
  timeout 220 python3 .carry/diffusers_sdxl_sd3.py > "$logs/anchor.log" 2>&1
  echo "anchor rc $? at $(elapsed) s"
  anchor_json
  timeout "$(left 90)" "$bench" --device cuda:0 --config sdxl-1024,sd15-512 --batch 1 --runs 3 \
    > "$logs/bench_single.json" 2> "$logs/bench_single.log"
  echo "single-GPU bench rc $? at $(elapsed) s"
  ratios
  ctest --test-dir build/gpu -L gpu -LE multigpu -E gpu_groupnorm -V --timeout 45 > "$logs/checks_single.log" 2>&1
  grep -E "  (ok|FAIL)  |tests passed|capture|previews shown" "$logs/checks_single.log"
  if [ "$(left)" -gt 60 ]; then
    timeout "$(left 5)" "$bench" --device cuda:0 --config sdxl-1024 --batch 4 --runs 2 \
      > "$logs/bench_batch4.json" 2> "$logs/bench_batch4.log"
    echo "batch-4 bench rc $? at $(elapsed) s"
    python3 -c "
import json
for r in json.load(open('$logs/bench_batch4.json'))['results']:
    print(json.dumps({k: v for k, v in r.items() if k != 'unet_step_variants'}))" 2>&1 | cut -c1-900
  fi
  exit 0
fi

# hang_case NAME ENV...: the strategy bench for $HANG_STRATEGIES under extra environment settings.
hang_case() {
  local name="$1"
  shift
  echo "== $name: $* at $(elapsed) s"
  env DIFFRACT_NCCL_TRACE=1 "$@" "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 1 \
    --strategies "${HANG_STRATEGIES:-cfg-parallel,asyncdiff:2}" > "$logs/hang_$name.json" 2> "$logs/hang_$name.log" &
  local pid=$! waited=0
  while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "${HANG_TIMEOUT:-75}" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 "$pid" 2>/dev/null; then
    echo "   still running after ${waited} s: hung"
    if command -v cuda-gdb > /dev/null; then
      timeout 40 cuda-gdb -p "$pid" -batch -ex "thread apply all bt 30" > "$logs/hang_${name}_stacks.txt" 2>&1
      grep -E "^Thread|^#[0-9]+ .* in (nccl|cuda|cu[A-Z]|c10|at::|diffract|pthread|std::)" "$logs/hang_${name}_stacks.txt" \
        | grep -vE "^#[0-9]+ .* in (std::__|pthread_cond)" | cut -c1-160 | head -60
    fi
    kill -9 "$pid"
    wait "$pid" 2>/dev/null
    grep "\[nccl\]" "$logs/hang_$name.log" | tail -8 | cut -c1-160
  else
    wait "$pid"
    echo "   rc $? after ${waited} s"
  fi
  grep -o '{"denoising_ms.*' "$logs/hang_$name.log" | python3 -c "
import json, sys
for line in sys.stdin:
    s = json.loads(line)
    print('   %-14s e2e %.1f ms  x%.2f e2e  x%.2f denoise  PSNR %.1f dB' % (s['strategy'], s['end_to_end_ms'], s['speedup_end_to_end'],
          s['speedup_denoising'], s['psnr_db']))"
  grep -E "error|Error" "$logs/hang_$name.log" | head -3 | cut -c1-300
}

if [ "$plan" = hang ]; then
  for c in ${HANG_CASES:-plain p2p_off malloc_async runtime_connect_off}; do
    [ "$(left 30)" -gt 60 ] || break
    case "$c" in
      plain) hang_case plain ;;
      p2p_off) hang_case p2p_off NCCL_P2P_DISABLE=1 ;;
      malloc_async) hang_case malloc_async PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync ;;
      runtime_connect_off) hang_case runtime_connect_off NCCL_RUNTIME_CONNECT=0 ;;
      sync_each) hang_case sync_each DIFFRACT_NCCL_TRACE=2 ;;
      hybrid) HANG_STRATEGIES=hybrid-cfg hang_case hybrid ${HYBRID_ENV:-} ;;
    esac
  done
  exit 0
fi

# strategy_split FILE: each strategy's warm-up, loop, text, VAE and first / last steps.
strategy_split() {
  python3 - "$1" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no strategy JSON:", e); sys.exit(0)
for x in r["results"]:
    print(f"  one GPU: e2e {x['end_to_end_ms']['median']:.1f} ms, step {x['denoiser_step_ms']['mean']:.2f} ms, text {x['text_encode_ms']:.2f} ms, vae {x['vae_decode_ms']:.1f} ms")
    for s in x.get("strategies", []):
        st = s.get("stats", {})
        steps = s.get("step_ms", [])
        print(f"  {s.get('spec', s['strategy'])}: warm {st.get('warm_ms', 0):.0f} ms, loop {st.get('loop_ms', 0):.0f} ms, text {s.get('text_encode_ms', 0):.1f}, "
              f"vae {s.get('vae_decode_ms', 0):.1f}, rounds {st.get('rounds')} (paired {st.get('paired_rounds', 0)}), steps {len(steps)}: {[round(v, 1) for v in steps]}")
        print(f"    outside the loop: before the call {st.get('before_call_ms', 0):.2f} ms, set-up {st.get('setup_ms', 0):.2f}, "
              f"finish {st.get('finish_ms', 0):.2f}, call - loop {st.get('call_ms', 0) - st.get('loop_ms', 0):.2f}, "
              f"after the call {st.get('after_call_ms', 0):.2f}")
PY
}

# big_bench MIN_LEFT STRATEGIES: SDXL 2048², one run each, BIG_STRATEGIES (default STRATEGIES)
# against our one GPU, with their time split; only if more than MIN_LEFT seconds are left.
big_bench() {
  [ "$(left)" -gt "$1" ] || return 0
  BENCH_CONFIG=sdxl-2048 BENCH_TAG=big BENCH_RUNS=1 BENCH_STRATEGIES="${BIG_STRATEGIES:-$2}" strategy_bench "$(left 5)"
  strategy_split "$logs/bench_big.json"
}

#   PLAN=kernels (one GPU, no anchor): the GEGLU and graph checks, then the single-GPU bench.
if [ "$plan" = kernels ]; then
  export CUDA_VISIBLE_DEVICES=0
  ctest --test-dir build/gpu -R "gpu_geglu|gpu_graphs" -V --timeout 90 > "$logs/checks_kernels.log" 2>&1
  grep -E "  (ok|FAIL)  |tests passed|worst|fused|Timeout" "$logs/checks_kernels.log" | cut -c1-300
  timeout "$(left 5)" "$bench" --device cuda:0 --config sdxl-1024,sd15-512 --batch 1 --runs 2 \
    > "$logs/bench_single.json" 2> "$logs/bench_single.log"
  echo "single-GPU bench rc $? at $(elapsed) s"
  python3 -c "
import json
for r in json.load(open('$logs/bench_single.json'))['results']:
    print(json.dumps({k: v for k, v in r.items() if not k.startswith('unet_step_variants')}))
    v = r.get('unet_step_variants', {}).get('kernels_channels_last', {})
    print('  kernels:', v.get('device_ms_per_call'), v.get('families_ms'))" 2>&1 | cut -c1-1500
  exit 0
fi

# checks LOG REGEX [TIMEOUT] [MORE]: the GPU checks matching REGEX into $logs/LOG.log, their
# verdict lines printed (and the lines matching MORE).
checks() {
  ctest --test-dir build/gpu -R "$2" -V --timeout "${3:-90}" > "$logs/$1.log" 2>&1
  grep -E "  FAIL  |tests passed|Timeout|Failed|Passed" "$logs/$1.log" | cut -c1-300 | head -40
  echo "  ($(grep -c '  ok  ' "$logs/$1.log") ok lines)"
  [ -n "${4:-}" ] && grep -E "$4" "$logs/$1.log" | grep -v "  FAIL  " | cut -c1-300 | head -60
}
# plan_checks: checks with the same arguments, and the time they ended, unless SKIP_CHECKS is set.
plan_checks() {
  [ -n "${SKIP_CHECKS:-}" ] && return 0
  checks "$@"
  echo "checks at $(elapsed) s"
}

# side_by_side: the diffusers anchor, then diffract-bench (SDXL, SD 1.5) on the same GPU, one
# after the other: the ratios of one run.
side_by_side() {
  timeout 220 python3 .carry/diffusers_sdxl_sd3.py > "$logs/anchor.log" 2>&1
  echo "anchor rc $? at $(elapsed) s"
  anchor_json
  timeout 150 "$bench" --device cuda:0 --config sdxl-1024,sd15-512 --batch 1 --runs 3 \
    > "$logs/bench_single.json" 2> "$logs/bench_single.log"
  echo "single-GPU bench rc $? at $(elapsed) s"
}

#   PLAN=wide (four GPUs or more, issue 9): the GPU link map, the NCCL / strategy checks over all
#     GPUs (gpu_wide: 4 and, on 8, 8 ranks), then against our one GPU in the same run: the SDXL
#     1024² strategies with 4 drafts / bands / components (WIDE_STRATEGIES), a batch of 8 over 4
#     and 2 GPUs (images per second), SD3's PipeFusion over 4, and SDXL 2048² if time is left.
if [ "$plan" = wide ]; then
  nvidia-smi topo -m > "$logs/topo.txt" 2>&1
  head -8 "$logs/topo.txt"
  checks checks_wide "gpu_wide|gpu_cfg_pipefusion|gpu_nccl" 150 "rel-L2|rounds"
  echo "checks at $(elapsed) s"
  BENCH_RUNS=2 BENCH_STRATEGIES="${WIDE_STRATEGIES:-cfg-parallel,driffusion-aggressive:2,driffusion-aggressive:4,driffusion:4,cfg-driffusion-aggressive:4,cfg-driffusion:4,distrifusion:4,asyncdiff:4}" \
    strategy_bench 170
  strategy_split "$logs/bench_strategies.json"
  BENCH_TAG=batch8 BENCH_RUNS=2 BENCH_STRATEGIES="data-parallel:4,data-parallel:2" strategy_bench_batch 8 150
  if [ "$(left)" -gt 100 ]; then
    BENCH_CONFIG=sd3-1024 BENCH_TAG=sd3 BENCH_RUNS=2 \
      BENCH_STRATEGIES="${SD3_STRATEGIES:-cfg-parallel,pipefusion:4,cfg-pipefusion:4,driffusion-aggressive:4,cfg-driffusion-aggressive:4}" \
      strategy_bench "$(left 5)"
  fi
  big_bench 120 distrifusion:4,cfg-driffusion-aggressive:4,driffusion-aggressive:4,hybrid-cfg
  exit 0
fi

# env_ab VAR A [B [C]]: SDXL 1024² with VAR=A on GPU 0 and VAR=B on GPU 1 at the same time (one
# after the other on a 1-GPU machine, while time is left; then
# VAR=C on GPU 0 if time is left): end to end, and the UNet step's device time, kernel count,
# matmul and attention per step at batch 2 and at batch 1 (one CFG branch), with the top
# attention kernels.
env_ab() {
  local var="$1"
  shift
  one() {  # GPU VALUE
    env CUDA_VISIBLE_DEVICES="$1" "$var=$2" timeout 170 "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 2 \
      --strategies step-skip:1 > "$logs/bench_${var}_$2.json" 2> "$logs/bench_${var}_$2.log"
    echo "$var=$2 rc $? at $(elapsed) s"
  }
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && [ -n "${2:-}" ]; then
    one 0 "$1" &
    one 1 "$2"
    wait
    [ -n "${3:-}" ] && [ "$(left)" -gt 90 ] && one 0 "$3"
  else
    for value in "$@"; do
      [ "$(left)" -gt 70 ] && one 0 "$value"
    done
  fi
  for value in "$@"; do
    python3 - "$logs/bench_${var}_$value.json" "$var=$value" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))["results"][0]
except Exception as e:
    print(sys.argv[2], "no JSON:", e); sys.exit(0)
def fam(v):
    k = v.get("kernels_channels_last", {})
    f = k.get("families_ms", {})
    top = [t for t in k.get("top_ms", []) if any(w in t[0] for w in ("sdpa", "flash", "fmha", "attention"))][:3]
    return k.get("device_ms_per_call"), k.get("kernels_per_call"), f.get("matmul"), f.get("attention"), top
print(sys.argv[2], "e2e", r["end_to_end_ms"]["median"], "step", round(r["denoiser_step_ms"]["mean"], 3),
      "repeatable", r.get("repeatable"), [s.get("repeatable") for s in r.get("strategies", [])])
print("   batch 2 (device, kernels, matmul, attention, top attention):", fam(r.get("unet_step_variants", {})))
print("   batch 1:", fam(r.get("unet_step_variants_one_branch", {})))
for name in ("unet_step_variants", "unet_step_variants_one_branch"):
    v = r.get(name, {})
    print("   ", name, {k: round(v[k], 3) for k in v if k.endswith("_ms")})
    k = v.get("kernels_channels_last", {})
    print("     families:", {a: round(b, 3) for a, b in k.get("families_ms", {}).items()})
    if "AB_TOP" in __import__("os").environ:
        for t in k.get("top_ms", [])[:int(__import__("os").environ["AB_TOP"] or 20)]:
            print(f"      {t[1]:7.3f} {t[2] if len(t) > 2 else '':>5} {t[0][:110]}")
    if "AB_OPS" in __import__("os").environ:
        print("     by launching op (kernel <- op [input shapes]):")
        for t in k.get("top_by_op", [])[:int(__import__("os").environ["AB_OPS"] or 40)]:
            print(f"      {t[1]:7.3f} {t[2]:>5} {t[0][:230]}")
PY
  done
}

#   PLAN=gnsplit (one GPU): the single-GPU checks the GroupNorm and ResNet changes touch, then
#     SDXL 1024² with GroupNorm's statistics over 2 blocks per SM (the default) and over 4 (as
#     before), one after the other.
if [ "$plan" = gnsplit ]; then
  checks checks_gnsplit "gpu_conv_bias|gpu_groupnorm|gpu_graphs|gpu_stage_graphs|gpu_qkv|gpu_previews|gpu_sd3|gpu_taesd" 150 "rel-L2|blocks per SM|ResNet"
  echo "checks at $(elapsed) s"
  env_ab DIFFRACT_GROUP_NORM_STATS_BLOCKS 2 4
  exit 0
fi

#   PLAN=probe (one GPU): the kernel, projection and graph checks, the SDXL VAE's band timings,
#     then SDXL 1024² against the one-device strategies (the ordinary loop through the strategy
#     machinery: what a strategy job spends outside its loop, measured without a second GPU).
if [ "$plan" = probe ]; then
  checks checks_probe "gpu_conv_bias|gpu_layernorm|gpu_groupnorm|gpu_geglu|gpu_qkv|gpu_graphs|gpu_stage_graphs|gpu_previews|gpu_vae_bands" 150 "rel-L2|ResNet|latent rows|VAE decode"
  echo "checks at $(elapsed) s"
  BENCH_RUNS=3 BENCH_STRATEGIES="${PROBE_STRATEGIES:-driffusion-aggressive:1,data-parallel:1}" strategy_bench "$(left 5)"
  strategy_split "$logs/bench_strategies.json"
  exit 0
fi

#   PLAN=pair (two GPUs): the 2-GPU strategy and VAE checks, then one strategy bench against our
#     one GPU: CFG-parallel and DRiffusion n = 2 with the VAE decode on the first GPU and
#     overlapped over both, DRiffusion without its paired rounds, hybrid CFG (PAIR_STRATEGIES).
if [ "$plan" = pair ]; then
  plan_checks checks_pair "gpu_strategies|gpu_parallel_vae" 150 "rel-L2|rounds|paired|overlapped|decode"
  o=@DIFFRACT_PARALLEL_VAE=overlap
  BENCH_RUNS=3 BENCH_STRATEGIES="${PAIR_STRATEGIES:-cfg-parallel,cfg-parallel$o,driffusion-aggressive:2@DIFFRACT_DRIFFUSION_PAIRS=0,driffusion-aggressive:2,driffusion-aggressive:2$o,driffusion:2$o,hybrid-cfg$o,hybrid-cfg}" \
    strategy_bench "$(left 5)"
  strategy_split "$logs/bench_strategies.json"
  exit 0
fi

#   PLAN=gemm (one GPU): the GroupNorm, VAE band and tuned-GEMM checks, then SDXL 1024² with the
#     tuned GEMMs (the default) and with at::linear (DIFFRACT_GEMM_TUNING=0), one after the other.
if [ "$plan" = gemm ]; then
  plan_checks checks_gemm "gpu_groupnorm|gpu_vae_bands|gpu_gemm" 150 "gemm|all shapes|overlapped|FAIL"
  env_ab DIFFRACT_GEMM_TUNING ${GEMM_AB:-1 0}
  exit 0
fi

#   PLAN=lean (one GPU, a few minutes): the diffusers anchor, then diffract-bench for SDXL 1024²
#     alone on the same GPU, and their ratios.
if [ "$plan" = lean ]; then
  timeout 150 python3 .carry/diffusers_sdxl_sd3.py > "$logs/anchor.log" 2>&1
  echo "anchor rc $? at $(elapsed) s"
  anchor_json
  timeout "$(left 3)" "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 2 \
    > "$logs/bench_single.json" 2> "$logs/bench_single.log"
  echo "single-GPU bench rc $? at $(elapsed) s"
  ratios 2>&1 | grep -v "^    top" | cut -c1-1200
  exit 0
fi

#   PLAN=ab (one GPU): the checks matching CHECKS (their lines matching GREP), then SDXL 1024²
#     with AB_VAR set to each of AB_VALUES, one after the other (kernel tables with AB_TOP / AB_OPS).
if [ "$plan" = ab ]; then
  plan_checks checks_ab "${CHECKS:-gpu_groupnorm}" 150 "${GREP:-rel-L2}"
  env_ab "$AB_VAR" $AB_VALUES
  exit 0
fi

#   PLAN=checks (any GPUs): the checks matching CHECKS (a ctest -R pattern), their lines matching GREP.
if [ "$plan" = checks ]; then
  checks checks_some "${CHECKS:-gpu_groupnorm}" 150 "${GREP:-rel-L2}"
  exit 0
fi

#   PLAN=tune (one GPU): the LayerNorm and GroupNorm checks, with the timing of the LayerNorm
#     kernel's row layouts and of GroupNorm's statistics grids at the SDXL step's shapes.
if [ "$plan" = tune ]; then
  checks checks_tune "gpu_layernorm|gpu_groupnorm" 150 "ms per call|blocks per SM|worst|group_norm \\["
  exit 0
fi

#   PLAN=final (one GPU): the kernel, projection and graph checks, the diffusers anchor then
#     diffract-bench (SDXL, SD 1.5) on the same GPU and their ratios, then SDXL once more with
#     each UNet step's kernels listed by name and by the ATen op (and shapes) that launched them.
if [ "$plan" = final ]; then
  checks checks_final "gpu_conv_bias|gpu_layernorm|gpu_groupnorm|gpu_geglu|gpu_qkv|gpu_graphs|gpu_stage_graphs|gpu_previews" 150 "rel-L2|worst|ResNet|its bias|slice"
  echo "checks at $(elapsed) s"
  side_by_side
  ratios 2>&1 | grep -v "^    top" | cut -c1-1500
  AB_TOP=30 AB_OPS=60 env_ab DIFFRACT_FUSED_TIME_PROJ 1
  exit 0
fi

#   PLAN=timeproj (one GPU): the GroupNorm, fused-projection, bias, LayerNorm and graph checks,
#     then SDXL 1024² with the defaults (the ResNet blocks' time projections as one GEMM, the
#     LayerNorm kernel loading its affine with x), without the fused time projections, and with
#     the affine loaded after the reductions, one after the other (the first with its kernels
#     listed, call counts included).
if [ "$plan" = timeproj ]; then
  checks checks_timeproj "gpu_groupnorm|gpu_qkv|gpu_conv_bias|gpu_layernorm|gpu_graphs" 150 "rel-L2|worst|ResNet|slice|one row|bias "
  echo "checks at $(elapsed) s"
  AB_TOP=40 env_ab DIFFRACT_FUSED_TIME_PROJ 1
  env_ab DIFFRACT_FUSED_TIME_PROJ 0
  env_ab DIFFRACT_LAYER_NORM_PREFETCH 0
  exit 0
fi

#   PLAN=sidebyside (one GPU): the kernel and graph checks, the diffusers anchor then
#     diffract-bench (SDXL, SD 1.5) on the same GPU, their ratios, then SDXL once more for the
#     batch-1 step's profile (what each CFG-parallel rank runs).
if [ "$plan" = sidebyside ]; then
  checks checks_final "gpu_conv_bias|gpu_layernorm|gpu_geglu|gpu_groupnorm|gpu_graphs|gpu_qkv|gpu_previews" 150 "rel-L2|ResNet"
  echo "checks at $(elapsed) s"
  side_by_side
  ratios
  env_ab DIFFRACT_CONV_BIAS_KERNEL 1
  exit 0
fi

#   PLAN=convbias (one GPU): the convolution-bias, GroupNorm and graph checks, then SDXL 1024²
#     with the bias kernel (the default) and with ATen's broadcast add, one after the other.
if [ "$plan" = convbias ]; then
  checks checks_convbias "gpu_conv_bias|gpu_groupnorm|gpu_graphs|gpu_stage_graphs" 150 "rel-L2|worst|ResNet|conv "
  echo "checks at $(elapsed) s"
  env_ab DIFFRACT_CONV_BIAS_KERNEL 1 0
  exit 0
fi

#   PLAN=addnorm (one GPU): the LayerNorm, GEGLU and graph checks, then SDXL 1024² with the
#     defaults (the residual adds inside the LayerNorm kernels, GEGLU's projection as one GEMM),
#     without the add + LayerNorm kernel, and with GEGLU's two half-width GEMMs, one after the other.
if [ "$plan" = addnorm ]; then
  checks checks_addnorm "gpu_layernorm|gpu_geglu|gpu_graphs|gpu_qkv" 150 "rel-L2|worst|GEGLU projection|fused"
  echo "checks at $(elapsed) s"
  env_ab DIFFRACT_FUSED_ADD_LAYER_NORM 1 0
  env_ab DIFFRACT_GEGLU_ONE_GEMM 0
  exit 0
fi

#   PLAN=anchor (one GPU): the diffusers anchor, then diffract-bench (SDXL, SD 1.5) on the same
#     GPU in the same run, and their ratios; then SDXL with AB_VAR=AB_VALUE if set.
if [ "$plan" = anchor ]; then
  side_by_side
  ratios
  [ -n "${AB_VAR:-}" ] && env_ab "$AB_VAR" "$AB_VALUE"
  python3 -c "
import json, glob
for f in sorted(glob.glob('$logs/bench_*.json')):
    for r in json.load(open(f))['results']:
        print(f.split('/')[-1], r['config'], 'e2e', round(r['end_to_end_ms']['median'], 1), 'peak GiB', round(r['peak_vram_gib'], 3))"
  exit 0
fi

#   PLAN=crosskv (one GPU): the fused-projection and graph checks, then SDXL 1024² with every
#     cross-attention's keys and values from one GEMM (the default) and from one GEMM each,
#     then with a 32 MiB cuBLASLt workspace (ATen's default is 1 MiB).
if [ "$plan" = crosskv ]; then
  checks checks_crosskv "gpu_qkv|gpu_graphs|gpu_stage_graphs" 150 "rel-L2"
  echo "checks at $(elapsed) s"
  env_ab DIFFRACT_FUSED_CROSS_KV 1 0
  env_ab CUBLASLT_WORKSPACE_SIZE 32768
  exit 0
fi

#   PLAN=qkv (two GPUs, not run yet): the fused-QKV check, then SDXL 1024² with the three
#     projection GEMMs on GPU 0 and the fused one (DIFFRACT_FUSED_QKV=1) on GPU 1 at the same time:
#     the step's kernel profile at batch 2 and batch 1, and CFG-parallel with each.
if [ "$plan" = qkv ]; then
  checks checks_qkv gpu_qkv 90 "rel-L2"
  env_ab DIFFRACT_FUSED_QKV 0 1
  BENCH_RUNS=2 BENCH_STRATEGIES=cfg-parallel strategy_bench 120
  DIFFRACT_FUSED_QKV=1 BENCH_TAG=cfgp_qkv BENCH_RUNS=2 BENCH_STRATEGIES=cfg-parallel strategy_bench "$(left 5)"
  exit 0
fi

#   PLAN=attn (two GPUs): SDXL 1024² with PyTorch's attention pick (cuDNN) on GPU 0 and ATen's
#     FlashAttention-2 (DIFFRACT_SDPA=flash) on GPU 1 at the same time, then the memory-efficient
#     kernels on GPU 0: each UNet step's kernel profile at batch 2 and at batch 1 (one CFG branch).
if [ "$plan" = attn ]; then
  env_ab DIFFRACT_SDPA cudnn flash efficient
  exit 0
fi

#   PLAN=wide3 (four GPUs, a last call; two with PVAE1024_STRATEGIES= and BIG_STRATEGIES for 2):
#     SD 1.5 with the default previews (auto: half size) on GPU 0; the parallel-VAE check; SDXL
#     1024² over 4 GPUs with the row-band VAE decode forced on (its A/B at 1024²); SDXL 2048² with
#     the default decode (row bands from 3 MP).
if [ "$plan" = wide3 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 100 "$bench" --device cuda:0 --config sd15-512 --batch 1 --runs 3 \
    > "$logs/bench_sd15.json" 2> "$logs/bench_sd15.log"
  python3 -c "
import json
for r in json.load(open('$logs/bench_sd15.json'))['results']:
    print('sd15 default previews:', {k: r.get(k) for k in ('end_to_end_ms', 'denoiser_step_ms', 'preview_side', 'preview_decode_ms', 'preview_added_to_denoising_pct', 'previews_shown')})" 2>&1 | cut -c1-600
  checks checks_pvae gpu_parallel_vae 90 "rel|ms"
  if [ -n "${PVAE1024_STRATEGIES-cfg-driffusion-aggressive:4,driffusion-aggressive:4}" ]; then
    DIFFRACT_PARALLEL_VAE=1 BENCH_TAG=pvae1024 BENCH_RUNS=2 \
      BENCH_STRATEGIES="${PVAE1024_STRATEGIES-cfg-driffusion-aggressive:4,driffusion-aggressive:4}" strategy_bench 150
    strategy_split "$logs/bench_pvae1024.json"
  fi
  big_bench 100 distrifusion:4,hybrid-cfg,cfg-parallel
  exit 0
fi

#   PLAN=wide2 (four GPUs, a second call): the diffusers anchor then our single-GPU bench on GPU 0
#     (side by side in one run); a batch of 8 over 4 and 2 GPUs, each rank decoding its images;
#     SDXL 2048² over 4 GPUs with the row-band parallel VAE decode against one GPU's decode.
if [ "$plan" = wide2 ]; then
  CUDA_VISIBLE_DEVICES=0 side_by_side
  ratios 2>&1 | grep -v "^    top" | cut -c1-900
  BENCH_TAG=batch8 BENCH_RUNS=2 BENCH_STRATEGIES="data-parallel:4,data-parallel:2" strategy_bench_batch 8 150
  strategy_split "$logs/bench_batch8.json"
  if [ "$(left)" -gt 70 ]; then
    DIFFRACT_PARALLEL_VAE=1 BENCH_CONFIG=sdxl-2048 BENCH_TAG=big_pvae BENCH_RUNS=1 \
      BENCH_STRATEGIES="${BIG_STRATEGIES:-cfg-driffusion-aggressive:4,driffusion-aggressive:4}" strategy_bench "$(left 5)"
    strategy_split "$logs/bench_big_pvae.json"
  fi
  exit 0
fi

#   PLAN=nine (two GPUs): the single-GPU checks not run yet (upload, CLIP graphs), the NCCL and
#     strategy checks (DistriFusion's graphed stale steps), DistriFusion graphed against its eager
#     buckets at 1024² (same run), then DRiffusion, hybrid CFG and DistriFusion at 2048².
if [ "$plan" = nine ]; then
  if [ -z "${SKIP_SINGLE:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 checks checks_single "gpu_upload|gpu_clip_graph"
  fi
  checks checks_strategies "gpu_nccl|gpu_strategies" 150 distrifusion
  echo "checks at $(elapsed) s"
  BENCH_RUNS=2 BENCH_STRATEGIES="${SDXL_STRATEGIES:-distrifusion:2,cfg-parallel}" strategy_bench 150
  strategy_split "$logs/bench_strategies.json"
  if [ -n "${DISTRI_EAGER:-}" ]; then
    DIFFRACT_STAGE_GRAPHS=0 BENCH_TAG=distri_eager BENCH_RUNS=1 BENCH_STRATEGIES=distrifusion:2 strategy_bench 120
    strategy_split "$logs/bench_distri_eager.json"
  fi
  if [ -n "${TAESD:-}" ]; then
    CUDA_VISIBLE_DEVICES=1 checks checks_taesd gpu_taesd 200 "taesd|first"
    for fused in 1 0; do
      DIFFRACT_FUSED_TAESD=$fused CUDA_VISIBLE_DEVICES=1 timeout 100 "$bench" --device cuda:0 --config sd15-512 --batch 1 --runs 2 \
        > "$logs/bench_sd15_taesd$fused.json" 2> "$logs/bench_sd15_taesd$fused.log"
      python3 -c "
import json
for r in json.load(open('$logs/bench_sd15_taesd$fused.json'))['results']:
    print('fused taesd $fused:', {k: r[k] for k in ('end_to_end_ms', 'preview_added_to_denoising_pct', 'preview_decode_ms', 'denoiser_step_ms')})" 2>&1 | cut -c1-400
    done
    echo "taesd at $(elapsed) s"
  fi
  big_bench 150 distrifusion:2,driffusion-aggressive:2,hybrid-cfg
  exit 0
fi

#   PLAN=eight (two GPUs, a short call): the NCCL and strategy checks, then DistriFusion in the
#     strategy bench (its asynchronous bucketed exchange).
if [ "$plan" = eight ]; then
  checks checks_strategies "gpu_nccl|gpu_strategies" 90 distrifusion
  echo "checks at $(elapsed) s"
  BENCH_RUNS=1 BENCH_STRATEGIES="${SDXL_STRATEGIES:-distrifusion:2}" strategy_bench "$(left 3)"
  strategy_split "$logs/bench_strategies.json"
  exit 0
fi

#   PLAN=seven (two GPUs): the diffusers anchor on the second GPU while our single-GPU bench runs
#     on the first (side by side in one run); then the parallel-VAE and strategy checks; then the
#     SDXL strategy bench (SDXL_STRATEGIES) with the parallel VAE decode, and without it if time allows.
if [ "$plan" = seven ]; then
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 .carry/diffusers_sdxl_sd3.py > "$logs/anchor.log" 2>&1 &
  anchor=$!
  CUDA_VISIBLE_DEVICES=0 timeout 200 "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 3 \
    > "$logs/bench_single.json" 2> "$logs/bench_single.log"
  echo "single-GPU bench rc $? at $(elapsed) s"
  ctest --test-dir build/gpu -R gpu_geglu -V --timeout 60 > "$logs/checks_geglu.log" 2>&1
  grep -E "fused|tests passed" "$logs/checks_geglu.log"
  wait "$anchor"
  echo "anchor (GPU 1) rc $? at $(elapsed) s"
  anchor_json
  ratios
  checks checks_strategies "gpu_parallel_vae|gpu_strategies" 120 "rel-L2|messages per step|GPU|relative"
  echo "checks at $(elapsed) s"
  BENCH_RUNS=2 BENCH_STRATEGIES="${SDXL_STRATEGIES:-driffusion-aggressive:2,cfg-parallel,distrifusion:2}" strategy_bench "$(left 5)"
  strategy_split "$logs/bench_strategies.json"
  if [ "$(left)" -gt 70 ]; then
    DIFFRACT_PARALLEL_VAE=0 BENCH_TAG=one_gpu_vae BENCH_RUNS=2 BENCH_STRATEGIES=driffusion-aggressive:2 strategy_bench "$(left 5)"
    strategy_split "$logs/bench_one_gpu_vae.json"
  fi
  exit 0
fi

#   PLAN=six (two GPUs): the stage-graph, strategy and cfg-pipefusion checks; the SDXL strategy
#     bench (AsyncDiff and hybrid with stage graphs, then without if time allows); the UNet load
#     bench (pinned upload against bind-then-move).
if [ "$plan" = six ]; then
  checks checks_strategies "gpu_stage_graphs|gpu_strategies|gpu_cfg_pipefusion" 90 "rel-L2|graphed vs eager|bit for bit"
  echo "strategy checks at $(elapsed) s"
  BENCH_STRATEGIES="${SDXL_STRATEGIES:-cfg-parallel,driffusion-aggressive:2,asyncdiff:2,hybrid-cfg,distrifusion:2}" strategy_bench 220
  strategy_split "$logs/bench_strategies.json"
  CUDA_VISIBLE_DEVICES=0 timeout 150 "$bench" --device cuda:0 --config sdxl-1024 --load-only --runs 2 --scratch /tmp/dbench \
    > "$logs/bench_load.json" 2> "$logs/bench_load.log"
  echo "load bench rc $? at $(elapsed) s"
  python3 -c "import json; [print(' ', json.dumps(r)) for r in json.load(open('$logs/bench_load.json'))['results']]" 2>&1
  if [ "$(left)" -gt 90 ]; then
    DIFFRACT_STAGE_GRAPHS=0 BENCH_TAG=eager_stages BENCH_RUNS=2 BENCH_STRATEGIES=asyncdiff:2,hybrid-cfg strategy_bench "$(left 5)"
    strategy_split "$logs/bench_eager_stages.json"
  fi
  exit 0
fi

if [ "$plan" = three ]; then
  ctest --test-dir build/gpu -R "gpu_stage_graphs|gpu_strategies|gpu_cfg_pipefusion" -V --timeout 90 > "$logs/checks_strategies.log" 2>&1
  grep -E "  (ok|FAIL)  |tests passed|rel-L2|graphed vs eager|Timeout" "$logs/checks_strategies.log" | cut -c1-300
  echo "strategy check at $(elapsed) s"
  BENCH_STRATEGIES="${SDXL_STRATEGIES:-distrifusion:2,asyncdiff:2,hybrid-cfg,cfg-parallel}" strategy_bench 150
  strategy_split "$logs/bench_strategies.json"
  [ -z "${SKIP_SD3_EAGER:-}" ] && CUDA_VISIBLE_DEVICES=0 DIFFRACT_CUDA_GRAPHS=0 timeout 120 "$bench" --device cuda:0 --config sd3-1024 --batch 1 --runs 2 \
    > "$logs/bench_sd3_eager.json" 2> "$logs/bench_sd3_eager.log"
  echo "sd3 eager bench rc $? at $(elapsed) s"
  python3 -c "
import json
for r in json.load(open('$logs/bench_sd3_eager.json'))['results']:
    print('  sd3-1024 eager: e2e %.1f ms step %.2f ms' % (r['end_to_end_ms']['median'], r['denoiser_step_ms']['mean']))" 2>&1
  if [ "$(left)" -gt 120 ]; then
    timeout "$(left 5)" "$bench" --device cuda:0 --config sdxl-2048 --batch 1 --runs 1 \
      --strategies "${BIG_STRATEGIES:-cfg-parallel,distrifusion:2,asyncdiff:2}" > "$logs/bench_2048.json" 2> "$logs/bench_2048.log"
    echo "2048 bench rc $? at $(elapsed) s"
    grep -o '{"denoising_ms.*' "$logs/bench_2048.log" | python3 -c "
import json, sys
for line in sys.stdin:
    s = json.loads(line)
    print('   %-14s e2e %.1f ms  x%.2f e2e  x%.2f denoise  PSNR %.1f dB SSIM %.4f' % (s['strategy'], s['end_to_end_ms'], s['speedup_end_to_end'],
          s['speedup_denoising'], s['psnr_db'], s['ssim']))"
  fi
  exit 0
fi

if [ "$plan" = sd3 ] || [ "$plan" = two ]; then
  if [ "$plan" = two ]; then
    BENCH_STRATEGIES="${SDXL_STRATEGIES:-cfg-parallel,driffusion-aggressive:2,step-skip:2,asyncdiff:2,hybrid-cfg}" \
      strategy_bench 170
  fi
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 .carry/diffusers_sdxl_sd3.py > "$logs/anchor.log" 2>&1 &
  anchor=$!
  CUDA_VISIBLE_DEVICES=0 timeout 200 "$bench" --device cuda:0 --config sd3-1024 --batch 1 --runs 3 \
    > "$logs/bench_sd3.json" 2> "$logs/bench_sd3.log"
  echo "sd3 bench rc $? at $(elapsed) s"
  wait "$anchor"
  anchor_json
  python3 -c "
import json
a = json.load(open('$logs/anchor.json'))
for r in json.load(open('$logs/bench_sd3.json'))['results']:
    s = r['denoiser_step_ms']['mean']
    print(r['config'], 'e2e %.1f ms' % r['end_to_end_ms']['median'], 'step %.2f ms' % s,
          'vs diffusers eager %.2f ms (ratio %.3f)' % (a.get('sd3_step_b2_ms', 0), s / a['sd3_step_b2_ms'] if a.get('sd3_step_b2_ms') else 0),
          'vae %.1f ms' % r['vae_decode_ms'], 'previews +%.2f %%' % r['preview_added_to_denoising_pct'], 'peak %.2f GiB' % r.get('peak_vram_gib', 0))" 2>&1
  timeout "$(left 5)" "$bench" --device cuda:0 --config sd3-1024 --batch 1 --runs 2 \
    --strategies "${BENCH_STRATEGIES:-cfg-parallel,pipefusion:2,driffusion-aggressive:2}" \
    > "$logs/bench_sd3_strategies.json" 2> "$logs/bench_sd3_strategies.log"
  echo "sd3 strategy bench rc $? at $(elapsed) s"
  grep -o '{"denoising_ms.*' "$logs/bench_sd3_strategies.log" | cut -c1-700
  [ "$plan" = two ] && [ "$(left)" -gt 60 ] && multigpu_checks
  exit 0
fi

if [ "$plan" = short ]; then
  ctest --test-dir build/gpu -R gpu_strategies -V --timeout 90 > "$logs/checks_strategies.log" 2>&1
  grep -E "  (ok|FAIL)  |tests passed|rel-L2|graphed vs eager|Timeout" "$logs/checks_strategies.log" | cut -c1-600
  echo "strategy check at $(elapsed) s"
  timeout "$(left 5)" "$bench" --device cuda:0 --config sdxl-1024 --batch 1 --runs 2 \
    --strategies "${BENCH_STRATEGIES:-asyncdiff:2,cfg-parallel}" > "$logs/bench_strategies.json" 2> "$logs/bench_strategies.log"
  echo "strategy bench rc $? at $(elapsed) s"
  grep -o '{"denoising_ms.*' "$logs/bench_strategies.log" | cut -c1-700
  exit 0
fi

if [ "$plan" = multi2 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 150 "$bench" --device cuda:0 --config sd15-512,sdxl-1024 --batch 1 --runs 2 \
    > "$logs/bench_previews.json" 2> "$logs/bench_previews.log"
  echo "single-GPU bench rc $? at $(elapsed) s"
  python3 -c "
import json
for r in json.load(open('$logs/bench_previews.json'))['results']:
    print(r['config'], 'previews +%.2f %%' % r['preview_added_to_denoising_pct'], 'decode %.2f ms' % r['preview_decode_ms'],
          'shown', r['previews_shown'], 'dropped', r['previews_dropped_per_run'], 'step %.2f ms' % r['denoiser_step_ms']['mean'],
          'e2e %.1f ms' % r['end_to_end_ms']['median'], 'first/later %.3f' % r['first_vs_later'], 'warm-up %.0f ms' % r['warm_up_ms'])" 2>&1
  strategies "$(left 10)"
  exit 0
fi

if [ "$plan" = final ]; then
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 .carry/diffusers_sdxl_sd3.py > "$logs/anchor.log" 2>&1 &
  anchor=$!
  CUDA_VISIBLE_DEVICES=0 timeout 200 "$bench" --device cuda:0 --config sdxl-1024,sd15-512 --batch 1 --runs 3 \
    > "$logs/bench_single.json" 2> "$logs/bench_single.log"
  echo "single-GPU bench rc $? at $(elapsed) s"
  wait "$anchor"
  echo "anchor (GPU 1) rc $? at $(elapsed) s"
  anchor_json
  ratios
  strategies "$(left 10)"
  exit 0
fi

if [ "$plan" = single ]; then
  train 1 "$(train_minutes)"
  export CUDA_VISIBLE_DEVICES=0
  timeout 240 python3 .carry/diffusers_sdxl_sd3.py > "$logs/anchor.log" 2>&1
  echo "anchor rc $? at $(elapsed) s"
  anchor_json
  timeout "$(left 60)" "$bench" --device cuda:0 --config sdxl-1024,sd15-512 --batch 1 --runs 3 \
    > "$logs/bench_single.json" 2> "$logs/bench_single.log"
  echo "single-GPU bench rc $? at $(elapsed) s"
  ratios
  ctest --test-dir build/gpu -L gpu -LE multigpu -V --timeout 45 > "$logs/checks_single.log" 2>&1
  grep -E "  (ok|FAIL)  |tests passed|capture|previews shown" "$logs/checks_single.log"
  if [ "$(left)" -gt 50 ]; then
    timeout "$(left 5)" python3 scripts/profile_diffusers_unet.py > "$logs/profile_diffusers.log" 2>&1
    grep -o '^KERNELS.*' "$logs/profile_diffusers.log" | cut -c1-600
  fi
else
  strategies 180
  train 1 "$(train_minutes)" --resume
  CUDA_VISIBLE_DEVICES=0 timeout "$(left 40)" "$bench" --device cuda:0 --config sdxl-768,sdxl-1024 --batch 4 --runs 2 \
    > "$logs/bench_batch4.json" 2> "$logs/bench_batch4.log"
  echo "batch-4 bench rc $? at $(elapsed) s"
  python3 -c "
import json
for r in json.load(open('$logs/bench_batch4.json'))['results']:
    print(json.dumps({k: v for k, v in r.items() if k != 'unet_step_variants'}))" 2>&1 | cut -c1-700
fi
wait "$trainer"
grep -E "encoded|scaling_factor|resumed|step [0-9]*00 |trained|rc" "$logs/train.log" | tail -14
CUDA_VISIBLE_DEVICES=1 timeout "$(left -30)" build/gpu/app/diffract-train eval --model build/gpu-train/model --atlas .carry/emoji \
  --holdout resources/training/holdout.tsv --device cuda:0 --sheet "$logs/holdout.png" > "$logs/eval.json" 2> "$logs/eval.log"
echo "eval rc $? at $(elapsed) s"
python3 -c "import json; r = json.load(open('$logs/eval.json')); print({k: v for k, v in r.items() if k != 'results'})"
