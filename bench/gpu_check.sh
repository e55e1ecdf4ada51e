#!/usr/bin/env bash
# One prepared GPU check that fits one 10-minute command on a machine with no network (the GPU
# box: torch 2.11 + CUDA 13.0, Triton 3.6, Python 3.12, nvcc and ninja in the image):
#
#   bash bench/gpu_check.sh OUT_DIR [WHEELS_DIR]
#   DRY_RUN=1 bash bench/gpu_check.sh OUT_DIR [WHEELS_DIR]    # print the parts, run nothing
#
# It checks the path that ships: a checkpoint stored as Kimi K2.5 stores one (bf16, INT4
# experts, Kimi's attention widths), written at run time by bench/gpu_check_model.py, loaded
# by the engine with the attention backend it picks on this machine. The parts, in order, each
# with its time budget:
#
# 1. installs the wheels brought along in WHEELS_DIR (docs/gpu.md lists them) with
#    `pip install --no-deps --no-index --target $SITE_DIR`, put first on PYTHONPATH;
# 2. records the GPU (nvidia-smi) in machine.txt;
# 3. toolchain: Python, torch, CUDA, the GPU, and every package the engine and the check
#    import, each missing one named with the wheels to carry (python -m bench.gpu_check_env);
#    then flashinfer's: not carried (its size) unless it imports, and then what its first
#    call compiles with (a prebuilt flashinfer-jit-cache, or nvcc and ninja); toolchain.txt;
# 4. tests/test_shipping_path.py: captured steps equal the eager step at every batch size,
#    greedy and sampled; `LLM.generate` with the auto backend equals the torch one (fp32;
#    in bf16 both follow an fp32 forward);
# 5. tests/test_graphs_cuda.py -m cuda: graph replay in every mode on a tiny fp32 pair, no
#    host sync in replay, flashinfer's twins (skipped, with the reason, without flashinfer);
# 6. the Triton kernels' CUDA tests, every file in one pytest call (one CUDA context, one
#    Triton cache, one budget): tests/test_paged_attention.py, tests/test_moe_kernels.py,
#    tests/test_quant_kernels.py;
# 7. one Kimi K2.5 layer at its real size (MLA and 384 INT4 experts, a tp-8 shard) prefilling
#    a 4,096-token chunk over a 32,768-token cached prefix, timed against the cost model's figure
#    for it (python -m bench.gpu_layer; both, their ratio and the slowest ops in profile.txt);
# 8. `python -m graphs.profile` on the shipping pair with `--attention auto` (the backend is
#    named in profile.txt and profile.json).
#
# Each part runs under `timeout` at its budget, clipped to what is left of TOTAL_BUDGET less
# RESERVE; at its limit the command gets SIGINT (pytest then ends its session and writes its
# JUnit report) and, GRACE seconds later, SIGKILL. Each test also has its own limit below the
# part's (pytest-timeout where installed, else bench/pytest_limit.py), so one hung test fails
# alone. The script goes on after a failing part. summary.txt is rewritten after every part
# and once more on exit (also after a failure, a timeout or a signal), so it is there even if
# the command is cut off. OUT_DIR ends with at most 8 files (the device tool brings back 8):
# summary.txt, machine.txt, install.log, toolchain.txt, pytest.log, profile.txt,
# profile.json, junit.tar.gz. The exit code is the number of failed parts.
#
# The budgets total 420 s, so the check and a machine's start leave a 15-minute device
# allowance room to rerun it once fixed.
#
# Knobs (environment): PYTHON (default python3, else python), TOTAL_BUDGET (s, default 435),
# RESERVE (s kept for the summary, default 15), GRACE (s from SIGINT to SIGKILL, default 10);
# the parts' budgets INSTALL_TIMEOUT (25), SMI_TIMEOUT (10), ENV_TIMEOUT (30),
# TOOLCHAIN_TIMEOUT (20), SHIPPING_TIMEOUT (120), GRAPHS_TIMEOUT (45), TRITON_TIMEOUT (70),
# LAYER_TIMEOUT (60), PAIR_TIMEOUT (10), PROFILE_TIMEOUT (30); TEST_TIMEOUT (s per test,
# default 120, at most a part's limit less GRACE; 0: no per-test limit), LAYER (0/1, default
# 1), PROFILE (0/1, default 1), BATCH_SIZES
# (default 1,4,16,32), BUDGET (default 16), SITE_DIR (default /tmp/gpu_check_site),
# PYTEST_ARGS (extra pytest args), DRY_RUN (0/1), MIN_PART (s, default 10: a part with less
# time left is skipped).

