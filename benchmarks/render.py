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
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (ROOT / "docs" / "results.md", ROOT / "docs" / "testing.md")
# suite -> the module that renders its table
RENDERED = {"scale": "benchmarks.suites.scale", "determinism": "benchmarks.suites.determinism",
            "eval": "benchmarks.suites.eval", "distributed": "benchmarks.suites.distributed",
            "quantize": "benchmarks.suites.quantize", "memory": "benchmarks.suites.memory",
            "runtime": "benchmarks.suites.runtime", "phone": "benchmarks.suites.phone",
            "hessian_cost": "benchmarks.suites.hessian_cost",
            "core_scaling": "benchmarks.suites.core_scaling",
            "calibration": "benchmarks.suites.calibration",
            "test-tiers": "benchmarks.test_tiers"}
BLOCK = re.compile(r"<!-- (?P<suite>[\w-]+) table: begin -->\n.*?<!-- (?P=suite) table: end -->",
                   re.S)


def newest(results: Path, pattern: str, complete: bool = False) -> Path | None:
    """The newest result file of ``pattern`` that holds a pass (a complete one before a
    partial one of the same time; only complete ones with ``complete``), or None."""
    files = sorted(results.glob(pattern), key=lambda p: (p.name.split("-")[-1][:16],
                                                         "partial" not in p.name))
    for path in reversed(files):
        if complete and "partial" in path.name:
            continue
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


LABELS = {"wall_seconds": "wall", "cpu_seconds": "CPU time", "peak_rss_anon_bytes": "peak RssAnon",
          "decode_tok_s": "decode", "prefill_tok_s": "prefill",
          "rss_anon_bytes": "RssAnon after start-up", "start_seconds": "engine start",
          "pte_bytes": "`.pte` size"}


def _spread(s: dict, unit: str) -> str:
    """A metric's median [min–max] with its unit (bytes in MiB)."""
    if unit == "B":
        return f"{s['median'] / 2**20:.0f} [{s['min'] / 2**20:.0f}–{s['max'] / 2**20:.0f}] MiB"
    return f"{s['median']:.4g} [{s['min']:.4g}–{s['max']:.4g}] {unit}".rstrip()


def harness_table(doc: dict, extra: dict | None = None) -> str:
    """A harness suite's table: one row per arm, each metric's median with its range over the
    passes, and each arm's ratio to the baseline (median [range] of the per-pass ratios, with
    the harness's verdict). ``extra``: column title -> function(arm, doc) -> cell."""
    metrics = doc["metrics"]
    extra = extra or {}
    head = ["arm", "passes", *(LABELS.get(m["name"], m["name"]) for m in metrics), *extra]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, summary in doc["summary"].items():
        records = [r for r in doc["records"] if r["arm"] == arm and r.get("ok")]
        cells = [f"`{arm}`", str(len(records))]
        for m in metrics:
            s = summary.get(m["name"])
            if not s or not s.get("n"):
                cells.append("—")
                continue
            cell = _spread(s, m["unit"])
            cmp = doc.get("comparisons", {}).get(arm, {}).get(m["name"])
            if cmp and cmp.get("ratio_passes"):
                verdict = cmp["verdict"].replace(" (lower is better)", "").replace(
                    " (higher is better)", "")
                cell += (f"; ×{cmp['ratio_median']:.3f} [{cmp['ratio_min']:.3f}–"
                         f"{cmp['ratio_max']:.3f}] of "
                         f"`{(doc.get('baseline_of') or {}).get(arm, doc['baseline'])}` ({verdict})")
            cells.append(cell)
        cells += [fn(arm, doc) for fn in extra.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def harness_block(results: Path, docs: Path, suite: str, command: str,
                  extra: dict | None = None, per_cpu: bool = False,
                  all_arms: list[str] | None = None) -> str:
    """The block of a harness suite: its table from the newest result file, the machine, the
    command and the file (links relative to the page in ``docs``). ``per_cpu``: one table per
    CPU class (:func:`isa`) that a result file was measured on, the newest file of each.
    ``all_arms``: the suite's arms, so that a run of fewer says its ``--arms``."""
    files = [newest(results, f"{suite}-2*.json", complete=True)]
    if per_cpu and files[0] is not None:
        seen = {isa(_cpu(json.loads(files[0].read_text())))}
        for path in sorted(results.glob(f"{suite}-2*.json"), reverse=True):
            if "partial" in path.name:
                continue
            cls = isa(_cpu(json.loads(path.read_text())))
            if cls not in seen:
                seen.add(cls)
                files.append(path)
    if files[0] is None:
        return "Not measured yet: no result file of this suite is committed."
    parts, arms = [], None
    for path in files:
        doc = json.loads(path.read_text())
        meta = machine(doc)
        partial = f" ({meta['partial']})" if meta["partial"] else ""
        arms = arms or all_arms or list(doc["summary"])  # the newest file's arms
        run = command if list(doc["summary"]) == arms else \
            f"{command} --arms {','.join(doc['summary'])}"
        parts += [harness_table(doc, extra), "",
                  f"Machine: {meta['cpu']} ({meta['isa']}), {meta['cores']} cores; git "
                  f"{meta['sha'][:7]}{partial}. Command: `{run}`. Result file: "
                  f"[{path.name}]({os.path.relpath(path, docs)}).", ""]
    return "\n".join(parts[:-1])


def _cpu(doc: dict) -> dict:
    """The CPU a result file records (a partial file: at its start; older partial files: none)."""
    return (doc.get("provenance") or doc.get("machine") or {}).get("cpu", {})


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
