#!/usr/bin/env bash
# Fill .whl/ with the cp312 manylinux x86_64 wheels the GPU machine lacks.
#
# Run HERE (where PyPI is reachable); the GPU machine then gets .whl/ carried
# with the working tree and installs it offline (scripts/gpu_check.sh).
#
# The GPU machine's python3 is 3.12 with torch (CUDA), numpy, matplotlib,
# cloudpickle, psutil, accelerate, transformers and lightning, but no
# ipyparallel, ipykernel, ipywidgets, jupyter_client, pyzmq or pytest. The list
# below is the dependency closure of ipyparallel + ipykernel + ipywidgets +
# pytest + pytest-timeout on Linux / CPython 3.12 (extras off), pinned to the
# versions of the project's .venv, minus what the GPU machine already has
# (ALREADY_THERE). After downloading, the closure is checked again from the
# wheels' own METADATA, so a new requirement shows up as an error here, not
# as an ImportError there.
#
# scikit-learn is left out on purpose: no requires_gpu test needs it
# (grep -rn requires_gpu tests), and it would bring scipy (~35 MB).
#
# pandas and Holistic Trace Analysis (holistictraceanalysis, with plotly,
# narwhals and pydot) are carried so that History.time_split() and
# History.profile["hta"] work there (gpu_check.sh's profile step). HTA declares
# jupyterlab (and pytest) as requirements but imports jupyterlab nowhere: it is
# in NOT_CARRIED, left out of the closure check, as it would bring jupyter_server
# and its tree. pandas 3.1 wants numpy>=2.0.2, which the GPU machine's numpy is
# taken to be (unchecked here: ALREADY_THERE is not versioned); with an older
# numpy the profile summary says HTA could not be imported, and why.
#
# Idempotent: .whl/MANIFEST records the pinned set; a second run with the same
# list and all files present downloads nothing.
#
#   bash scripts/gpu_wheels.sh            # PYTHON=... to pick the pip; WHL_DIR=... for another folder
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${WHL_DIR:-.whl}
MAX_MIB=40

# name==version, one a line; "#" starts a comment. tests/test_gpu_kit.py reads this block.
# BEGIN PACKAGES
PACKAGES=$(cat <<'EOF'
ipyparallel==9.2.0
ipykernel==7.4.0
ipywidgets==8.1.9
pytest==9.2.0
pytest-timeout==2.4.0
# ipyparallel / ipykernel
ipython==9.18.1
ipython-pygments-lexers==1.1.1
jupyter-client==8.10.0
jupyter-core==5.9.1
comm==0.2.3
debugpy==1.8.22
pyzmq==27.3.0
tornado==6.6.1
traitlets==5.16.1
matplotlib-inline==0.2.2
nest-asyncio2==1.7.4
decorator==5.3.1
platformdirs==4.14.9
# ipython
jedi==0.20.1
parso==0.8.7
pexpect==4.9.0
ptyprocess==0.7.0
prompt-toolkit==3.0.53
wcwidth==0.9.4
stack-data==0.6.3
executing==2.3.0
asttokens==3.0.2
pure-eval==0.2.4
pygments==2.21.0
# ipywidgets
jupyterlab-widgets==3.0.17
widgetsnbextension==4.0.16
# pytest
pluggy==1.7.0
iniconfig==2.3.1
# tiny and pure Python: jupyter_client 8.10 wants typing-extensions>=4.13, newer than torch asks for
typing-extensions==4.16.0
# History.time_split() and History.profile["hta"] (HTA's analyses of the ranks' GPU traces)
pandas==3.1.1
holistictraceanalysis==0.5.0
plotly==7.1.0
narwhals==2.29.0
pydot==4.0.1
EOF
)
# END PACKAGES

# On the GPU machine already (as torch / matplotlib / transformers dependencies): required, not downloaded.
ALREADY_THERE="torch numpy matplotlib cloudpickle psutil packaging python-dateutil six tzdata tqdm networkx pyparsing"
# Declared by a carried package but never imported by what nbddp uses of it: neither downloaded nor required.
NOT_CARRIED="jupyterlab"

PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)

WANTED=$(printf '%s\n' "$PACKAGES" | sed -e 's/#.*//' -e 's/[[:space:]]//g' | grep -v '^$')

mkdir -p "$DEST"

norm() {  # a distribution name as wheel file names spell it: lower case, runs of -_. as _
    printf '%s' "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/_/g'
}