set -u
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
OUT=${1:?usage: bash bench/gpu_check.sh [--dry-run] OUT_DIR [WHEELS_DIR]}
WHEELS=${2:-}
DRY=${DRY_RUN:-0}
PY=${PYTHON:-$(command -v python3 || command -v python || echo python3)}
BUDGET_S=${TOTAL_BUDGET:-435}
RESERVE=${RESERVE:-15}
GRACE=${GRACE:-10}
BATCH_SIZES=${BATCH_SIZES:-1,4,16,32}
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
SHIPPING_TESTS=(tests/test_shipping_path.py)
GRAPH_TESTS=(tests/test_graphs_cuda.py)
TRITON_TESTS=(tests/test_paged_attention.py tests/test_moe_kernels.py tests/test_quant_kernels.py)
NOT_CARRIED="not carried (flashinfer-python is a 101 MB wheel plus about 55 MB of dependencies)"

declare -a NAMES=() STATUS=()
FAILED=0
PLANNED=0  # the budgets of the parts so far (DRY_RUN: of them all)
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
            printf '  %-48s %s\n' "${NAMES[$i]}" "${STATUS[$i]}"
        done
        if [ -n "$CURRENT" ]; then printf '  %-48s %s\n' "$CURRENT" "${1:-RUNNING}"; fi
        echo "  parts' budgets: ${PLANNED}s of ${BUDGET_S}s (${RESERVE}s kept for the summary)"
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
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
            if props:
                print(f"    {case.get('name')}: " + ", ".join(f"{k} {v}" for k, v in props.items()))
            for bad in ("failure", "error"):
                el = case.find(bad)
                if el is not None:
                    msg = (el.get("message") or "").splitlines()[:1]
                    print(f"    {bad}: {case.get('name')}: {msg[0][:160] if msg else ''}")
        reasons = {(el.get("message") or "")[:160] for el in s.iter("skipped")}
        for why in sorted(reasons - {""}):
            print(f"    skipped: {why}")
EOF
        fi
        echo "  results in $OUT"
    } >"$tmp" 2>&1
    mv -f "$tmp" "$OUT/summary.txt"
}

