"""Every result file that README.md or docs/*.md cites is tracked by git.

A number on a page must trace to a committed result file; a file that was never committed (a
stopped run's ``*.partial.json``, a local run) is gone for every other reader.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# a result file's name ends in its UTC timestamp, e.g. quantize-20261202T033134Z.json
CITED_RESULT = re.compile(r"[A-Za-z0-9_.-]+-20[0-9]{6}T[0-9]{6}Z[A-Za-z0-9_.-]*\.(?:json|log)")


def pages(repo: Path = REPO) -> list[Path]:
    return [p for p in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))] if p.is_file()]


def untracked_citations(paths: Iterable[Path], tracked: Iterable[str]) -> dict[str, list[str]]:
    """``{page: [cited file names that no tracked path ends in]}``, pages without any left out."""
    tracked_names = {Path(t).name for t in tracked}
    out: dict[str, list[str]] = {}
    for page in paths:
        missing = sorted({name for name in CITED_RESULT.findall(page.read_text())
                          if name not in tracked_names})
        if missing:
            out[str(page)] = missing
    return out


def git_tracked(repo: Path = REPO) -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    run = subprocess.run(["git", "-c", f"safe.directory={repo}", "-C", str(repo), "ls-files"],
                         capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        pytest.skip(f"{repo} is not a git checkout: {run.stderr.strip()}")
    return run.stdout.splitlines()


def test_every_cited_result_file_is_committed():
    missing = untracked_citations(pages(), git_tracked())
    assert not missing, f"docs cite result files that git does not track: {missing}"


def test_the_check_reports_an_untracked_citation(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("| arm | KL |\n|---|---|\n| gptq | 0.1031 |\n\n"
                    "From [`fidelity-20261202T040536Z.partial.json`](../benchmarks/results/"
                    "fidelity-20261202T040536Z.partial.json) and `quantize-20261202T033134Z.json`.\n")
    tracked = ["benchmarks/results/quantize-20261202T033134Z.json"]
    assert untracked_citations([page], tracked) == {
        str(page): ["fidelity-20261202T040536Z.partial.json"]}
    tracked.append("benchmarks/results/fidelity-20261202T040536Z.partial.json")
    assert untracked_citations([page], tracked) == {}


def test_the_pattern_finds_the_result_file_names_in_use():
    text = ("memory-trace-1x-20261201T102950Z.json, runtime_patches-bf16-20261129T134512Z.json, "
            "phone-export-demo-xnnpack-8da8w-s64-20261129T133624Z.json, "
            "test-tiers-20261203T150524Z.log")
    assert CITED_RESULT.findall(text) == text.split(", ")
