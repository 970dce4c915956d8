#!/usr/bin/env bash
# Installs moe-rl into the current Python environment.
# A torch that is already installed (e.g. a CUDA build on a GPU machine) is kept; otherwise the
# CPU build is pinned, so that pip does not pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] no torch found: installing the CPU build torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
# The conformance suite (tests/sglang) runs SGLang's own code on CPU: the wheel only, without its
# dependencies (torch is kept; the few light ones it needs are in the test extra).
SGLANG_VERSION=0.5.23
if [[ ",${EXTRAS}," == *",test,"* ]]; then
  "$PY" -m pip install -q --no-deps "sglang==${SGLANG_VERSION}"
fi
# tests/megatron also runs against the supported megatron-core releases pip does not install on
# this Python (0.19.x on Python 3.11): their wheels, cached in .mcore/ (scripts/megatron_core.sh).
if [[ ",${EXTRAS}," == *",test,"* ]]; then
  PYTHON="$PY" bash scripts/megatron_core.sh fetch
fi