wheel_for() {  # the wheel in $DEST for name==version, if any
    local name=${1%%==*} version=${1#*==} f base
    for f in "$DEST"/*.whl; do
        [ -e "$f" ] || continue
        base=$(basename "$f")
        if [ "$(norm "${base%%-*}")" = "$(norm "$name")" ] && [ "$(printf '%s' "$base" | cut -d- -f2)" = "$version" ]; then
            printf '%s\n' "$f"
            return 0
        fi
    done
    return 1
}

report() {
    "$PY" - "$DEST" <<'EOF'
import os, sys
dest = sys.argv[1]
files = sorted(f for f in os.listdir(dest) if f.endswith(".whl"))
total = 0
for f in files:
    size = os.path.getsize(os.path.join(dest, f))
    total += size
    print(f"  {size / 2**20:7.2f} MiB  {f}")
print(f"{len(files)} wheels, total {total / 2**20:.2f} MiB in {dest}/")
EOF
}

manifest_ok() {  # MANIFEST lists exactly WANTED and every file it names is there
    [ -f "$DEST/MANIFEST" ] || return 1
    [ "$(grep -v '^#' "$DEST/MANIFEST" | awk '{print $1}' | sort)" = "$(printf '%s\n' "$WANTED" | sort)" ] || return 1
    local f
    for f in $(grep -v '^#' "$DEST/MANIFEST" | awk '{print $2}'); do
        [ -f "$DEST/$f" ] || return 1
    done
    return 0
}

if manifest_ok; then
    echo "$DEST/ is up to date ($(printf '%s\n' "$WANTED" | wc -l) packages, see $DEST/MANIFEST):"
    report
    exit 0
fi

plat_args=()
for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done

for spec in $WANTED; do
    if wheel_for "$spec" >/dev/null; then
        continue
    fi
    echo "downloading $spec"
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp "${plat_args[@]}" -d "$DEST" "$spec"
    wheel_for "$spec" >/dev/null || { echo "ERROR: pip downloaded no wheel for $spec into $DEST/" >&2; exit 1; }
done

# one version of each: drop wheels that are not in the list (older pins, stray downloads)
keep=$(for spec in $WANTED; do basename "$(wheel_for "$spec")"; done)
for f in "$DEST"/*.whl; do
    if ! printf '%s\n' "$keep" | grep -qxF "$(basename "$f")"; then
        echo "removing $(basename "$f") (not in the pinned list)"
        rm -f -- "$f"
    fi
done

# the closure, checked from the wheels' METADATA for Linux / CPython 3.12 without extras
"$PY" - "$DEST" "$ALREADY_THERE" "$NOT_CARRIED" <<'EOF'
import os, re, sys, zipfile
try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

dest, already, skipped = sys.argv[1], set(sys.argv[2].split()), set(sys.argv[3].split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
have, reqs = {}, []
for f in sorted(os.listdir(dest)):
    if not f.endswith(".whl"):
        continue
    with zipfile.ZipFile(os.path.join(dest, f)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
    version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
    if norm(name) in have:
        sys.exit(f"ERROR: two wheels for {name}: {have[norm(name)][1]} and {f}")
    have[norm(name)] = (Version(version), f)
    for line in re.findall(r"^Requires-Dist: (.+)$", text, re.M):
        reqs.append((name, Requirement(line.strip())))
missing, bad, there = [], [], set()
for who, req in reqs:
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    n = norm(req.name)
    if n in {norm(a) for a in skipped}:
        continue
    if n in have:
        if req.specifier and not req.specifier.contains(have[n][0], prereleases=True):
            bad.append(f"{who} needs {req}, the wheel is {have[n][1]}")
    elif n in {norm(a) for a in already}:
        there.add(f"{req.name} ({who}: {req.specifier or 'any'})")
    else:
        missing.append(f"{req} (needed by {who})")
if there:
    print("expected on the GPU machine already:", ", ".join(sorted(there)))
if bad or missing:
    for m in bad:
        print("ERROR: version mismatch:", m, file=sys.stderr)
    for m in missing:
        print("ERROR: missing from the list:", m, file=sys.stderr)
    sys.exit(1)
print(f"closure complete: {len(have)} wheels; every Linux/3.12 requirement is a wheel here or on the GPU machine")
EOF

{
    echo "# name==version wheel-file (written by scripts/gpu_wheels.sh; delete to force a re-check)"
    for spec in $WANTED; do
        echo "$spec $(basename "$(wheel_for "$spec")")"
    done
} > "$DEST/MANIFEST"

report
total_kib=$(du -ck "$DEST"/*.whl | tail -1 | cut -f1)
if [ "$total_kib" -gt $((MAX_MIB * 1024)) ]; then
    echo "ERROR: $DEST/ holds ${total_kib} KiB, over the ${MAX_MIB} MiB budget (the carried tree may hold 64 MiB)" >&2
    exit 1
fi
