#!/usr/bin/env bash
# Every open GPU figure of the issues, in stages that each fit one device command (10 min).
#
#   bash scripts/gpu_round.sh fetch     # here, with a package registry: the wheels into .whl/
#   # then, through the device tool (carry: [".whl"]), one stage per command:
#   bash scripts/gpu_round.sh install-test   # install + whole suite (GPU tests included)
#   bash scripts/gpu_round.sh kernels        # issue 17: log-prob kernel vs Liger/compile; sync pack
#   bash scripts/gpu_round.sh train-bench    # issue 16: native/megatron medium+large, recompute
#   bash scripts/gpu_round.sh train-ab       # issue 16: native before/after on medium
#   bash scripts/gpu_round.sh one-gpu        # issue 18: the main job and the engine on one GPU
#
# Each stage installs first when needed (a fresh machine keeps nothing between leases) and
# writes its JSON, logs and profiles under $OUT (default ./gpu_out). docs/gpu.md and
# ../shared/GPU.md describe the machine; copy the figures into docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
stage=${1:?stage: fetch | install-test | kernels | train-bench | train-ab | one-gpu}

install() {
  if python3 -c "import moe_rl, pydantic, megatron.core" 2>/dev/null; then return; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { tail -30 "$OUT/install.log"; exit 1; }
}
# every command's output goes to its own log; the stage goes on after a failure and says so
step() {
  local name=$1; shift
  echo "[gpu_round] $name: $*"
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "[gpu_round] $name: rc=$rc in $((SECONDS - t0)) s"; tail -5 "$OUT/$name.log"
}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

case $stage in
  fetch)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .whl \
      megatron-core pydantic pydantic-core annotated-types typing-inspection liger-kernel peft
    ls .whl ;;
  install-test)
    install
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv"
    step suite timeout 540 python3 -m pytest -q tests -n 8 -p no:cacheprovider ;;
  kernels)
    install
    step bench_logprobs timeout 300 moe-rl bench logprobs --json --profile "$OUT/logprobs_profile"
    step bench_sync_gpu timeout 200 moe-rl bench sync --gpu only --json
    step fp32_error timeout 120 python3 scripts/fp32_logprob_error.py --device cuda ;;
  train-bench)  # native, megatron, megatron + recompute per preset, one profiled step each
    install
    step train_medium timeout 220 env OUT="$OUT" bash scripts/gpu_bench_train.sh medium
    step train_large timeout 320 env OUT="$OUT" bash scripts/gpu_bench_train.sh large ;;
  train-ab)  # issue 16: native before/after on medium (466346e = the code before)
    install
    step train_medium_ab timeout 540 env OUT="$OUT" bash scripts/gpu_bench_train.sh ab ;;
  one-gpu)
    install
    step bench_engine_gpu1x timeout 150 moe-rl bench engine --device cuda --config configs/gpu_1x.yaml --json
    step train_gpu_1x timeout 400 moe-rl train configs/gpu_1x.yaml output_dir="$OUT/gpu_1x" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
