"""The README's and the docs' claims checked against what they are about: each measured figure against its
result file (``scripts/doc_figures.py``), the capability and notebook lists against the tree, the versions
against pyproject.toml. No workers."""

from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import doc_figures  # noqa: E402


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def test_every_figure_with_a_source_equals_its_result_file():
    assert doc_figures.check("README.md", "docs/performance.md", "docs/sessions.md", "docs/report.md") == []
    readme = _read("README.md")
    assert len(doc_figures.SOURCED.findall(readme)) >= 6  # the comparison table's measured rows
    assert len(doc_figures.SOURCED.findall(_read("docs/performance.md"))) >= 290  # every figure the page keeps


def test_a_figure_edited_by_hand_fails():
    readme = _read("README.md")
    edited = readme.replace("0.99<!-- src:", "0.97<!-- src:", 1)
    assert edited != readme
    assert any("0.97 is written, and" in p and "says 0.9935" in p for p in doc_figures.check_text(edited, "README.md"))


def test_a_figure_with_no_source_in_a_figures_region_fails():
    readme = _read("README.md")
    bare = re.sub(r"(6\.2)<!-- src: [^>]*-->", r"\1", readme, count=1)
    assert bare != readme
    assert doc_figures.check_text(bare, "README.md") == [
        f"README.md:{readme[:readme.index('<!-- figures -->')].count(chr(10)) + 1}: 6.2 in a figures region has no "
        "source (add <!-- src: FILE ... --> after it)"]


def test_a_generated_table_edited_by_hand_fails():
    page = _read("docs/performance.md")
    edited = page.replace("| latency | nbddp_warm | overhead s/call | 0.0338 |", "| latency | nbddp_warm | overhead "
                          "s/call | 0.0300 |", 1)
    assert edited != page
    assert any("the table differs from benchmarks/report.py 2026-11-30_104055.json" in p
               for p in doc_figures.check_text(edited, "docs/performance.md"))


def test_a_source_that_does_not_resolve_fails():
    text = "<!-- figures -->1.0<!-- src: 2026-11-30_104055.json row latency nobody \"overhead s/call\" median --><!-- /figures -->"
    assert any("does not resolve" in p and "0 summary rows" in p for p in doc_figures.check_text(text, "x.md"))


def test_rounding_is_as_written():
    assert doc_figures.matches("2.0", 1.954) and doc_figures.matches("0.03", 0.0338)
    assert doc_figures.matches("15,654", 15653.5) and not doc_figures.matches("0.98", 0.9935)


def test_the_readme_lists_every_capability_and_every_notebook():
    readme = _read("README.md")
    section = readme.split("## What it does", 1)[1].split("\n## ", 1)[0]
    for capability in ("DDP", "FSDP", "Pipeline parallel", "Tensor parallel", "Predict and evaluate", "Elastic fits",
                       "Sweeps", "Profiling", "Compile", "Loggers and callbacks", "Debugging", "Slurm", "MPI", "SSH"):
        line = next((l for l in section.splitlines() if l.startswith(f"| {capability} |")), None)
        assert line is not None and re.search(r"\]\(docs/[\w-]+\.md(#[\w-]+)?\)", line), capability
    notebooks = sorted(n.removesuffix(".ipynb") for n in os.listdir(os.path.join(ROOT, "notebooks"))
                       if n.endswith(".ipynb"))
    listed = re.findall(r"^\| \[(\w+)\]\(notebooks/(\w+)\.ipynb\)", readme, re.M)
    assert sorted(name for name, _ in listed) == notebooks and all(a == b for a, b in listed)


def test_the_launchers_the_readme_names_are_the_tested_ones():
    readme = _read("README.md")
    named = set(re.findall(r"ipyparallel launchers \(([^)]*)\)", readme)[0].split(", "))
    assert named == {"Slurm", "MPI", "SSH"}
    tests = _read("tests/test_launchers.py") + _read("tests/test_slurm.py")
    for test in ("test_mpi_launcher_starts_two_engines", "test_ssh_launcher_starts_an_engine_on_each_of_two_hosts"):
        assert f"def {test}" in tests


