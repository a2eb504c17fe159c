#!/usr/bin/env bash
# The GPU machine's one command: install the carried wheels, report the environment,
# run the requires_gpu tests, benchmarks/bench_gpu.py, the compile and elastic benchmarks and the
# profile check, and copy what they wrote into $OUT. Each timed step is capped by `timeout`, and no
# step may run past the whole check's budget (TOTAL_BUDGET, 470 s: under 8 minutes in all), so one
# slow step shortens the ones after it instead of losing everything.
#
#   bash scripts/gpu_wheels.sh     # here, where PyPI is reachable: fills .whl/ (git-ignored)
#   bash scripts/gpu_check.sh      # there, from the repo root, with .whl carried
#
# Steps:
#   a. pip-install .whl/*.whl into $SITE (offline, no deps); PYTHONPATH=$PWD:$SITE.
#      No .whl/, or a python that is not 3.12: say so, go on with what is importable.
#   b. environment report (python, torch, CUDA, GPUs, nvidia-smi -L, versions)  -> env.txt
#   c. pytest -m requires_gpu on the test files that use the marker             -> pytest.log, pytest.xml
#      (only those files: collecting all of tests/ imports nbclient, nbformat and
#      scikit-learn, which the GPU machine does not have and .whl does not carry)
#   d. benchmarks/bench_gpu.py (training cells, the CUDA round trip, nbddp.predict in bf16) -> benchmarks/results/<YYYY-MM-DD>_gpu.json -> bench.log
#      then benchmarks/bench_compile.py --quick (dist_fit(compile=True) on the GPUs: eager vs compiled
#      samples/s, first vs second fit's compile time)  -> <YYYY-MM-DD>_compile.json, compile.log
#      then benchmarks/bench_elastic.py --quick (dist_fit(max_restarts=1) with the model on the GPU: what a
#      snapshot costs the step: a device-to-host copy into pinned buffers, written to /dev/shm by a thread,
#      against the same snapshots written on the training thread; then rank 1 SIGKILLed and the fit recovered,
#      split into noticing, replacing, restoring)  -> <YYYY-MM-DD>_elastic.json, elastic.log
#   p. scripts/profile_check.py: dist_fit(profile=...) over 3 steps, the merged trace with its CUDA kernels
#      (NCCL ones with 2+ GPUs), the compute/communication/idle breakdown, the time split, and HTA's
#      view of the same trace where hta imports  -> profile.json, the trace, profile.log
#   e. env.txt, install.log, pytest.log, pytest.xml, bench.log, compile.log, elastic.log, profile.log, the JSONs,
#      the merged trace and summary.txt copied into $OUT when it is set (15 files, flat)
#   f. a summary of what passed, failed and was skipped.
#
# Exit status: 0 whenever the script itself worked, even when tests fail or a
# measurement errs (the summary says so); non-zero only when the script is broken
# (or there is no python to run). Without CUDA it runs what it can on CPU and
# says plainly which GPU parts it skipped.
#
# Knobs: PYTHON (python3), SITE (/tmp/site), TEST_TIMEOUT (110 s), BENCH_TIMEOUT (100 s),
# COMPILE_TIMEOUT (90 s), ELASTIC_TIMEOUT (60 s), PROFILE_TIMEOUT (50 s), TOTAL_BUDGET (470 s), OUT.
set -u -o pipefail
export PYTHONUNBUFFERED=1

cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
TEST_TIMEOUT=${TEST_TIMEOUT:-110}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-100}
COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-90}
ELASTIC_TIMEOUT=${ELASTIC_TIMEOUT:-60}
PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-50}
TOTAL_BUDGET=${TOTAL_BUDGET:-470}
OUT=${OUT:-}
DAY=$(date +%Y-%m-%d)
JSON=benchmarks/results/${DAY}_gpu.json
COMPILE_JSON=benchmarks/results/${DAY}_compile.json
ELASTIC_JSON=benchmarks/results/${DAY}_elastic.json
LOGS=$(mktemp -d "${TMPDIR:-/tmp}/nbddp-gpu-check.XXXXXX") || exit 2
T0=$(date +%s)
touch "$LOGS/.started"

say() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$LOGS/summary.txt"; }
section() { printf '\n===== %s =====\n' "$*"; }
# cap SECONDS: the step's own limit, or what is left of TOTAL_BUDGET if that is less (at least 10 s)
cap() { local left=$((TOTAL_BUDGET - ($(date +%s) - T0))); [ "$left" -lt "$1" ] && echo $((left > 10 ? left : 10)) || echo "$1"; }

if ! command -v "$PY" >/dev/null 2>&1; then
    say "no python: '$PY' is not on PATH (set PYTHON=...)"
    exit 3
fi