finish() {  # EXIT trap: the summary (with an interrupted part, if any) and the junit files
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$CHILD" ]; then  # a part cut short by a signal: SIGINT first, so pytest reports
        kill -INT "$CHILD" 2>/dev/null  # `timeout` passes it on to its command
        for _ in 1 2 3 4 5 6; do
            running "$CHILD" || break
            sleep 0.5
        done
        # `timeout` leads a process group of its own: the command and whatever it started
        kill -KILL -- "-$CHILD" 2>/dev/null
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
running() {  # running PID: alive and not yet a zombie waiting for this shell
    [ -r "/proc/$1/stat" ] && ! grep -q ') Z ' "/proc/$1/stat" 2>/dev/null
}
trap finish EXIT
trap 'exit 130' INT TERM

record() {  # record NAME STATUS [failed]
    NAMES+=("$1"); STATUS+=("$2")
    if [ "${3:-}" = "failed" ]; then FAILED=$((FAILED + 1)); fi
    write_summary
}

limit_for() {  # limit_for BUDGET: the seconds a part may take now (budget or what is left)
    local left=$((DEADLINE - SECONDS - RESERVE))
    echo $(( $1 < left ? $1 : left ))
}

part() {  # part NAME LOG BUDGET CMD...: run CMD with a time limit, append to OUT/LOG, go on
    local name=$1 log=$2 want=$3
    shift 3
    local limit left
    limit=$(limit_for "$want")
    PLANNED=$((PLANNED + want))
    if [ "$DRY" = "1" ]; then
        echo "part: $name: budget ${want}s: $*"
        record "$name" "DRY: budget ${want}s: $*"
        return 0
    fi
    if [ "$limit" -lt "${MIN_PART:-10}" ]; then
        left=$((DEADLINE - SECONDS - RESERVE))
        left=$(( left > 0 ? left : 0 ))
        record "$name" "SKIPPED (${left}s left of the ${BUDGET_S}s budget)" failed
        return 0
    fi
    CURRENT=$name
    write_summary
    echo "=== $name ($(date +%H:%M:%S), limit ${limit}s)"
    echo "=== $name ($(date +%H:%M:%S), limit ${limit}s): $*" >>"$OUT/$log"
    local t0=$SECONDS rc
    # In the background with `wait`, so a signal reaches the EXIT trap at once.
    # NOTE: SIGINT at the limit, not SIGTERM: pytest ends its session on it and writes its
    # JUnit report; SIGKILL follows after GRACE seconds for a command stuck in a C call.
    timeout --signal=INT --kill-after="$GRACE" "$limit" "$@" >>"$OUT/$log" 2>&1 &
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

pytest_part() {  # pytest_part NAME JUNIT BUDGET [-m MARK] FILE...: the files in one pytest call
    local name=$1 junit=$2 want=$3 per limit
    shift 3
    limit=$(limit_for "$want")
    per=${TEST_TIMEOUT:-120}
    if [ "$DRY" = "1" ]; then limit=$want; fi
    if [ "$per" -gt $((limit - GRACE)) ]; then per=$((limit - GRACE)); fi
    local args=()
    if [ "$per" -gt 0 ] && [ -n "$PER_TEST_PLUGIN" ]; then
        args=(-p "$PER_TEST_PLUGIN" --test-limit="$per")
    elif [ "$per" -gt 0 ]; then
        args=(--timeout="$per" --timeout-method=signal)
    fi
    # shellcheck disable=SC2086
    part "$name" pytest.log "$want" \
        "$PY" -m pytest "$@" -p no:cacheprovider -rA -o addopts="" \
        --junitxml="$WORK/junit/$junit.xml" ${args[@]+"${args[@]}"} ${PYTEST_ARGS:-}
}

# ---- 1. wheels -------------------------------------------------------------------------------
if [ -n "$WHEELS" ]; then
    if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        part "install wheels from $WHEELS" install.log "${INSTALL_TIMEOUT:-25}" \
            "$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir \
            --disable-pip-version-check --upgrade --target "$SITE" "$WHEELS"/*.whl
    else
        record "install wheels" "FAILED (no .whl files in $WHEELS)" failed
    fi
    export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
    export PATH="$SITE/bin:$PATH"
fi

# ---- 2. the machine --------------------------------------------------------------------------
part "nvidia-smi" machine.txt "${SMI_TIMEOUT:-10}" \
    bash -c 'nvidia-smi && nvidia-smi -q -d CLOCK,POWER,MEMORY'

# ---- 3. the toolchain: packages, then flashinfer's --------------------------------------------
part "toolchain: python packages" toolchain.txt "${ENV_TIMEOUT:-30}" "$PY" -m bench.gpu_check_env

check_flashinfer() {  # what flashinfer's first call will build with (jit/cpp_ext.py, jit/env.py)
    local nvcc="" cuda_home="${CUDA_HOME:-${CUDA_PATH:-}}" ninja prebuilt state
    # NOTE: flashinfer must import whole (its MLA module too); a partial install is what
    # `--attention auto` falls back from. The package check said which, in toolchain.txt
    # ("flashinfer: " and ops.attention_gpu.flashinfer_unavailable's answer).
    state=$(grep -m1 '^flashinfer: ' "$OUT/toolchain.txt" 2>/dev/null | cut -c13-)
    case "$state" in
        "imports whole") state="ok $(grep -m1 '^flashinfer-python ' "$OUT/toolchain.txt" \
                                     | awk '{print $2}')" ;;
        "") state="the package check printed no flashinfer line" ;;
    esac
    case "$state" in
        "ok "*) ;;
        *"No module named 'flashinfer'"*)
            TOOLCHAIN="$NOT_CARRIED: its tests skip, --attention auto takes the Triton kernels"
            return 0 ;;
        *"does not import"*)
            TOOLCHAIN="flashinfer imports only in part ($state): --attention auto falls back" \
" to the Triton kernels"
            return 0 ;;
        *) TOOLCHAIN="not checked ($state)"; return 1 ;;
    esac
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
    prebuilt=$(timeout 5 "$PY" -c '
import importlib.util as u
print(" ".join(n for n in ("flashinfer_jit_cache", "flashinfer_cubin") if u.find_spec(n)))
' 2>/dev/null)
    {
        echo "nvcc: ${nvcc:-none}" \
             "$( [ -n "$nvcc" ] && timeout 5 "$nvcc" --version | grep -o 'release [0-9.]*')"
        echo "ninja: ${ninja:-none} $( [ -n "$ninja" ] && timeout 5 "$ninja" --version)"
        echo "CUDA headers (from ${home:-?}): $headers"
        echo "host C++ compiler: ${cxx:-none}"
        echo "prebuilt kernel packages: ${prebuilt:-none}"
        echo "CUDA_HOME=${CUDA_HOME:-} MAX_JOBS=$MAX_JOBS"
    } >>"$OUT/toolchain.txt" 2>&1
    case " $prebuilt " in
        *" flashinfer_jit_cache "*) TOOLCHAIN="$state, prebuilt flashinfer-jit-cache (no JIT)"
                                     return 0 ;;
    esac
    if [ -n "$nvcc" ] && [ -n "$ninja" ]; then
        TOOLCHAIN="$state, JIT with $nvcc and $ninja (first flashinfer calls compile: minutes)"
        if [ "$headers" = missing ] || [ -z "$cxx" ]; then
            TOOLCHAIN="$TOOLCHAIN; WARNING: CUDA headers $headers, host compiler ${cxx:-none}"
        fi
        return 0
    fi
    TOOLCHAIN="$state, but no flashinfer-jit-cache and no nvcc+ninja (nvcc ${nvcc:-missing}," \
