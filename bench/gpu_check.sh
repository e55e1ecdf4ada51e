#!/usr/bin/env bash
# One prepared GPU check for a machine with no network (the H200 box):
#
#   bash bench/gpu_check.sh OUT_DIR [WHEELS_DIR]
#
# 1. installs the wheels brought along in WHEELS_DIR (flashinfer-python, apache-tvm-ffi,
#    nvidia-ml-py, ...) with `pip install --no-deps`;
# 2. records the machine (nvidia-smi, python, torch, CUDA, flashinfer, pynvml);
# 3. runs the CUDA-marked tests (junit XML + log);
# 4. runs `python -m graphs.profile` on the bundled model when present, else on a tiny random
#    one written here (JSON + table), and with TUNE=1 also `--tune` into OUT_DIR/budgets.toml.
#
# Every part runs under its own time limit and the script goes on after a failing part; the
# summary at the end lists each part's status, and the exit code is the number of failed parts.
# Knobs (environment): PYTHON (default python), PART_TIMEOUT (s, default 420), BATCH_SIZES
# (default 1,2,4,8,16,32), BUDGET (default 16), TUNE (0/1), PYTEST_ARGS (extra pytest args).

set -u
OUT=${1:?usage: bash bench/gpu_check.sh OUT_DIR [WHEELS_DIR]}
WHEELS=${2:-}
PY=${PYTHON:-python}
LIMIT=${PART_TIMEOUT:-420}
BATCH_SIZES=${BATCH_SIZES:-1,2,4,8,16,32}
BUDGET=${BUDGET:-16}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 99
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

declare -a NAMES=() STATUS=()
FAILED=0

part() {  # part NAME LOGFILE CMD...: run with a time limit, log, record the status, go on
    local name=$1 log=$2
    shift 2
    echo "=== $name ($(date +%H:%M:%S))" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS rc
    timeout --kill-after=15 "$LIMIT" "$@" >"$OUT/$log" 2>&1
    rc=$?
    tail -n 25 "$OUT/$log"
    local st="ok"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then st="TIMEOUT after ${LIMIT}s"; fi
    if [ $rc -ne 0 ] && [ "$st" = "ok" ]; then st="FAILED (exit $rc)"; fi
    if [ "$st" != "ok" ]; then FAILED=$((FAILED + 1)); fi
    NAMES+=("$name")
    STATUS+=("$st, $((SECONDS - t0))s, log $log")
}

# ---- 1. wheels -------------------------------------------------------------------------------
if [ -n "$WHEELS" ]; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        part "install wheels from $WHEELS" install.log \
            "$PY" -m pip install --no-deps --no-index --disable-pip-version-check "$WHEELS"/*.whl
    else
        echo "no .whl files in $WHEELS" | tee -a "$OUT/summary.txt"
        NAMES+=("install wheels"); STATUS+=("FAILED (no wheels in $WHEELS)"); FAILED=$((FAILED + 1))
    fi
fi

# ---- 2. the machine --------------------------------------------------------------------------
part "nvidia-smi" nvidia-smi.txt bash -c 'nvidia-smi && nvidia-smi -q && nvidia-smi topo -m'
part "environment" environment.txt "$PY" - <<'EOF'
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}")
missing = []
for mod in ("flashinfer", "pynvml", "triton", "pytest", "scipy", "safetensors", "tiktoken", "tqdm"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:  # noqa: BLE001 - report and go on
        print(mod, "MISSING:", type(e).__name__, e)
        missing.append(mod)
sys.exit(1 if not torch.cuda.is_available() or {"pytest", "safetensors"} & set(missing) else 0)
EOF

# ---- 3. CUDA-marked tests ----------------------------------------------------------------------
# shellcheck disable=SC2086
part "pytest -m cuda" pytest-cuda.log \
    "$PY" -m pytest -m cuda -p no:cacheprovider -rA -o addopts="" \
    --junitxml="$OUT/pytest-cuda.xml" ${PYTEST_ARGS:-} tests

# ---- 4. graph profile ------------------------------------------------------------------------
MODEL_ARGS=()
if [ -f models/kimi-mini/config.json ] && [ -f models/kimi-mini-dflash/config.json ]; then
    echo "profiling the bundled model" | tee -a "$OUT/summary.txt"
else
    TINY="$OUT/tiny"
    part "write a tiny model" make-tiny.log bash -c \
        "'$PY' -m engine.tools.make_tiny --out '$TINY/target' && \
         '$PY' -m engine.tools.make_draft --target '$TINY/target' --out '$TINY/draft'"
    MODEL_ARGS=(--model "$TINY/target" --draft "$TINY/draft")
fi
part "graphs.profile" profile.txt "$PY" -m graphs.profile ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} \
    --batch-sizes "$BATCH_SIZES" --budget "$BUDGET" --output "$OUT/profile.json" --no-progress
if [ "${TUNE:-0}" = "1" ]; then
    part "graphs.profile --tune" tune.txt "$PY" -m graphs.profile ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} \
        --batch-sizes "$BATCH_SIZES" --tune --policy-out "$OUT/budgets.toml" \
        --output "$OUT/tune.json" --steps 4 --no-progress
fi

# ---- summary -----------------------------------------------------------------------------------
{
    echo
    echo "summary ($(date)):"
    for i in "${!NAMES[@]}"; do
        printf '  %-32s %s\n' "${NAMES[$i]}" "${STATUS[$i]}"
    done
    if [ -f "$OUT/pytest-cuda.xml" ]; then
        "$PY" - "$OUT/pytest-cuda.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
r = ET.parse(sys.argv[1]).getroot()
s = r if r.tag == "testsuite" else r.find("testsuite")
print(f"  cuda tests: {s.get('tests')} run, {s.get('failures')} failed, "
      f"{s.get('errors')} errors, {s.get('skipped')} skipped")
for case in s.iter("testcase"):
    for bad in ("failure", "error"):
        if case.find(bad) is not None:
            print(f"    {bad}: {case.get('classname')}::{case.get('name')}")
EOF
    fi
    echo "  results in $OUT"
} | tee -a "$OUT/summary.txt"
exit "$FAILED"
