#!/usr/bin/env bash
# The GPU figures of training speed, as JSON under $OUT. Run from the checkout
# root on a one-GPU H100/H200 machine prepared as in /work/shared/GPU.md (wheels in .whl/):
#
#     OUT=/some/dir bash scripts/gpu_bench_train.sh [STAGE ...]      # default: all stages
#
# Stages (each writes its own files, so a machine limited to ~10 minutes per command can run
# them as separate commands: `... medium large` then `... ab`):
#   install  pip-installs .whl/*.whl into /tmp/site and this checkout (editable), once
#   medium   native, megatron, megatron + full recompute on preset medium (bf16): tokens/s, MFU,
#            megatron/native and the recompute step ratio, plus one profiled step per backend
#   large    the same on preset large (Qwen3-30B-A3B layer shapes, 16k tokens/step)
#   ab       native before/after the grouped-GEMM experts on medium (466346e = the per-expert loop), alternating
#            fresh processes, 3 rounds
#   base     (not in the default list; run where git history is) writes that baseline tree into
#            the ignored folder .base_per_expert/, to carry to a device machine without git
# Targets (docs/benchmarks.md, "Training step"): native MFU >= 15% (medium), >= 35% (large); megatron/
# native >= 1.0 on both; recompute step ratio <= 1.4.
set -euo pipefail
OUT=${OUT:?set OUT to a directory for the JSON results}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(install medium large ab)
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # the wheels (GPU.md); harmless where absent
BENCH="python3 -m moe_rl.train.megatron.bench"
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/gpu_bench_train.log"; }

for stage in "${stages[@]}"; do
  case "$stage" in
    install)
      if [ -d .whl ] && ! python3 -c "import megatron.core, pydantic" 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
      fi
      python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv"
      python3 -c "import torch, megatron.core as m; print(torch.__version__, m.__version__)" | tee -a "$OUT/gpu.csv"
      ;;
    medium|large)
      log "preset $stage: native, megatron, megatron_recompute"
      $BENCH --preset "$stage" --backends native,megatron,megatron_recompute --profile \
        --out "$OUT/train_$stage.json" 2>&1 | tee "$OUT/train_$stage.txt"
      ;;
    ab)
      # the baseline checkout: .base_per_expert/ if present (a device copy of the working tree has no
      # git history: make it where git is, `bash scripts/gpu_bench_train.sh base`, and carry it),
      # else a git worktree
      base=$PWD/.base_per_expert
      [ -d "$base" ] || git worktree add --detach "$base" 466346e
      cp moe_rl/_C*.so "$base/moe_rl/" 2>/dev/null || true
      ln -sfn ../kernels "$base/moe_rl/kernels"
      log "native before/after on medium (baseline $base)"
      $BENCH --preset medium --baseline "$base" --rounds 3 --out "$OUT/train_medium_ab.json" 2>&1 \
        | tee "$OUT/train_medium_ab.txt"
      ;;
    base)  # here, with git: the baseline tree for `ab`, an ignored folder to carry to the device
      exclude="$(git rev-parse --git-common-dir)/info/exclude"
      grep -qx '/.base_per_expert/' "$exclude" 2>/dev/null || echo /.base_per_expert/ >> "$exclude"
      rm -rf .base_per_expert && mkdir .base_per_expert && git archive 466346e | tar -x -C .base_per_expert
      ;;
    *) echo "unknown stage $stage (base, install, medium, large, ab)" >&2; exit 2 ;;
  esac
done
log "done: $(ls "$OUT")"
