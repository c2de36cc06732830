"""The results pages' rendered tables, from the committed result files.

    python -m benchmarks render [--check]

A page holds a suite's table between ``<!-- SUITE table: begin -->`` and
``<!-- SUITE table: end -->``; the suite module (:data:`RENDERED`) renders it from the newest
result file of that suite with ``render(results_dir, page_dir) -> str`` (links relative to the
page). ``render`` rewrites every such block of the pages in :data:`PAGES`; ``--check`` only says
which blocks differ (exit 1), as the unit test does.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (ROOT / "docs" / "results.md",)
# suite -> the module that renders its table
RENDERED = {"scale": "benchmarks.suites.scale", "determinism": "benchmarks.suites.determinism"}
BLOCK = re.compile(r"<!-- (?P<suite>[\w-]+) table: begin -->\n.*?<!-- (?P=suite) table: end -->",
                   re.S)


def newest(results: Path, pattern: str) -> Path | None:
    """The newest result file of ``pattern`` that holds a pass (a complete one before a
    partial one of the same time), or None."""
    files = sorted(results.glob(pattern), key=lambda p: (p.name.split("-")[-1][:16],
                                                         "partial" not in p.name))
    for path in reversed(files):
        doc = json.loads(path.read_text())
        if "provenance" in doc or doc.get("records"):  # a partial file from its first pass on
            return path
    return None


def machine(doc: dict) -> dict:
    """The machine and git commit of a result file, complete or partial (a partial file records
    the machine and the commit at its start), and which passes it holds."""
    if doc.get("complete", True):
        prov = doc["provenance"]
        return {"cpu": prov["cpu"]["model"], "isa": isa(prov["cpu"]),
                "cores": prov["threads"]["cpu_count"], "sha": prov["git"]["sha"], "partial": None}
    done = max((r["pass_index"] for r in doc["records"]), default=0) + 1
    cpu = doc["machine"]["cpu"]
    return {"cpu": cpu["model"], "isa": isa(cpu), "cores": doc["machine"]["threads"]["cpu_count"],
            "sha": doc["git_at_start"]["sha"],
            "partial": f"a partial run: {done} of {doc['passes']} passes"}


def isa(cpu: dict) -> str:
    """What a CPU's flags say about its matrix units: AMX, AVX-512 (with or without bf16),
    or AVX2."""
    flags = cpu.get("flags", [])
    flags = set(flags.split() if isinstance(flags, str) else flags)
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX-512" + (" with bf16" if "avx512_bf16" in flags else ", no bf16") + ", no AMX"
    return "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"


def render_block(suite: str, results: Path, page_dir: Path) -> str:
    return importlib.import_module(RENDERED[suite]).render(results, page_dir)


def update_page(page: Path, results: Path, write: bool = True) -> list[str]:
    """Render every block of ``page``; the suites whose block changed (written unless
    ``write`` is false)."""
    text = page.read_text()
    changed = []

    def fill(m: re.Match) -> str:
        suite = m.group("suite")
        if suite not in RENDERED:
            raise ValueError(f"{page}: no suite renders a {suite!r} table")
        new = (f"<!-- {suite} table: begin -->\n{render_block(suite, results, page.parent)}\n"
               f"<!-- {suite} table: end -->")
        if new != m.group(0):
            changed.append(suite)
        return new

    new_text = BLOCK.sub(fill, text)
    if write and new_text != text:
        page.write_text(new_text)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks render", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = ap.parse_args(argv)
    stale = 0
    for page in PAGES:
        changed = update_page(page, RESULTS, write=not args.check)
        verb = "differs" if args.check else "updated"
        for suite in changed:
            print(f"{page.relative_to(ROOT)}: {suite} table {verb}")
        stale += len(changed)
    if not stale:
        print("every rendered table is current")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
