#!/usr/bin/env bash
# One prepared GPU check that fits one 10-minute command on a machine with no network (the H200
# box: torch 2.11 + CUDA 13.0, Triton 3.6, Python 3.12, nvcc and ninja in the image):
#
#   bash bench/gpu_check.sh OUT_DIR [WHEELS_DIR]
#   DRY_RUN=1 bash bench/gpu_check.sh OUT_DIR [WHEELS_DIR]    # print the plan, run nothing
#
# 1. installs the wheels brought along in WHEELS_DIR (flashinfer-python, apache-tvm-ffi, ...)
#    with `pip install --no-deps --no-index --target $SITE_DIR`, put first on PYTHONPATH;
# 2. records the machine (nvidia-smi, python, torch, CUDA, GPU, packages) in machine.txt;
# 3. checks the toolchain flashinfer's first call needs: a prebuilt flashinfer-jit-cache, or
#    nvcc and ninja for its JIT (flashinfer-cubin alone holds no JIT modules), and says which;
# 4. runs the CUDA tests of each file BY NAME (`-m cuda`, so a missing optional package in some
#    other test file cannot stop collection): tests/test_graphs_cuda.py,
#    tests/test_paged_attention.py, tests/test_moe_kernels.py, tests/test_quant_kernels.py;
# 5. with time left, `python -m graphs.profile` on the bundled model or a tiny random one.
#
# Every part runs under its own `timeout`, clipped to what is left of TOTAL_BUDGET, and the
# script goes on after a failing part. summary.txt is rewritten after every part and once more
# on exit (also after a failure, a timeout or a signal), so it is there even if the command is
# cut off. OUT_DIR ends with at most 8 files (the device tool brings back 8): summary.txt,
# machine.txt, install.log, toolchain.txt, pytest.log, profile.txt, profile.json, junit.tar.gz.
# The exit code is the number of failed parts.
#
# Knobs (environment): PYTHON (default python3, else python), TOTAL_BUDGET (s, default 540),
# GRAPHS_TIMEOUT (default 280), TRITON_TIMEOUT (per Triton test file, default 60),
# TEST_TIMEOUT (per test with pytest-timeout, default 240), PROFILE (0/1, default 1),
# PROFILE_TIMEOUT (default 90), BATCH_SIZES (default 1,2,4,8,16,32), BUDGET (default 16),
# SITE_DIR (default /tmp/gpu_check_site), PYTEST_ARGS (extra pytest args), DRY_RUN (0/1),
# MIN_PART (s, default 10: a part with less time left is skipped).

set -u
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT=${1:?usage: bash bench/gpu_check.sh [--dry-run] OUT_DIR [WHEELS_DIR]}
WHEELS=${2:-}
DRY=${DRY_RUN:-0}
PY=${PYTHON:-$(command -v python3 || command -v python || echo python3)}
BUDGET_S=${TOTAL_BUDGET:-540}
BATCH_SIZES=${BATCH_SIZES:-1,2,4,8,16,32}
BUDGET=${BUDGET:-16}
SITE=${SITE_DIR:-/tmp/gpu_check_site}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" || exit 99
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 99
mkdir -p "$WORK/junit"
cd "$ROOT" || exit 99
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 8)}  # flashinfer's ninja -j
START=$SECONDS
DEADLINE=$((START + BUDGET_S))
CUDA_TESTS=(tests/test_graphs_cuda.py tests/test_paged_attention.py tests/test_moe_kernels.py
            tests/test_quant_kernels.py)

declare -a NAMES=() STATUS=()
FAILED=0
CURRENT=""
CHILD=""
TOOLCHAIN="not checked"
rm -f "$OUT/summary.txt"

