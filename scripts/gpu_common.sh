# Sourced by the GPU-machine scripts (gpu_check, gpu_bench, gpu_session, gpu_train): what they
# all do before their own work. Needs .carry/ (scripts/prepare_carry.sh) in the carry list.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# The carried wheels (diffusers for the anchor and oracles) into /tmp/site, on PYTHONPATH.
gpu_python_packages() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/whl/*.whl
  export PYTHONPATH=/tmp/site
}

# gpu_info FILE: the GPUs, printed and written to FILE.
gpu_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$1"
}

# gpu_build LOGDIR TARGET...: the `gpu` preset against the machine's PyTorch, then the targets;
# configure.log and build.log go to LOGDIR, and their errors to the output on failure.
gpu_build() {
  local logs="$1"
  shift
  mkdir -p "$logs"
  cmake --preset gpu -DDIFFRACT_BUILD_CLI=ON -DCLI11_INCLUDE_DIR="$PWD/.carry/include" \
    -DDIFFRACT_PYTHON="$(command -v python3)" -DCMAKE_CXX_COMPILER_LAUNCHER= -DCMAKE_CUDA_COMPILER_LAUNCHER= -DDIFFRACT_CUDA_ARCHITECTURES=90-real > "$logs/configure.log" 2>&1 \
    || { tail -40 "$logs/configure.log"; return 1; }
  cmake --build build/gpu -j "$(nproc)" --target "$@" > "$logs/build.log" 2>&1 \
    || { grep -m20 -A5 error "$logs/build.log"; return 1; }
}