def test_getting_started_names_the_torch_pyproject_requires():
    floor = re.search(r'"torch>=([\d.]+)"', _read("pyproject.toml")).group(1)
    assert f"PyTorch {floor}+" in _read("docs/getting-started.md")


def test_a_range_from_a_list_resolves_and_fails_when_edited():
    # 2026-12-05_075002_latency.json keeps the 7 paired round trips only as a list: its extremes are the range.
    good = ("<!-- figures -->9.07<!-- src: 2026-12-05_075002_latency.json key latency epoch_round_trip "
            "round_trip_ms_all min -->-12.1<!-- src: 2026-12-05_075002_latency.json key latency epoch_round_trip "
            "round_trip_ms_all max --> ms<!-- /figures -->")
    assert doc_figures.check_text(good, "x.md") == []
    edited = good.replace("12.1<!--", "12.4<!--")
    assert any("12.4 is written" in p and "says 12.1388" in p for p in doc_figures.check_text(edited, "x.md"))


def test_a_star_walks_every_item_before_the_reducer():
    source = "2026-12-03_091310_predict.json key predict raw torchrun * loop_s min"
    per_turn = [t["loop_s"] for t in doc_figures._load("2026-12-03_091310_predict.json")["predict"]["raw"]["torchrun"]]
    assert doc_figures.value_of(source) == min(per_turn)
    assert doc_figures.value_of("2026-12-05_075002_latency.json key latency summary torchrun overhead_s min") == \
        doc_figures._load("2026-12-05_075002_latency.json")["latency"]["summary"]["torchrun"]["overhead_s"]["min"]


def test_an_unsourced_measure_outside_a_region_is_found():
    assert doc_figures.unsourced("took 2.4-2.9 s, then 0.49x; `3 s` in code; 1 %<!-- goal --> of a core") == \
        ["1: 2.4-2.9 s", "1: 0.49x"]
    assert doc_figures.unsourced("shipped in 8<!-- src: f key a --> ms<!-- figures -->7 ms<!-- /figures -->") == []


def test_a_figure_kept_only_in_a_log_resolves_and_fails_when_edited():
    log = "2026-12-04_gpu_check/check.log"
    good = (f"<!-- figures -->idle 18<!-- src: {log} match 'rank 0 over 10 traced steps.*?idle (\\d+) %' --> %, "
            f"over 54.4<!-- src: {log} match 'HTA [\\d.]+, rank 0 over ([\\d.]+) ms' --> ms<!-- /figures -->")
    assert doc_figures.check_text(good, "x.md") == []
    edited = good.replace("idle 18<!--", "idle 12<!--")
    assert any("12 is written" in p and "says 18" in p for p in doc_figures.check_text(edited, "x.md"))
    missing = good.replace("traced steps", "traced stops")
    assert any("does not resolve" in p and "no match" in p for p in doc_figures.check_text(missing, "x.md"))


def test_every_measured_figure_of_the_performance_page_and_the_readme_has_a_source():
    # A number followed by a unit (ms, s, x, %, GB/s, MiB, samples/s...) outside a figures region, a generated
    # table and code either carries <!-- src: --> or is marked <!-- goal --> / <!-- setting -->.
    assert doc_figures.unsourced(_read("docs/performance.md")) == []
    assert doc_figures.unsourced(_read("README.md")) == []


def test_an_unsourced_figure_typed_into_the_performance_page_fails():
    page = _read("docs/performance.md")
    edited = page.replace("## The fast paths, and why\n", "## The fast paths, and why\n\nA warm call takes 12 ms.\n", 1)
    assert edited != page
    line = page[:page.index("## The fast paths, and why")].count("\n") + 3
    assert doc_figures.unsourced(edited) == [f"{line}: 12 ms"]
    assert doc_figures.unsourced(edited.replace("12 ms.", "12 ms<!-- goal -->.")) == []
