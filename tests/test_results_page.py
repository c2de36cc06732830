"""The results page's rendered tables are what the committed result files say: rendering them
again changes nothing (``python -m benchmarks.suites.scale`` writes the scale table)."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.suites.scale import update_page

REPO = Path(__file__).resolve().parents[1]


def test_the_scale_table_is_rendered_from_the_result_files(tmp_path: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "results.md"
    shutil.copy(REPO / "docs" / "results.md", page)
    # the page's links are relative to docs/: render beside a link to the real results
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "results").symlink_to(REPO / "benchmarks" / "results")
    assert not update_page(page, tmp_path / "benchmarks" / "results"), \
        "docs/results.md's scale table differs from its rendering: run python -m benchmarks.suites.scale"
