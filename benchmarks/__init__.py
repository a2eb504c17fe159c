"""nbddp benchmark harness.

Each ``bench_*.py`` module has ``main(quick: bool) -> dict`` and can be run as a
script (``python benchmarks/bench_throughput.py [--quick]``) or as a module
(``python -m benchmarks.bench_throughput``). ``run_all.py`` runs them all.
"""
