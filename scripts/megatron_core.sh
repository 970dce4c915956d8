#!/usr/bin/env bash
# tests/megatron against every supported megatron-core release, not only the one pip installed.
#
#   bash scripts/megatron_core.sh fetch          # called by scripts/install.sh test
#   bash scripts/megatron_core.sh test [ARGS]    # called by `make test`; ARGS go to pytest
#
# pip installs one megatron-core per Python: 0.16.x on Python 3.10/3.11 (0.17+ require 3.12),
# the newest (0.19.x today) on 3.12+, which is what GPU users get. The other supported releases
# (MEGATRON_CORE_VERSIONS, minus the installed one) are fetched as cp312 wheels from the package
# registry into the ignored folder .mcore/ (downloaded once, cached there) and unpacked into
# .mcore/<version>/; their modules are pure Python as far as moe-rl uses them, so they import on
# 3.11 too. `test` runs tests/megatron once per fetched release with it first on PYTHONPATH.
# MEGATRON_CORE_VERSIONS= (empty) turns the extra passes off.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MEGATRON_CORE_VERSIONS=${MEGATRON_CORE_VERSIONS-0.16.1 0.19.2}
CACHE=.mcore

installed() { "$PY" -c "import importlib.metadata as m; print(m.version('megatron-core'))" 2>/dev/null || true; }

# the supported releases other than the installed one
others() {
  local have; have=$(installed)
  for v in $MEGATRON_CORE_VERSIONS; do [ "$v" = "$have" ] || echo "$v"; done
}

fetch_one() {
  local v=$1 dir=$CACHE/$1
  [ -f "$dir/megatron/core/package_info.py" ] && return 0
  mkdir -p "$CACHE"
  local wheel
  wheel=$(ls "$CACHE"/megatron_core-"$v"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    echo "[megatron-core] downloading megatron-core==$v into $CACHE/ (tests/megatron runs against it)"
    if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
        -d "$CACHE" "megatron-core==$v"; then
      cat >&2 <<EOF
[megatron-core] ERROR: could not download megatron-core==$v from the package registry (pip's
message above). \`make test\` runs tests/megatron against each supported megatron-core release
(MEGATRON_CORE_VERSIONS="$MEGATRON_CORE_VERSIONS"; installed: $(installed)) and needs this wheel:
  - with a registry reachable again, rerun \`make test\` (the wheel is cached in $CACHE/ after that);
  - without one, copy megatron_core-$v-*.whl into $CACHE/ by hand;
  - or skip the extra passes explicitly: make test MEGATRON_CORE_VERSIONS=
EOF
      exit 1
    fi
    wheel=$(ls "$CACHE"/megatron_core-"$v"-*.whl | head -1)
  fi
  # unpack next to the final folder, then rename: an interrupted unpack never looks complete
  rm -rf "$dir.tmp" && "$PY" -m zipfile -e "$wheel" "$dir.tmp" && rm -rf "$dir" && mv "$dir.tmp" "$dir"
  echo "[megatron-core] $v unpacked into $dir/"
}

case ${1:?usage: megatron_core.sh fetch | test [pytest args]} in
  fetch)
    for v in $(others); do fetch_one "$v"; done ;;
  test)
    shift
    rc=0
    for v in $(others); do
      dir=$CACHE/$v
      if [ ! -f "$dir/megatron/core/package_info.py" ]; then
        echo "[megatron-core] $dir/ is missing: run \`bash scripts/megatron_core.sh fetch\` (or \`make install-test\`)" >&2
        rc=1; continue
      fi
      # NO_VCS_VERSION: megatron-core would otherwise append this checkout's git hash to its version
      export_env=(env "PYTHONPATH=$PWD/$dir${PYTHONPATH:+:$PYTHONPATH}" NO_VCS_VERSION=1)
      got=$("${export_env[@]}" "$PY" -W ignore -c "import megatron.core as m; print(m.__version__)" 2>/dev/null | tail -1)
      if [ "$got" != "$v" ]; then
        echo "[megatron-core] $dir/ imports as megatron-core '$got', expected $v" >&2
        rc=1; continue
      fi
      echo "[megatron-core] tests/megatron against megatron-core $v ($dir/ first on PYTHONPATH)"
      t0=$SECONDS
      "${export_env[@]}" "$PY" -m pytest -q tests/megatron "$@" || rc=1
      echo "[megatron-core] tests/megatron against $v: $((SECONDS - t0)) s"
    done
    exit $rc ;;
  *) echo "unknown command $1 (fetch, test)" >&2; exit 2 ;;
esac