# ---- a. wheels ---------------------------------------------------------------
section "a. wheels"
: > "$LOGS/install.log"
WHEELS=()
for w in .whl/*.whl; do [ -e "$w" ] && WHEELS+=("$w"); done
if [ ${#WHEELS[@]} -eq 0 ]; then
    say "no .whl/*.whl here: continuing with what $PY can import already (make them with bash scripts/gpu_wheels.sh where PyPI is reachable, and carry .whl)"
elif ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)'; then
    say ".whl/ holds cp312 wheels but $PY is $("$PY" -V 2>&1): not installing them; continuing with what is importable"
else
    mkdir -p "$SITE"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${WHEELS[@]}" >>"$LOGS/install.log" 2>&1; then
        say "installed ${#WHEELS[@]} wheels into $SITE"
    else
        say "pip install failed (install.log): unpacking the wheels into $SITE instead"
        "$PY" - "$SITE" "${WHEELS[@]}" >>"$LOGS/install.log" 2>&1 <<'EOF' || say "unpacking failed too (install.log)"
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
print(f"unpacked {len(sys.argv) - 2} wheels into {sys.argv[1]}")
EOF
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # nbddp and benchmarks from this tree (no wheel for them)
tail -5 "$LOGS/install.log"

# ---- b. environment ----------------------------------------------------------
section "b. environment"
{
    echo "date: $(date -Iseconds)"
    echo "host: $(hostname)"
    echo "python: $(command -v "$PY") ($("$PY" -V 2>&1))"
    echo "PYTHONPATH: $PYTHONPATH"
    "$PY" - <<'EOF'
import importlib, importlib.metadata as md, sys
try:
    import torch
    cuda = torch.cuda.is_available()
    n = torch.cuda.device_count() if cuda else 0
    print(f"torch: {torch.__version__} | CUDA runtime: {torch.version.cuda} | CUDA available: {cuda} | GPUs: {n}")
    for i in range(n):
        print(f"  cuda:{i}: {torch.cuda.get_device_name(i)}")
except Exception as exc:
    n = 0
    print(f"torch: NOT importable ({type(exc).__name__}: {exc})")
if n:
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:
        nccl = f"? ({type(exc).__name__})"
    print(f"cudnn: {torch.backends.cudnn.version()} | nccl: {nccl}")
    free = {}
    for i in range(n):
        try:
            f, t = torch.cuda.mem_get_info(i)
            free[f"cuda:{i}"] = f"{f / 2**30:.1f} of {t / 2**30:.1f} GiB free"
        except Exception as exc:
            free[f"cuda:{i}"] = f"? ({type(exc).__name__})"
    print("memory:", free)
dists = {"zmq": "pyzmq", "IPython": "ipython", "pytest_timeout": "pytest-timeout", "hta": "holistictraceanalysis"}
for mod in ("ipyparallel", "zmq", "ipykernel", "ipywidgets", "jupyter_client", "IPython", "tornado", "traitlets",
            "pytest", "pytest_timeout", "cloudpickle", "psutil", "numpy", "matplotlib", "pandas", "hta", "nbddp"):
    try:
        m = importlib.import_module(mod)
    except Exception as exc:
        print(f"{mod}: NOT importable ({type(exc).__name__}: {exc})")
        continue
    version = getattr(m, "__version__", None)
    if version is None:
        try:
            version = md.version(dists.get(mod, mod))
        except Exception:
            version = "?"
    print(f"{mod}: {version}  ({getattr(m, '__file__', '?')})")
EOF
    echo "cpus: $(nproc 2>/dev/null) | /dev/shm: $(df -h /dev/shm 2>/dev/null | awk 'NR==2 {print $2 " total, " $4 " free"}')"
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "nvidia-smi -L:"
        nvidia-smi -L
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
    else
        echo "nvidia-smi: not found"
    fi
} 2>&1 | tee "$LOGS/env.txt"
CUDA_GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null | tail -1)
if ! [ "$CUDA_GPUS" -ge 0 ] 2>/dev/null; then
    say "torch: NOT importable by $PY: the tests and the benchmark will fail (see env.txt)"
elif [ "$CUDA_GPUS" -gt 0 ]; then
    say "CUDA: $CUDA_GPUS GPU(s) visible"
else
    say "CUDA: no GPU visible: the requires_gpu tests will be skipped, and the benchmark runs its CPU version"
    say "skipped here (GPU only): requires_gpu tests, nccl workers, DataParallel, 16-mixed, the CUDA weights round trip, peak CUDA memory"
fi

# ---- c. the requires_gpu tests -----------------------------------------------
section "c. pytest -m requires_gpu"
TEST_FILES=()
for f in tests/test_*.py; do grep -q 'requires_gpu' "$f" && TEST_FILES+=("$f"); done
TEST_RC=none
if ! "$PY" -c 'import pytest' >/dev/null 2>&1; then
    say "tests: NOT RUN: pytest is not importable (carry .whl from scripts/gpu_wheels.sh)"
elif [ ${#TEST_FILES[@]} -eq 0 ]; then
    say "tests: NOT RUN: no test file uses the requires_gpu marker"
else
    say "tests: ${TEST_FILES[*]} (limit $(cap "$TEST_TIMEOUT") s)"
    TEST_TIMEOUT=$(cap "$TEST_TIMEOUT"); timeout -k 15 "$TEST_TIMEOUT" "$PY" -m pytest -p no:cacheprovider -q -rA -m requires_gpu \
        --continue-on-collection-errors --junitxml="$LOGS/pytest.xml" "${TEST_FILES[@]}" 2>&1 | tee "$LOGS/pytest.log"
    TEST_RC=${PIPESTATUS[0]}
fi

# ---- d. the benchmark ----------------------------------------------------------
section "d. benchmarks/bench_gpu.py"
say "benchmark: -> $JSON (limit $(cap "$BENCH_TIMEOUT") s)"
BENCH_TIMEOUT=$(cap "$BENCH_TIMEOUT"); timeout -k 20 "$BENCH_TIMEOUT" "$PY" benchmarks/bench_gpu.py --out "$JSON" 2>&1 | tee "$LOGS/bench.log"
BENCH_RC=${PIPESTATUS[0]}
say "compile benchmark: -> $COMPILE_JSON (limit $(cap "$COMPILE_TIMEOUT") s)"
COMPILE_TIMEOUT=$(cap "$COMPILE_TIMEOUT"); timeout -k 20 "$COMPILE_TIMEOUT" "$PY" benchmarks/bench_compile.py --quick --out "$COMPILE_JSON" 2>&1 \
    | tee "$LOGS/compile.log"
COMPILE_RC=${PIPESTATUS[0]}
if [ "$CUDA_GPUS" -gt 0 ] 2>/dev/null; then
    say "elastic benchmark: -> $ELASTIC_JSON (limit $(cap "$ELASTIC_TIMEOUT") s)"
    ELASTIC_TIMEOUT=$(cap "$ELASTIC_TIMEOUT"); timeout -k 20 "$ELASTIC_TIMEOUT" "$PY" benchmarks/bench_elastic.py --quick --out "$ELASTIC_JSON" 2>&1 \
        | tee "$LOGS/elastic.log"
    ELASTIC_RC=${PIPESTATUS[0]}
else  # on CPU it is the 2-core machine's own benchmark (docs/faults.md): nothing GPU-specific to learn here
    ELASTIC_RC=skipped
fi

# ---- p. the profile step -------------------------------------------------------
section "p. scripts/profile_check.py"
say "profile: a merged trace of 3 steps with its breakdown (limit $(cap "$PROFILE_TIMEOUT") s)"
mkdir -p -m 700 "$LOGS/profile"
PROFILE_TIMEOUT=$(cap "$PROFILE_TIMEOUT"); timeout -k 20 "$PROFILE_TIMEOUT" "$PY" scripts/profile_check.py --out "$LOGS/profile" 2>&1 | tee "$LOGS/profile.log"
PROFILE_RC=${PIPESTATUS[0]}

# ---- f. summary ----------------------------------------------------------------
section "summary"
case "$TEST_RC" in
    none) ;;
    0) say "tests: exit 0" ;;
    5) say "tests: exit 5 (no test collected)" ;;
    124|137) say "tests: STOPPED after the ${TEST_TIMEOUT} s limit (exit $TEST_RC)" ;;
    *) say "tests: exit $TEST_RC (failures or errors, listed below)" ;;
esac
if [ -f "$LOGS/pytest.xml" ]; then
    "$PY" - "$LOGS/pytest.xml" <<'EOF' 2>&1 | tee -a "$LOGS/summary.txt"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
lines = []
for case in root.iter("testcase"):
    name = f"{case.get('classname', '')}::{case.get('name', '')}"
    kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
    kind = {"failure": "failed"}.get(kind, kind)
    counts[kind] += 1
    if kind != "passed":
        child = next(c for c in case if c.tag in ("failure", "error", "skipped"))
        lines.append(f"  {kind.upper()}: {name}: {(child.get('message') or '').splitlines()[0][:200] if child.get('message') else ''}")
    else:
        lines.append(f"  passed: {name}")
print("tests: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
print("\n".join(lines))
EOF
elif [ "$TEST_RC" != none ]; then
    say "tests: no junit XML (the run was stopped or crashed); last lines of pytest.log:"
    tail -5 "$LOGS/pytest.log" | tee -a "$LOGS/summary.txt"
fi

case "$BENCH_RC" in
    0) say "benchmark: exit 0" ;;
    124|137) say "benchmark: STOPPED after the ${BENCH_TIMEOUT} s limit (exit $BENCH_RC); the JSON holds the cells finished before" ;;
    *) say "benchmark: exit $BENCH_RC (see bench.log)" ;;
esac
if [ -f "$JSON" ] && [ "$JSON" -nt "$LOGS/.started" ]; then
    "$PY" - "$JSON" <<'EOF' 2>&1 | tee -a "$LOGS/summary.txt"
import json, sys
res = json.load(open(sys.argv[1])).get("gpu", {})
rows = res.get("rows", [])
measured = [r for r in rows if r.get("samples_per_s") is not None]
failed = [r for r in rows if "error" in r]
skipped = [r for r in rows if "skipped" in r]
print(f"benchmark ({res.get('mode')} mode, GPUs {res.get('gpus')}): {len(measured)} measured, {len(failed)} failed, "
      f"{len(skipped)} skipped of {len(rows)} rows; {res.get('wall_s', 0):.0f} s")
for r in failed:
    print(f"  FAILED {r['workload']}/{r['precision']}/{r['competitor']}: {r['error'][:200]}")
for name, rt in (res.get("cuda_roundtrip") or {}).items():
    print(f"  cuda round trip {name}: " + (f"FAILED {rt['error'][:200]}" if "error" in rt else
          f"ship_s {rt.get('ship_s')}, return_s {rt.get('return_s')}, back on {rt.get('model_device')}: "
          f"{rt.get('weights_on_home_device')}, changed: {rt.get('weights_changed')}"))
pf = res.get("prefetch")
if pf:
    print("  " + (pf.get("prefetch") or f"prefetch on/off: {pf.get('on_vs_off')}"))
for s in res.get("skipped", []):
    print(f"  skipped {s['part']}: {s['reason']}")
EOF
else
    say "benchmark: wrote no $JSON this run (see bench.log)"
fi

case "$COMPILE_RC" in
    0) say "compile benchmark: exit 0; $(grep -A5 'dist_fit(compile=True)' "$LOGS/compile.log" | tr '\n' ' ')" ;;
    124|137) say "compile benchmark: STOPPED after the ${COMPILE_TIMEOUT} s limit (exit $COMPILE_RC)" ;;
    *) say "compile benchmark: exit $COMPILE_RC (see compile.log)" ;;
esac
case "$PROFILE_RC" in
    0) say "profile: exit 0; $(grep -E '^(rank [0-9]+ over|GPU kernels|time split|HTA)' "$LOGS/profile.log" | tr '\n' ' ')" ;;
    124|137) say "profile: STOPPED after the ${PROFILE_TIMEOUT} s limit (exit $PROFILE_RC)" ;;
    *) say "profile: exit $PROFILE_RC (see profile.log)" ;;
esac

case "$ELASTIC_RC" in
    skipped) say "elastic benchmark: skipped (no GPU: the CPU figures come from benchmarks/bench_elastic.py on any machine)" ;;
    0) say "elastic benchmark: exit 0; $(grep -A3 '== elastic' "$LOGS/elastic.log" | tr '\n' ' ')" ;;
    124|137) say "elastic benchmark: STOPPED after the ${ELASTIC_TIMEOUT} s limit (exit $ELASTIC_RC)" ;;
    *) say "elastic benchmark: exit $ELASTIC_RC (see elastic.log)" ;;
esac

# ---- e. results into $OUT --------------------------------------------------------
if [ -n "$OUT" ]; then
    copied=()
    if mkdir -p "$OUT"; then
        for f in "$LOGS"/env.txt "$LOGS"/install.log "$LOGS"/pytest.log "$LOGS"/pytest.xml "$LOGS"/bench.log "$LOGS"/compile.log "$LOGS"/elastic.log \
                 "$LOGS"/profile.log "$LOGS"/profile/*.json; do
            [ -f "$f" ] && cp "$f" "$OUT/" && copied+=("$(basename "$f")")
        done
        for j in "$JSON" "$COMPILE_JSON" "$ELASTIC_JSON"; do
            if [ -f "$j" ] && [ "$j" -nt "$LOGS/.started" ] && cp "$j" "$OUT/"; then
                copied+=("$(basename "$j")")
            fi
        done
        say "copied ${copied[*]} summary.txt into $OUT; $(($(date +%s) - T0)) s in all"
        cp "$LOGS/summary.txt" "$OUT/" && rm -rf -- "$LOGS"
    else
        say "could not create OUT=$OUT; the logs stay in $LOGS"
    fi
else
    say "logs in $LOGS (set OUT=... to collect them); $(($(date +%s) - T0)) s in all"
fi
exit 0