write_summary() {  # write_summary [FINAL_NOTE]: the whole summary, atomically
    local tmp="$OUT/.summary.tmp" i
    {
        echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ): $((SECONDS - START))s of ${BUDGET_S}s" \
             "budget, python $PY$( [ "$DRY" = "1" ] && echo ', DRY RUN: nothing was run')"
        echo "flashinfer toolchain: $TOOLCHAIN"
        for i in "${!NAMES[@]}"; do
            printf '  %-40s %s\n' "${NAMES[$i]}" "${STATUS[$i]}"
        done
        if [ -n "$CURRENT" ]; then printf '  %-40s %s\n' "$CURRENT" "${1:-RUNNING}"; fi
        if [ "$DRY" != "1" ] && ls "$WORK"/junit/*.xml >/dev/null 2>&1; then
            timeout 20 "$PY" - "$WORK"/junit/*.xml <<'EOF' 2>&1
import sys
import xml.etree.ElementTree as ET
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        print(f"  {path.rsplit('/', 1)[-1]}: unreadable junit ({e})")
        continue
    for s in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
        print(f"  {path.rsplit('/', 1)[-1][:-4]}: {s.get('tests')} run, {s.get('failures')} "
              f"failed, {s.get('errors')} errors, {s.get('skipped')} skipped")
        for case in s.iter("testcase"):
            for bad in ("failure", "error"):
                el = case.find(bad)
                if el is not None:
                    msg = (el.get("message") or "").splitlines()[:1]
                    print(f"    {bad}: {case.get('name')}: {msg[0][:160] if msg else ''}")
EOF
        fi
        echo "  results in $OUT"
    } >"$tmp" 2>&1
    mv -f "$tmp" "$OUT/summary.txt"
}

finish() {  # EXIT trap: the summary (with an interrupted part, if any) and the junit files
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$CHILD" ]; then  # a part cut short by a signal: stop its command too
        kill -TERM "$CHILD" 2>/dev/null
        sleep 1
        kill -KILL "$CHILD" 2>/dev/null
    fi
    if [ -n "$CURRENT" ]; then
        NAMES+=("$CURRENT"); STATUS+=("INTERRUPTED (exit $rc)"); FAILED=$((FAILED + 1))
        CURRENT=""
    fi
    write_summary
    if ls "$WORK"/junit/*.xml >/dev/null 2>&1; then
        tar -czf "$OUT/junit.tar.gz" -C "$WORK" junit 2>/dev/null
    fi
    cat "$OUT/summary.txt"
    rm -rf "$WORK"
    exit "$FAILED"
}
trap finish EXIT
trap 'exit 130' INT TERM

record() {  # record NAME STATUS [failed]
    NAMES+=("$1"); STATUS+=("$2")
    if [ "${3:-}" = "failed" ]; then FAILED=$((FAILED + 1)); fi
    write_summary
}

part() {  # part NAME LOG LIMIT CMD...: run CMD with a time limit, append to OUT/LOG, go on
    local name=$1 log=$2 want=$3
    shift 3
    local left=$((DEADLINE - SECONDS - 15)) limit=$want
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ "$DRY" = "1" ]; then
        record "$name" "DRY: timeout ${want}s $*"
        return 0
    fi
    if [ "$limit" -lt "${MIN_PART:-10}" ]; then
        record "$name" "SKIPPED ($(( left > 0 ? left : 0 ))s left of the ${BUDGET_S}s budget)" failed
        return 0
    fi
    CURRENT=$name
    write_summary
    echo "=== $name ($(date +%H:%M:%S), limit ${limit}s)"
    echo "=== $name ($(date +%H:%M:%S), limit ${limit}s): $*" >>"$OUT/$log"
    local t0=$SECONDS rc
    # In the background with `wait`, so a signal reaches the EXIT trap at once; `0<&0` keeps a
    # here-document on stdin (an asynchronous command would otherwise read /dev/null).
    timeout --kill-after=10 "$limit" "$@" >>"$OUT/$log" 2>&1 0<&0 &
    CHILD=$!
    wait "$CHILD"
    rc=$?
    CHILD=""
    tail -n 15 "$OUT/$log"
    local st="ok"
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        st="TIMEOUT after ${limit}s"
    elif [ $rc -eq 5 ] && [ "${log#pytest}" != "$log" ]; then
        st="NO TESTS SELECTED (pytest exit 5)"
    elif [ $rc -ne 0 ]; then
        st="FAILED (exit $rc)"
    fi
    CURRENT=""
    if [ "$st" = "ok" ]; then
        record "$name" "ok, $((SECONDS - t0))s, $log"
    else
        record "$name" "$st, $((SECONDS - t0))s, $log" failed
    fi
}

# ---- 1. wheels -------------------------------------------------------------------------------
if [ -n "$WHEELS" ]; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        part "install wheels from $WHEELS" install.log 120 \
            "$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir \
            --disable-pip-version-check --upgrade --target "$SITE" "$WHEELS"/*.whl
    else
        record "install wheels" "FAILED (no .whl files in $WHEELS)" failed
    fi
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
    export PATH="$SITE/bin:$PATH"
fi

# ---- 2. the machine --------------------------------------------------------------------------
part "nvidia-smi" machine.txt 30 bash -c 'nvidia-smi && nvidia-smi -q -d CLOCK,POWER,MEMORY'
part "environment" machine.txt 90 "$PY" - <<'EOF'
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    pci = [getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}",
          f"{p.multi_processor_count} SMs", "pci", pci)
missing = []
for mod in ("flashinfer", "tvm_ffi", "pynvml", "triton", "pytest", "pytest_timeout", "safetensors",
            "tiktoken", "tqdm", "hypothesis", "scipy", "httpx"):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, "__version__", "?"), getattr(m, "__file__", ""))
    except Exception as e:  # noqa: BLE001 - report and go on
        print(mod, "MISSING:", type(e).__name__, e)
        missing.append(mod)
if torch.cuda.is_available():
    from ops.attention_gpu import MLADevice, mla_backend, mla_unsupported_reason
    dev = MLADevice.of(0)
    for r, p_, dt in ((512, 64, torch.bfloat16), (64, 16, torch.bfloat16), (512, 64, torch.float32)):
        print(f"mla {r}/{p_} {dt}:", mla_backend(r, p_, dt, dev),
              (mla_unsupported_reason(r, p_, dt, dev) or "")[:300])
sys.exit(1 if not torch.cuda.is_available() or {"pytest", "safetensors"} & set(missing) else 0)
EOF

# ---- 3. flashinfer's toolchain ----------------------------------------------------------------
check_toolchain() {  # what flashinfer's first call will build with (jit/cpp_ext.py, jit/env.py)
    local nvcc="" cuda_home="${CUDA_HOME:-${CUDA_PATH:-}}" ninja prebuilt fi_ok
    if [ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ]; then
        nvcc="$cuda_home/bin/nvcc"
    elif command -v nvcc >/dev/null 2>&1; then
        nvcc=$(command -v nvcc)
    elif [ -x /usr/local/cuda/bin/nvcc ]; then
        nvcc=/usr/local/cuda/bin/nvcc
        export CUDA_HOME=/usr/local/cuda PATH="/usr/local/cuda/bin:$PATH"
    fi
    ninja=$(command -v ninja 2>/dev/null || true)
    # flashinfer takes CUDA_HOME, CUDA_PATH or nvcc's grandparent for the CUDA headers
    local home=${CUDA_HOME:-${CUDA_PATH:-$( [ -n "$nvcc" ] && dirname "$(dirname "$nvcc")")}}
    local cxx headers="missing"
    cxx=$(command -v c++ 2>/dev/null || command -v g++ 2>/dev/null || true)
    for h in "$home/include/cuda_runtime.h" "$home/targets/x86_64-linux/include/cuda_runtime.h"
    do
        if [ -f "$h" ]; then headers=$h; break; fi
    done
    prebuilt=$(timeout 60 "$PY" -c '
import importlib.util as u
print(" ".join(n for n in ("flashinfer_jit_cache", "flashinfer_cubin") if u.find_spec(n)))
' 2>/dev/null)
    fi_ok=$(timeout 60 "$PY" -c 'import flashinfer; print(flashinfer.__version__)' 2>&1 | tail -1)
    {
        echo "flashinfer: $fi_ok"
        echo "nvcc: ${nvcc:-none} $( [ -n "$nvcc" ] && "$nvcc" --version | grep -o 'release [0-9.]*')"
        echo "ninja: ${ninja:-none} $( [ -n "$ninja" ] && "$ninja" --version)"
        echo "CUDA headers (from ${home:-?}): $headers"
        echo "host C++ compiler: ${cxx:-none}"
        echo "prebuilt kernel packages: ${prebuilt:-none}"
        echo "CUDA_HOME=${CUDA_HOME:-} MAX_JOBS=$MAX_JOBS"
    } >>"$OUT/toolchain.txt" 2>&1
    cat "$OUT/toolchain.txt"
    case " $prebuilt " in
        *" flashinfer_jit_cache "*) TOOLCHAIN="prebuilt flashinfer-jit-cache (no JIT build)"
                                     return 0 ;;
    esac
    if [ -n "$nvcc" ] && [ -n "$ninja" ]; then
        TOOLCHAIN="JIT with $nvcc and $ninja (first flashinfer calls compile: minutes)"
        if [ "$headers" = missing ] || [ -z "$cxx" ]; then
            TOOLCHAIN="$TOOLCHAIN; WARNING: CUDA headers $headers, host compiler ${cxx:-none}"
        fi
        return 0
    fi
    TOOLCHAIN="NONE: no flashinfer-jit-cache and no nvcc+ninja (nvcc ${nvcc:-missing}," \
" ninja ${ninja:-missing}); flashinfer's first kernel call will fail"
    case "$fi_ok" in
        [0-9]*) return 1 ;;  # flashinfer is there and cannot build its kernels
        *) TOOLCHAIN="$TOOLCHAIN (flashinfer not importable: its tests skip)"; return 0 ;;
    esac
}
if [ "$DRY" = "1" ]; then
    record "flashinfer toolchain" "DRY: nvcc, ninja, flashinfer_jit_cache / flashinfer_cubin"
elif check_toolchain; then
    record "flashinfer toolchain" "ok, toolchain.txt"
else
    record "flashinfer toolchain" "FAILED, toolchain.txt" failed
fi

# ---- 4. CUDA tests, file by file -----------------------------------------------------------------
TIMEOUT_ARGS=()
if [ "$DRY" != "1" ] && timeout 60 "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; then
    TIMEOUT_ARGS=(--timeout="${TEST_TIMEOUT:-240}")
fi
for f in "${CUDA_TESTS[@]}"; do
    name=$(basename "$f" .py)
    limit=${TRITON_TIMEOUT:-60}
    if [ "$f" = tests/test_graphs_cuda.py ]; then limit=${GRAPHS_TIMEOUT:-280}; fi
    # shellcheck disable=SC2086
    part "$f -m cuda" pytest.log "$limit" \
        "$PY" -m pytest "$f" -m cuda -p no:cacheprovider -rA -o addopts="" \
        --junitxml="$WORK/junit/$name.xml" ${TIMEOUT_ARGS[@]+"${TIMEOUT_ARGS[@]}"} \
        ${PYTEST_ARGS:-}
done

# ---- 5. graph profile, with what time is left -------------------------------------------------
if [ "${PROFILE:-1}" = "1" ]; then
    MODEL_ARGS=()
    if [ ! -f models/kimi-mini/config.json ] || [ ! -f models/kimi-mini-dflash/config.json ]; then
        TINY="$WORK/tiny"
        part "write a tiny model" profile.txt 60 bash -c \
            "'$PY' -m tools.make_tiny --out '$TINY/target' && \
             '$PY' -m tools.make_draft --target '$TINY/target' --out '$TINY/draft'"
        MODEL_ARGS=(--model "$TINY/target" --draft "$TINY/draft")
    fi
    part "graphs.profile" profile.txt "${PROFILE_TIMEOUT:-90}" \
        "$PY" -m graphs.profile ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} \
        --batch-sizes "$BATCH_SIZES" --budget "$BUDGET" --output "$OUT/profile.json" \
        --no-progress
fi
exit "$FAILED"  # the EXIT trap writes the summary and exits with the failed-part count
