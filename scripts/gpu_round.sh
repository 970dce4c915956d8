#!/usr/bin/env bash
# Every GPU figure the open issues ask for, in one command of at most 510 s after an
# install of under a minute (its cap: 90 s).
#
#   bash scripts/gpu_round.sh fetch        # here (package registry, git): wheels + commit into .whl/
#   bash scripts/gpu_round.sh all          # there, device tool: carry [".whl"], timeout_s 600
#   bash scripts/gpu_round.sh STAGE ...    # some stages only (names below), same outputs; also
#                                          # the by-name stages listed below
#   GPU_ROUND_DEVICE=cpu bash scripts/gpu_round.sh all   # the same round at tiny sizes on a CPU
#                                        # (caps x3; GPU_ROUND_SCALE=N: xN on a busier machine)
#
# Results, in $OUT (the device tool's folder; default ./gpu_out):
#   gpu_summary.json   every figure (scripts/gpu_summary.py reads each stage's own JSON output:
#                      a stage that failed or did not run gives null and its exit code)
#   gpu_round.tar.gz   the stage logs, JSON outputs and profiles (kept under 16 MB)
# The stages write under $GPU_ROUND_WORK (default: a new /tmp/gpu_round.XXXX), outside $OUT.
#
# Each stage has its own time cap, and the round a total budget (GPU_ROUND_BUDGET_S, 510 s, from
# the end of the install, whose own cap of 90 s is outside it): a stage gets min(its cap, what the
# budget has left) and is skipped when the budget cut it to under a minute; a failing stage does
# not stop the others, a failed install ends the round (in a CPU dry run caps and budget are 3x).
# The caps between install and gpu_1x add up to 395 s (table in stages()), so gpu_1x, last, trains
# for over a minute even when every other stage runs to its cap; its
# time cap ending the run is its normal end (rc 124), its figures read from metrics.jsonl. The train
# stages' compile (train.compile, on by default on CUDA) counts against their caps; the bench runs
# its rows in the order asked (megatron's first, the compiled native row after) and rewrites its
# JSON as each row fills (build, first step, timed figures), as the log-prob and engine benches do
# after each figure, so a stage stopped by its cap keeps what it measured. pytest gets a
# SIGINT 25 s before its cap, so a cut run still writes its JUnit report (the tests that ended);
# each failure's traceback is printed to its log as it comes.
# Stages run in order of what a short lease must not miss (correctness, the grouped GEMM's decode
# tiles and the engine that runs them, the train figures, the compiled engine, the main job), so
# a tight budget shortens gpu_1x first. The tiles grouped_gemm finds fastest go to every later
# stage (MOE_RL_GROUPED_GEMM_CONFIG), and into $OUT's archive to be shipped as this GPU's file.
# By name only: logprobs (the fused log-prob kernels against cuBLAS, Liger, torch.compile),
# train_large (the large preset's compiled native row), on_policy (true_on_policy's checks and
# cost), train_fused (the fused-loss train rows), train_large_megatron (the large preset's megatron,
# recompute and eager rows), gpu_1x_compiled (the main job as shipped, compiled), engine_variants
# (each decode mode of the bf16 engine), gated_delta_fla (the Gated DeltaNet scan at 8k tokens,
# against flash-linear-attention too: its first call autotunes), pytest_suite, sync_gpu, fp32_error,
# agent_api (the OpenAI-API agent path vs the token-level one on the machine's CPU cores).
#
# The commit: a device copy of the tree has no .git. `fetch` writes .whl/COMMIT (git describe of
# HEAD, marked when the tree had local changes) and .whl/tree.sha256 (a hash of every tracked
# file); the summary reports the commit with whether the tree it ran on still matches those
# hashes. GPU_ROUND_COMMIT=... overrides; where .git exists, git is asked directly.
#
# A with/without variant of a stage is one more `st` line below (e.g. an engine row with
# engine.cuda_graph=false): its name's prefix (train_, logprobs, engine, gpu_1x, pytest, on_policy,
# gated_delta) tells the summary how to read it, and it appears under "stages" in gpu_summary.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
DEVICE=${GPU_ROUND_DEVICE:-cuda}
SCALE=1; [ "$DEVICE" = cuda ] || SCALE=3    # a CPU dry run: each cap x3 (a shared 2-core machine)
SCALE=${GPU_ROUND_SCALE:-$SCALE}             # (more on a machine busier than that)
BUDGET=${GPU_ROUND_BUDGET_S:-$((510 * SCALE))}
RESERVE=15      # seconds kept for the summary and the archive
MIN_STAGE=60    # a stage the budget would cut to less is skipped
T0=$SECONDS
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}   # the wheels (install); harmless where absent

