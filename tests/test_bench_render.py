"""The results pages' renderers (``benchmarks/render.py`` and each suite's ``render``): every
table names its command, its CPU and result files that exist, and runs are merged only where
their rows are comparable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.render import RENDERED, comparable_runs, merged_table, render_block

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LINK = re.compile(r"\]\((\.\./benchmarks/results/[^)]+)\)")
METRICS = [{"name": "kl_mean", "unit": "nats", "better": "lower", "ratio": True}]


def test_every_suite_module_renders_a_table():
    """Every suite of the harness is on a results page: a module of benchmarks/suites/ without a
    ``render`` would have no table."""
    suites = {p.stem for p in (REPO / "benchmarks" / "suites").glob("*.py")}
    assert suites <= set(RENDERED), sorted(suites - set(RENDERED))


@pytest.mark.parametrize("suite", sorted(s for s in RENDERED if s != "test-tiers"))
def test_each_rendered_block_names_its_command_cpu_and_existing_result_files(suite):
    text = render_block(suite, RESULTS, REPO / "docs")
    links = LINK.findall(text)
    assert links, f"{suite}: the block cites no result file"
    for link in links:
        assert (REPO / "docs" / link).resolve().is_file(), link
    assert f"python -m benchmarks run {suite}" in text
    assert re.search(r"AMD EPYC|Intel|CPU not recorded", text), f"{suite}: no CPU named"


def _result(path: Path, arms: dict[str, float], samples: int, flags: str, sha: str) -> Path:
    doc = {"suite": "fidelity", "complete": True, "passes": 3, "metrics": METRICS,
           "summary": {a: {"kl_mean": {"n": 3, "failed": 0, "values": [v] * 3, "median": v,
                                       "spread": 0.0, "min": v, "max": v, "best": v, "worst": v}}
                       for a, v in arms.items()},
           "records": [],
           "provenance": {"settings": {"samples": samples},
                          "cpu": {"model": "AMD EPYC", "flags": flags.split()},
                          "threads": {"cpu_count": 2}, "git": {"sha": sha * 40}}}
    path.write_text(json.dumps(doc))
    return path


def test_runs_merge_per_cpu_class_and_settings_each_arm_from_its_newest(tmp_path):
    old = _result(tmp_path / "fidelity-20260101T000000Z.json", {"a": 0.3, "b": 0.2}, 128,
                  "avx2 avx512f", "1")
    new = _result(tmp_path / "fidelity-20260102T000000Z.json", {"a": 0.1}, 128,
                  "avx2 avx512f", "2")
    _result(tmp_path / "fidelity-20260103T000000Z.json", {"b": 0.9}, 32, "avx2 avx512f", "3")
    _result(tmp_path / "fidelity-20260104T000000Z.json", {"a": 0.5}, 128, "avx2", "4")
    def names(groups):
        return [[p.name[9:17] for p, _ in g] for g in groups]

    # one group per CPU class, the newest class first; the AVX-512 class's newest run has
    # other settings than the two before it, so it stands alone
    assert names(comparable_runs(tmp_path, "fidelity-2*.json", ("samples",))) == [
        ["20260104"], ["20260103"]]
    (tmp_path / "fidelity-20260103T000000Z.json").unlink()
    groups = comparable_runs(tmp_path, "fidelity-2*.json", ("samples",))
    assert names(groups) == [["20260104"], ["20260102", "20260101"]]
    table = merged_table(groups[1], tmp_path, METRICS, {"kl_mean": ".2f"}, ["b", "a"])
    rows = table.splitlines()[2:]
    assert rows[0].startswith("| `b` | 0.20 |") and old.name in rows[0]  # only the old run has b
    assert rows[1].startswith("| `a` | 0.10 |") and new.name in rows[1]  # the newest a


def test_kernel_attribution_reads_the_suite_and_the_earlier_format():
    from benchmarks.suites.tinygemm import kernel_results, kernel_table

    step = {"int4_m1": 2.0, "int4_m512": 9.0, "bf16_m1": 4.0}
    legacy = {"results": [{"model": "demo", "linears_ms_per_step": step}]}
    suite = {"records": [{"arm": "kernel-demo", "ok": False, "extras": {}},
                         {"arm": "kernel-demo", "ok": True,
                          "extras": {"model": "demo", "linears_ms_per_step": step}}]}
    assert kernel_results(legacy) == kernel_results(suite) == legacy["results"]
    table = kernel_table(suite)
    assert "| dense bf16 `F.linear` | 4.0 ms |  |" in table
    assert "W4A8" not in table  # a path the run did not measure has no row