" ninja ${ninja:-missing}): flashinfer's first kernel call will fail"
    return 1
}
TOOLCHAIN_BUDGET=${TOOLCHAIN_TIMEOUT:-20}
PLANNED=$((PLANNED + TOOLCHAIN_BUDGET))
if [ "$DRY" = "1" ]; then
    echo "part: flashinfer toolchain: budget ${TOOLCHAIN_BUDGET}s"
    record "flashinfer toolchain" "DRY: budget ${TOOLCHAIN_BUDGET}s: flashinfer (whole, in part or\
 not carried), then flashinfer_jit_cache, nvcc, ninja"
else
    t0=$SECONDS
    CURRENT="flashinfer toolchain"
    if check_flashinfer; then ok=""; else ok=failed; fi
    CURRENT=""
    case "$TOOLCHAIN" in
        "not carried"*) st="not carried (size)" ;;
        "flashinfer imports only in part"*) st="only in part: falls back to Triton" ;;
        *) st=$( [ -z "$ok" ] && echo ok || echo FAILED) ;;
    esac
    record "flashinfer toolchain" "$st, $((SECONDS - t0))s, toolchain.txt" $ok
fi

# ---- 4-6. CUDA tests --------------------------------------------------------------------------
# How pytest limits each test: pytest-timeout where it imports (its signal method fails the
# test and goes on), else the check's own plugin (bench/pytest_limit.py).
PER_TEST_PLUGIN=""
timeout_line=$(grep -m1 '^pytest-timeout ' "$OUT/toolchain.txt" 2>/dev/null || true)
if [ "$DRY" != "1" ] && { [ -z "$timeout_line" ] || [[ "$timeout_line" == *" absent,"* ]]; }
then  # the package check found no pytest-timeout that imports
    PER_TEST_PLUGIN=bench.pytest_limit
fi
pytest_part "the shipping path: ${SHIPPING_TESTS[*]}" shipping "${SHIPPING_TIMEOUT:-120}" \
    "${SHIPPING_TESTS[@]}"
pytest_part "graph replay: ${GRAPH_TESTS[*]} -m cuda" graphs_cuda "${GRAPHS_TIMEOUT:-45}" \
    -m cuda "${GRAPH_TESTS[@]}"
pytest_part "Triton kernels: ${#TRITON_TESTS[@]} files -m cuda" triton_kernels \
    "${TRITON_TIMEOUT:-70}" -m cuda "${TRITON_TESTS[@]}"

# ---- 7. one Kimi layer at its real size against the cost model -------------------------------
if [ "${LAYER:-1}" = "1" ]; then
    part "real-size layer: Kimi K2.5 tp-8 shard, 4,096 tokens over 32,768 cached" profile.txt \
        "${LAYER_TIMEOUT:-60}" "$PY" -m bench.gpu_layer --tp 8 --prefix 32768 --chunk 4096 \
        --out "$WORK/layer.json"
fi

# ---- 8. graph profile of the shipping pair ---------------------------------------------------
if [ "${PROFILE:-1}" = "1" ]; then
    part "write the shipping pair" profile.txt "${PAIR_TIMEOUT:-10}" \
        "$PY" -m bench.gpu_check_model --out "$WORK/pair"
    part "graphs.profile (the shipping pair)" profile.txt "${PROFILE_TIMEOUT:-30}" \
        "$PY" -m graphs.profile --model "$WORK/pair/target" --draft "$WORK/pair/draft" \
        --attention auto --batch-sizes "$BATCH_SIZES" --budget "$BUDGET" \
        --output "$OUT/profile.json" --no-progress
fi
exit "$FAILED"  # the EXIT trap writes the summary and exits with the failed-part count
