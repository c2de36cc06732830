"""The results page's rendered tables are what the committed result files say: rendering them
again changes nothing (``python -m benchmarks render`` writes them)."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.render import RENDERED, update_page

REPO = Path(__file__).resolve().parents[1]


def test_the_rendered_tables_are_the_result_files(tmp_path: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "results.md"
    shutil.copy(REPO / "docs" / "results.md", page)
    text = page.read_text()
    for suite in RENDERED:  # every suite that renders a table has its block on the page
        assert f"<!-- {suite} table: begin -->" in text, suite
    # the page's links are relative to docs/: render beside a link to the real results
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "results").symlink_to(REPO / "benchmarks" / "results")
    changed = update_page(page, tmp_path / "benchmarks" / "results")
    assert not changed, f"docs/results.md's {changed} tables differ from their rendering: " \
                        "run python -m benchmarks render"
