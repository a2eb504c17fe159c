#!/usr/bin/env bash
# Sets up everything the test suite needs on a fresh Debian machine, then runs it.
#   bash scripts/test.sh            # whole suite
#   bash scripts/test.sh --quick    # the quick tier: no notebook, docs, browser, fault, benchmark, Slurm, slow tests,
#                                   # nor tests that start workers of their own, nor heavy ones
#   bash scripts/test.sh -k faults  # extra arguments go to pytest
#   DURATIONS=0 bash scripts/test.sh # every test's time (scripts/time_table.py groups them by cause)
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: iproute2 (fake hosts in network namespaces), chromium-headless-shell (browser test), openssh-server.
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)   # ipyparallel's SSH launcher against a real sshd (tests/test_launchers.py)
[ -x /usr/lib/chromium/chromium-headless-shell ] || need+=(chromium-headless-shell)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
    || echo "warning: could not install ${need[*]}; the tests that need them will skip and say why"
fi
# Slurm and munge: tests/test_slurm.py starts a private Slurm (their install scripts start no service; ~30 s).
if ! { [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] && command -v sbatch >/dev/null 2>&1; } \
   && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
     slurmctld slurmd slurm-client munge >/dev/null) \
    || echo "warning: could not install Slurm; tests/test_slurm.py will skip and say why"
fi

QUICK=(-m "not (slow or notebook or docs or browser or faults or bench or netns or slurm or fresh_workers or heavy)")
tier=()
if [ "${1:-}" = "--quick" ]; then
  shift
  tier=("${QUICK[@]}")
fi
# Test processes, each with its own 2 workers, a file at a time (module fixtures start once): three for the
# whole suite, whose Slurm, notebook and fault tests spend much of their time waiting (the Slurm file used 0.64
# of a core), two for the quick tier, which is CPU-bound on 2 cores; NBDDP_TEST_PROCS=N overrides,
# NBDDP_TEST_PROCS=1 runs everything in this one process. A free process takes the next file in the order
# tests/conftest.py gives (the longest first, by tests/test_costs.json); --no-loadscope-reorder keeps xdist from
# ordering the files by their number of tests instead.
procs=${NBDDP_TEST_PROCS:-$([ ${#tier[@]} -gt 0 ] && echo 2 || echo 3)}
parallel=()
if [ "$procs" -gt 1 ]; then
  parallel=(-n "$procs" --dist loadfile --no-loadscope-reorder)
fi

EXTRAS=browser,bench bash scripts/setup.sh
exec .venv/bin/python -m pytest -p no:cacheprovider -q -ra --durations="${DURATIONS:-15}" "${parallel[@]}" "${tier[@]}" "$@"
