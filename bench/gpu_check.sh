#!/usr/bin/env bash
# The runtime's GPU check in one short run (bench/README.md, "On a GPU"):
#
#     bash bench/gpu_check.sh        # from the repository root, with $OUT set
#
# Needs no network. (1) environment: GPU, Python, torch (must already be installed:
# it cannot be installed here); (2) the device tests, tests/engine/runtime -k "cuda or devices"
# (CPU and CUDA caches must hold the same bytes); (3) the runtime benchmarks with
# --device cuda; (4) bench/gpu_arith.py: how often compiled Triton's fp32 division and
# multiply-add round differently from kvpolicy's (and the interpreted kernels') operations.
# Bounded: 240 s of tests, 180 s of benchmarks, 60 s of arithmetic, well under 9 minutes.
#
# Writes to $OUT (default /tmp/kvpolicy-gpu-check): gpu_check.log (everything), gpu_env.txt,
# gpu_tests.log, gpu_tests.xml, gpu_bench.log, gpu_bench.json (every figure of the GPU run),
# gpu_arith.json, gpu_check_status.txt. Exit status: 0 tests passed and benchmarks ran; 1 tests failed or the
# benchmark failed; 2 torch missing; 3 torch sees no GPU; 4 pydantic or PyYAML missing.
#
# Environment: PYTHON (default python3); GPU_CHECK_FULL=1 for the full benchmark instead of
# --quick (about a minute more). A folder .gpu_pylib at the repository root, when present,
# goes first on PYTHONPATH (pure-Python packages carried in when the machine lacks them).

set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvpolicy-gpu-check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
tee_pid=$!
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1
if [ -d .gpu_pylib ]; then
    export PYTHONPATH="$PWD/.gpu_pylib${PYTHONPATH:+:$PYTHONPATH}"
fi
start=$(date +%s)

finish() {  # finish STATUS MESSAGE
    echo "$1 $2" > "$OUT/gpu_check_status.txt"
    echo "== gpu_check: status $1 ($2) after $(( $(date +%s) - start )) s; files in $OUT"
    exec >&- 2>&-
    wait "$tee_pid" 2>/dev/null  # let tee write the last lines of gpu_check.log
    exit "$1"
}

echo "== environment"
{
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv \
        2>&1 || echo "nvidia-smi: not available"
    echo "python: $(command -v "$PY") $("$PY" --version 2>&1)"
    echo "cpus: $(nproc 2>/dev/null || echo '?')"
} | tee "$OUT/gpu_env.txt"

timeout 120 "$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/gpu_env.txt"
import sys
try:
    import torch
except Exception as e:
    print(f"torch: cannot import it ({type(e).__name__}: {e})")
    sys.exit(2)
print("torch", torch.__version__, "built with CUDA", torch.version.cuda, "; cuda available:",
      torch.cuda.is_available(), "; devices:", torch.cuda.device_count())
if not torch.cuda.is_available():
    sys.exit(3)
p = torch.cuda.get_device_properties(0)
print(f"gpu: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
PYEOF
rc=${PIPESTATUS[0]}
if [ "$rc" = 3 ]; then
    echo "torch sees no GPU (torch.cuda.is_available() is False): nothing to check on a device."
    finish 3 "no GPU visible to torch"
elif [ "$rc" != 0 ]; then
    echo "torch cannot be used by $PY (status $rc). This check needs torch with CUDA already installed"
    echo "on this machine (there is no network to install it). Set PYTHON to an interpreter that has it."
    finish 2 "torch missing or broken"
fi

echo "== dependencies"
missing=""
for mod in pydantic yaml pytest hypothesis; do
    if ! "$PY" -c "import $mod" 2>/dev/null; then
        missing="$missing $mod"
    fi
done
echo "missing:${missing:- none}" | tee -a "$OUT/gpu_env.txt"
case " $missing " in
    *" pydantic "*|*" yaml "*)
        echo "pydantic and PyYAML are needed by every part of kvpolicy (missing:$missing);"
        echo "install them, or carry them in as .gpu_pylib (bench/README.md, 'On a GPU')."
        finish 4 "missing:$missing" ;;
esac
# Everything below runs from the source tree (the repository root is on sys.path), so the
# editable install only adds the `kvpolicy` command: a failure is reported, not fatal.
if timeout 120 "$PY" -m pip install -e . --no-deps --no-build-isolation --no-index -q 2>&1 | tail -n 3; then
    echo "installed kvpolicy (editable, no dependencies)"
else
    echo "pip install -e . failed (above); continuing from the source tree"
fi

status=0
echo "== tests on the GPU (timeout 240 s)"
case " $missing " in
    *" pytest "*)
        echo "pytest is missing: tests skipped"
        status=1 ;;
    *)
        paths="tests/engine/runtime/test_devices.py tests/engine/runtime"
        case " $missing " in  # the other runtime test modules import hypothesis when collected
            *" hypothesis "*)
                paths="tests/engine/runtime/test_devices.py"
                echo "hypothesis is missing: running test_devices.py only" ;;
        esac
        # shellcheck disable=SC2086
        timeout 240 "$PY" -m pytest -q $paths -x -k "cuda or devices" -p no:cacheprovider \
            --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
        rc=${PIPESTATUS[0]}
        echo "pytest exit status: $rc$([ "$rc" = 124 ] && echo ' (timed out)')"
        "$PY" - "$OUT/gpu_tests.xml" <<'PYEOF' || true
import collections
import sys
import xml.etree.ElementTree as ET

outcomes = collections.Counter()
for case in ET.parse(sys.argv[1]).iter("testcase"):
    if "cuda" in case.get("name", ""):
        kids = {child.tag for child in case}
        outcomes["failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"] += 1
print("test cases on cuda:", dict(outcomes) or "none ran")
PYEOF
        [ "$rc" = 0 ] || status=1 ;;
esac

echo "== runtime benchmarks on the GPU (timeout 180 s)"
quick="--quick"
[ "${GPU_CHECK_FULL:-0}" = 1 ] && quick=""
# shellcheck disable=SC2086
timeout 180 "$PY" bench/run.py $quick --device cuda --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log"
rc=${PIPESTATUS[0]}
echo "bench exit status: $rc$([ "$rc" = 124 ] && echo ' (timed out)')"
[ "$rc" = 0 ] || status=1
if [ -s "$OUT/gpu_bench.json" ]; then
    "$PY" - "$OUT/gpu_bench.json" <<'PYEOF' || true
import json
import sys

r = json.load(open(sys.argv[1]))
print(f"headline: device_copy_gbps = {r.get('device_copy_gbps', float('nan')):.0f} GB/s (read + written)")
for k in ("write_int8_vs_membw", "write_fp8_vs_membw", "write_int4_vs_membw", "write_int8_t384_vs_membw",
          "write_int8_t16384_vs_membw", "write_int8_vs_copy", "decode_write_vs_copy", "offload_cross_vs_copy",
          "restore_cross_vs_copy", "restore_per_layer_vs_copy",
          "offload_per_layer_vs_copy"):
    if k in r:
        print(f"headline: {k} = {r[k]:.3f}x")
PYEOF
fi

echo "== compiled Triton arithmetic vs correctly rounded (timeout 60 s, not fatal)"
timeout 60 "$PY" bench/gpu_arith.py 2>&1 | tee "$OUT/gpu_arith.json"
echo "gpu_arith exit status: ${PIPESTATUS[0]}"

if [ "$status" = 0 ]; then
    finish 0 "tests passed, benchmarks ran"
fi
finish 1 "tests or benchmarks failed: see gpu_tests.log and gpu_bench.log"