usage() { sed -n '2,43p' "$0"; echo "stages of all: ${ALL_STAGES[*]}; by name only: ${EXTRA_STAGES[*]}"; }

install() {
  if "$PY" -c "import moe_rl._C, pydantic, megatron.core" 2>/dev/null; then
    echo "moe_rl, pydantic and megatron-core already import: nothing to install"
  else
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/*.whl: run \`bash scripts/gpu_round.sh fetch\` where a registry is, carry .whl"; return 1; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  fi
  "$PY" - <<'EOF' > "$J"
import json, platform, sys, torch
out = {"python": platform.python_version(), "torch": torch.__version__,
       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()})"}
for mod, name in (("megatron.core", "megatron_core"), ("triton", "triton"), ("liger_kernel", "liger_kernel"),
                  ("fla", "fla_core")):
    try:
        m = __import__(mod, fromlist=["_"])
        out[name] = getattr(m, "__version__", None) or "imports"
    except Exception as e:
        out[name] = None
if torch.cuda.is_available():
    out["cuda"] = torch.version.cuda
json.dump(out, sys.stdout)
EOF
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null > "$P/nvidia-smi.csv" || true
  cat "$J"
}

# st NAME CAP_S 'COMMAND': one stage. The command runs under bash -c with J (its JSON output file),
# P (its profile folder) and W (the work folder) set; its stdout and stderr go to logs/NAME.log.
st() {
  local name=$1 own=$(($2 * SCALE)) cmd=$3
  local run=("${SELECTED[@]:-${ALL_STAGES[@]}}")   # named stages, or `all`'s
  [[ " ${run[*]} " == *" $name "* ]] || return 0
  if [ -n "${INSTALL_FAILED:-}" ]; then   # nothing else imports: the round ends here, quickly
    echo "[gpu_round] $name: skipped, the install failed"
    printf '{"stage": "%s", "rc": null, "seconds": 0, "cap_s": %d, "skipped": "install failed"}\n' "$name" "$own" >> "$W/stages.jsonl"
    return 0
  fi
  local left=$((BUDGET - (SECONDS - T0) - RESERVE)) cap=$own
  [ "$cap" -gt "$left" ] && cap=$left
  # skipped when the budget cut it to under a minute; a stage whose own cap is shorter runs
  if [ "$cap" -lt "$own" ] && [ "$cap" -lt "$MIN_STAGE" ]; then
    echo "[gpu_round] $name: skipped, the round's budget has ${left} s left"
    printf '{"stage": "%s", "rc": null, "seconds": 0, "cap_s": %d, "skipped": "round budget spent"}\n' "$name" "$cap" >> "$W/stages.jsonl"
    return 0
  fi
  export J=$W/$name.json P=$W/profiles/$name CAP=$cap
  mkdir -p "$P"
  echo "[gpu_round] $name (cap ${cap} s): $cmd"
  local t0=$SECONDS pid rc
  # timeout leads its own process group and signals all of it; what is left of the group after
  # it returns (a worker that ignored SIGTERM) is killed, so the next stage finds the GPU free
  timeout -k 10 "$cap" bash -c "$cmd" > "$W/logs/$name.log" 2>&1 < /dev/null &
  pid=$!
  wait "$pid"; rc=$?
  kill -KILL -- "-$pid" 2>/dev/null || true
  printf '{"stage": "%s", "rc": %d, "seconds": %d, "cap_s": %d}\n' "$name" "$rc" $((SECONDS - t0)) "$cap" >> "$W/stages.jsonl"
  echo "[gpu_round] $name: rc=$rc in $((SECONDS - t0)) s"
  tail -3 "$W/logs/$name.log" | cut -c1-300
  # the budget is the measuring stages': it starts once the install is done
  if [ "$name" = install ]; then T0=$SECONDS; [ "$rc" = 0 ] || INSTALL_FAILED=1; fi
}

stages() {
  # the GPU stages; GPU_ROUND_DEVICE=cpu runs their CPU form at tiny sizes (a dry run of the round)
  local medium large train logprobs engine gpu_1x on_policy gdn gdn_fla gmm
  # the medium preset: the native step eager, then as configured (compiled on CUDA), then
  # megatron's rows (the H100 round of 2026-11-27 measured them and ran out of its cap in the
  # native row's compile: the MFU target's figure comes first now)
  # native_graphs (train.cuda_graphs) on CUDA only: a CPU refuses it
  local MEDIUM_ROWS=native_eager,native,native_graphs,megatron,megatron_recompute
  [ "$DEVICE" = cuda ] || MEDIUM_ROWS=native_eager,native,megatron,megatron_recompute
  if [ "$DEVICE" = cuda ]; then
    medium=medium large=large
    train="--device cuda --profile-dir \$P --out \$J"
    logprobs="--device cuda --shapes 8192,4096,151936"
    engine="--device cuda --config configs/gpu_1x.yaml"
    gpu_1x="configs/gpu_1x.yaml"
    # true_on_policy: configs/tiny.yaml's model in bf16, both sides eager (a compiled default
    # trainer would spend the cap compiling), KV cache and graphs for the 33 requests of a check
    on_policy="--device cuda --rounds 2 train.compile=false engine.max_running_requests=64"
    gdn="--device cuda --providers triton,torch --shapes 2,1024,16,128,128"
    gdn_fla="--device cuda"
    gmm="--device cuda --dtypes fp32"   # the engine's dtype (bf16 on sm_90 takes torch's CUTLASS kernel)
  else
    medium=tiny large=small
    train="--device cpu --steps 1 --warmup 0 --peak-tflops 1 --profile-dir \$P --out \$J"
    logprobs="--device cpu --shapes 256,256,8192 --reps 2 --no-compile"
    engine="--device cpu --concurrency 8 --max-new-tokens 16 --repeats 1 --ttft-samples 3"
    gpu_1x="configs/tiny.yaml train.steps=30"
    on_policy="--device cpu --rounds 1"
    gdn="--device cpu --reps 1 --providers triton,torch"    # triton: a row saying it needs CUDA
    gdn_fla="--device cpu --reps 1"
    gmm="--device cpu --reps 1 --dtypes fp32 --rows 4"   # Triton's interpreter: accuracy only
  fi
  # pytest: SIGINT to pytest alone (xdist's controller) 25 s before the cap (KILL 15 s later); it stops its workers
  # and writes the JUnit report of the tests that ended (through a wrapper that takes SIGINT even
  # where the round was started with it ignored, as a background job)
  local pytest="timeout --foreground -s INT -k 15 \$((CAP - 25)) $PY scripts/pytest_interruptible.py -q -p no:cacheprovider"
  # Caps, and what each stage took on the H100 round of 2026-11-27 at 8b0c57a (every stage ran to
  # its cap there, most keeping their figures). The stages between install and gpu_1x add up to
  # 395 s of the 495 s budget (510 - RESERVE); train_large (its 2.7 B-parameter CPU init took 34 s
  # of its 65 s cap, nothing measured), on_policy (nothing in 25 s) and logprobs (its kernels
  # unchanged since its two measured rounds; cap 40 s, its targets kept) run by name:
  #  stage          cap  took
  #  install         90  42       wheels, editable build (C++ sources one per core); outside the
  #                                510 s budget, which starts after it; the rest skipped if it fails
  #  pytest_gpu     115  cap      55 GPU tests on 6 workers (52 ended in 101 s)
  #  grouped_gemm    45  new      the decode tiles' 12 candidates in fp32 (gpu_1x's engine dtype),
  #                                the JSON rewritten after each rows case
  #  engine          40  cap(35)  the configured engine only (--variants none): start ~9 s, graph
  #                                capture, both figures, then the profiled request (--profile)
  #  train_medium   110  cap(100) 5 rows, each written as it fills: native_eager, native (compile
  #                                ~22 s), native_graphs (its own compile, then the recordings),
  #                                megatron; at 8b0c57a (no graphs row) megatron_recompute was cut
  #  engine_compiled 85  cap(55)  engine.compile: still in its graph capture at 55 s (no figure)
  #  gpu_1x        rest  cap(72)  train.compile=false: 15 steps at 2.0 s a step in 72 s
  #                                (gpu_1x_compiled, by name, measures the compiled step)
  #  name             cap_s  command
  st install           90    'install'
  st pytest_gpu       115    "$pytest -m gpu tests $XDIST --junitxml=\$J.xml"
  # the grouped GEMM's decode tiles timed on this GPU (candidates, the training tiles, torch's):
  # the fastest, saved, are what the later stages run (tuned_tiles: MOE_RL_GROUPED_GEMM_CONFIG),
  # and what is shipped as moe_rl/kernels/configs/grouped_gemm_<GPU>.json
  st grouped_gemm      45    "$([ "$DEVICE" = cuda ] || echo TRITON_INTERPRET=1) $PY -m moe_rl.cli bench grouped-gemm $gmm --out \$J --save \$W/grouped_gemm_tiles.json"
  if [ -s "$W/grouped_gemm_tiles.json" ]; then
    export MOE_RL_GROUPED_GEMM_CONFIG=$W/grouped_gemm_tiles.json
    echo "[gpu_round] the later stages run the grouped GEMM's decode tiles of $MOE_RL_GROUPED_GEMM_CONFIG"
  fi
  st engine            40    "$PY -m moe_rl.cli bench engine $engine --variants none --profile \$P --out \$J"
  st train_medium     110    "$PY -m moe_rl.train.megatron.bench --preset $medium $train --backends $MEDIUM_ROWS"
  # the same engine with its decode step compiled by Inductor before the capture (engine.compile)
  st engine_compiled   85    "$PY -m moe_rl.cli bench engine $engine --variants none engine.compile=true engine.static_decode=true --profile \$P --out \$J"
  st gpu_1x           150    "$PY -m moe_rl.cli train $gpu_1x train.compile=false output_dir=\$W/gpu_1x logging.progress=false"
  # not in `all`; by name only
  st logprobs          40    "$PY -m moe_rl.cli bench logprobs --json $logprobs --profile \$P --out \$J"
  # true_on_policy in bf16 with the exact kernels' Triton versions: its exactness checks and its
  # cost (engine tokens/s and train step, key on vs off)
  st on_policy         25    "$PY -m moe_rl.cli bench on-policy $on_policy --out \$J"
  st train_large       65    "$PY -m moe_rl.train.megatron.bench --preset $large $train --backends native"
  # the engine in bf16 (its CUDA graphs, beside gpu_1x's fp32 engine)
  st engine_bf16       25    "$PY -m moe_rl.cli bench engine $engine --variants none engine.dtype=bfloat16 --out \$J"
  # the Gated DeltaNet chunk scan: Triton vs torch, checked against the float64 recurrence
  st gated_delta       25    "$PY -m moe_rl.cli bench gated-delta --json $gdn > \$J"
  st train_fused      120    "$PY -m moe_rl.train.megatron.bench --preset $medium $train --backends native,native_fused"
  st train_large_megatron 150 "$PY -m moe_rl.train.megatron.bench --preset $large $train --backends megatron,megatron_recompute,native_eager"
  # the main job with its weight sync staged through host memory (configs/gpu_1x.yaml: ipc)
  st gpu_1x_gloo      150    "$PY -m moe_rl.cli train $gpu_1x train.compile=false sync.backend=gloo output_dir=\$W/gpu_1x_gloo logging.progress=false"
  # the main job's whole run as shipped (200 steps, compiled blocks): a GPU call of its own,
  # `bash scripts/gpu_round.sh gpu_1x_full` (its 495 s are the round's whole budget)
  st gpu_1x_full      495    "$PY -m moe_rl.cli train $gpu_1x output_dir=\$W/gpu_1x_full logging.progress=false"
  st gpu_1x_compiled  300    "$PY -m moe_rl.cli train $gpu_1x output_dir=\$W/gpu_1x_compiled logging.progress=false"
  # flash-linear-attention (.whl/fla) on this stage's path alone: where fla imports, transformers'
  # Qwen3-Next and megatron's GatedDeltaNet take its kernels, which the suite's CPU comparisons with
  # them must not (and fla's import asks CUDA for the device's capability)
  st gated_delta_fla  120    "own_wheels fla fla && $PY -m moe_rl.cli bench gated-delta --json $gdn_fla > \$J"
  st engine_variants   90    "$PY -m moe_rl.cli bench engine $engine --variants all engine.dtype=bfloat16 --out \$J"
  st pytest_suite     540    "$pytest tests ${XDIST/6/8} --junitxml=\$J.xml"
  st sync_gpu         200    "$PY -m moe_rl.cli bench sync --gpu only --json > \$J"
  st fp32_error       120    "$PY scripts/fp32_logprob_error.py --device $DEVICE > \$J"
  # the OpenAI-API agent path vs the token-level path (examples/openai_agent/bench.py), on the
  # machine's CPU cores (the configs' device, cpu): what the agent's own client costs when it has
  # cores of its own (env.agent_workers as shipped: one per 8 cores, so 2 on 16), through the
  # engine's own endpoints and through the workers' gateways (env.agent_gateway=true), every
  # run from one learned policy held still (the bench trains it first), so that both paths do the
  # same work per sample; steps 21-100. Where openai does not import, its wheels (.whl/agent) go
  # to a folder of their own, on this stage's path only, so that no other stage sees their
  # versions of anyio, h11, idna.
  st agent_api        420    "own_wheels openai agent && $PY examples/openai_agent/bench.py --pairs 3 --cpu --arm gateway=env.agent_gateway=true --json \$J"
}
# own_wheels MODULE DIR: where MODULE does not import, .whl/DIR's wheels go to /tmp/site_DIR, on the
# calling stage's path alone (their versions of shared dependencies must not reach other stages)
own_wheels() {
  export PYTHONPATH=/tmp/site_$2:$PYTHONPATH
  "$PY" -c "import $1" 2>/dev/null || "$PY" -m pip install -q --no-index --no-deps --no-compile --target "/tmp/site_$2" .whl/"$2"/*.whl
}
ALL_STAGES=(install pytest_gpu grouped_gemm engine train_medium engine_compiled gpu_1x)
EXTRA_STAGES=(logprobs train_large on_policy engine_bf16 gated_delta train_fused train_large_megatron gpu_1x_compiled gpu_1x_gloo
              gpu_1x_full
              gated_delta_fla engine_variants pytest_suite sync_gpu fp32_error agent_api)

fetch() {  # .whl/ is in .gitignore. Pinned: what the round tests must not change with a release
  # (megatron-core 0.19.2 is what the CPU suite checks; the rest as on the CPU machines and the
  # H200 round of 2026-11-26). What an earlier fetch left (another pin, another folder) goes first:
  # install() takes every wheel of .whl/
  rm -f .whl/*.whl .whl/*/*.whl
  download() {  # download DIR PACKAGE...: the GPU machine's wheels (cp312, manylinux) into DIR
    local dir=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d "$dir" "$@"
  }
  download .whl megatron-core==0.19.2 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2 liger-kernel==0.8.5 peft==0.21.2 \
    || { echo "[gpu_round] fetch: pip download failed (message above); the GPU machine has no registry" >&2; return 1; }
  # flash-linear-attention's kernels, for gated_delta_fla only (a folder of their own, as agent's)
  download .whl/fla fla-core==0.6.0 einops==0.8.2 \
    || { echo "[gpu_round] fetch: pip download of fla-core failed (message above)" >&2; return 1; }
  # the openai client and what it needs, for agent_api only (aiohttp too: its aiohttp client wants
  # aiohttp>=3.14.4, newer than the image's may be)
  download .whl/agent openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0 anyio==4.16.0 \
    sniffio==1.3.1 jiter==0.19.0 idna==3.20 aiohttp==3.14.5 multidict==7.2.1 yarl==1.25.1 \
    propcache==0.5.4 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 attrs==26.1.0 \
    || { echo "[gpu_round] fetch: pip download of the openai client failed (message above)" >&2; return 1; }
  # the commit, for a device copy of the tree without .git
  local desc; desc=$(git describe --always --abbrev=12 HEAD)
  [ -n "$(git status --porcelain --untracked-files=no)" ] && desc="$desc+local-changes"
  echo "$desc" > .whl/COMMIT
  git ls-files -z | xargs -0 sha256sum > .whl/tree.sha256
  ls .whl; echo "commit: $desc"
}

cmd=${1:-}
case $cmd in
  fetch) fetch; exit $? ;;
  ""|-h|--help) usage; exit 2 ;;
  all) SELECTED=() ;;
  *) SELECTED=("$@")
     for s in "${SELECTED[@]}"; do
       [[ " ${ALL_STAGES[*]} ${EXTRA_STAGES[*]} " == *" $s "* ]] \
         || { echo "unknown stage $s (fetch, all, ${ALL_STAGES[*]} ${EXTRA_STAGES[*]})" >&2; exit 2; }
     done ;;
esac

W=${GPU_ROUND_WORK:-$(mktemp -d /tmp/gpu_round.XXXX)}
mkdir -p "$W/logs" "$W/profiles" && W=$(cd "$W" && pwd)
export W PY
export -f install own_wheels
XDIST=""; "$PY" -c "import xdist" 2>/dev/null && [ "$DEVICE" = cuda ] && XDIST="-n 6"
echo "[gpu_round] device $DEVICE, budget ${BUDGET} s, work folder $W, results in $OUT"
stages
"$PY" scripts/gpu_summary.py "$W" --out "$OUT" --device "$DEVICE"
rc=$?
echo "[gpu_round] done in $((SECONDS - T0)) s"
exit $rc
