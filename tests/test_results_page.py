"""The results page's rendered tables are what the committed result files say: rendering them
again changes nothing (``python -m benchmarks render`` writes them)."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.render import PAGES, RENDERED, update_page

REPO = Path(__file__).resolve().parents[1]


def test_the_rendered_tables_are_the_result_files(tmp_path: Path):
    docs = tmp_path / "docs"
    docs.mkdir()
    # the pages' links are relative to docs/: render beside a link to the real results
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "results").symlink_to(REPO / "benchmarks" / "results")
    found = []
    for original in PAGES:
        page = docs / original.name
        shutil.copy(original, page)
        found += [suite for suite in RENDERED if f"<!-- {suite} table: begin -->" in page.read_text()]
        changed = update_page(page, tmp_path / "benchmarks" / "results")
        assert not changed, f"docs/{page.name}'s {changed} tables differ from their rendering: " \
                            "run python -m benchmarks render"
    # every suite that renders a table has its one block on the pages
    assert sorted(found) == sorted(RENDERED), found
