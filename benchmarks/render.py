"""The results pages' rendered tables, from the committed result files.

    python -m benchmarks render [--check]

A page holds a suite's table between ``<!-- SUITE table: begin -->`` and
``<!-- SUITE table: end -->``; every suite module (:data:`RENDERED`) renders it from its newest
result files with ``render(results_dir, page_dir) -> str`` (links relative to the page), naming
the command, the CPU and the files. ``render`` rewrites every such block of the pages in
:data:`PAGES`; ``--check`` only says which blocks differ (exit 1), as the unit test does.

The helpers: :func:`harness_block` (a harness result's table: medians, ranges, ratios and
verdicts), and for suites whose evaluation is deterministic, :func:`merged_block` (per CPU
class, each arm's row from its newest run with the same settings, :func:`comparable_runs`).
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
SUITES = ROOT / "benchmarks" / "suites"
# suite -> the module that renders its table: every suite (a module of benchmarks/suites/ with a
# ``render``), and the test tiers' timings
RENDERED = {**{p.stem: f"benchmarks.suites.{p.stem}" for p in sorted(SUITES.glob("*.py"))
               if "\ndef render(" in p.read_text()},
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
    # partial files of the first harness versions record no machine
    recorded = doc.get("machine") or {"cpu": {"model": "CPU not recorded"},
                                      "threads": {"cpu_count": "?"}}
    cpu = recorded["cpu"]
    return {"cpu": cpu["model"], "isa": isa(cpu), "cores": recorded["threads"]["cpu_count"],
            "sha": doc["git_at_start"]["sha"],
            "partial": f"a partial run: {done} of {doc['passes']} passes"}


def partial_note(doc: dict) -> str:
    """`` (a partial run: N of M arm passes)`` for a partial result file, else ``""``."""
    if doc.get("complete", True):
        return ""
    done = sum(1 for r in doc["records"] if r.get("ok"))
    return f" (a partial run: {done} of {len(doc['arms']) * int(doc.get('passes', 0))} arm passes)"


def run_footer(doc: dict, path: Path, docs: Path, command: str) -> str:
    """The line under a table of one result file: machine, git commit (and how many arm passes
    a partial run holds), the command and the file."""
    meta = machine(doc)
    return (f"Machine: {meta['cpu']} ({meta['isa']}), {meta['cores']} cores; git "
            f"{meta['sha'][:7]}{partial_note(doc)}. Command: `{command}`. Result file: "
            f"[{path.name}]({os.path.relpath(path, docs)}).")


def isa(cpu: dict) -> str:
    """What a CPU's flags say about its matrix units: AMX, AVX-512 (with or without bf16),
    or AVX2."""
    flags = cpu.get("flags", [])
    flags = set(flags.split() if isinstance(flags, str) else flags)
    if not flags:
        return "flags not recorded"
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
        ran = ",".join(doc["summary"])
        run = command if list(doc["summary"]) == arms else \
            f"{command},{ran}" if " --arms " in command else f"{command} --arms {ran}"
        parts += [harness_table(doc, extra), "",
                  f"Machine: {meta['cpu']} ({meta['isa']}), {meta['cores']} cores; git "
                  f"{meta['sha'][:7]}{partial}. Command: `{run}`. Result file: "
                  f"[{path.name}]({os.path.relpath(path, docs)}).", ""]
    return "\n".join(parts[:-1])


def summary_of(doc: dict, metrics: list[dict]) -> dict[str, dict[str, dict]]:
    """A result file's per-arm statistics: its summary, or for a partial file the statistics
    of the passes it holds (``metrics``: the suite's, as dicts of name, unit, better)."""
    from dataclasses import asdict

    from .harness import Metric, stats

    if doc.get("summary"):
        return doc["summary"]
    passes = max((r["pass_index"] for r in doc["records"]), default=0) + 1
    out: dict[str, dict[str, dict]] = {}
    for arm in doc["arms"]:
        by_pass = {r["pass_index"]: r for r in doc["records"] if r["arm"] == arm}
        out[arm] = {m["name"]: asdict(stats(Metric(**m), [
            by_pass[p]["metrics"].get(m["name"]) if p in by_pass and by_pass[p]["ok"] else None
            for p in range(passes)])) for m in metrics}
    return out


def _value(s: dict, fmt: str) -> str:
    if not s or not s.get("n"):
        return "—"
    text = format(s["median"], fmt)
    return text if s["spread"] == 0 else f"{text} [{format(s['min'], fmt)}–{format(s['max'], fmt)}]"


def comparable_runs(results: Path, pattern: str, keys: tuple[str, ...],
                    partial: bool = False) -> list[list[tuple[Path, dict]]]:
    """The result files of ``pattern``, grouped by CPU class (:func:`isa`), newest class
    first; in each class the newest file, then the older complete files whose settings agree
    with it on ``keys`` (runs whose rows can stand in one table). ``partial``: a partial file
    may be a class's newest."""
    groups: dict[str, list[tuple[Path, dict]]] = {}
    files = sorted(results.glob(pattern), key=lambda p: p.name.split("-")[-1][:16], reverse=True)
    for path in files:
        doc = json.loads(path.read_text())
        is_partial = not doc.get("complete", True)
        if is_partial and not (partial and doc.get("records")):
            continue
        group = groups.setdefault(isa(_cpu(doc)), [])
        if not group:
            group.append((path, doc))
            continue
        if is_partial or not group[0][1].get("provenance"):
            continue
        first = group[0][1]["provenance"]["settings"]
        settings = doc["provenance"]["settings"]
        if all(settings.get(k) == first.get(k) for k in keys):
            group.append((path, doc))
    return list(groups.values())


def merged_table(runs: list[tuple[Path, dict]], docs: Path, metrics: list[dict],
                 formats: dict[str, str], arm_order: list[str] | None = None,
                 label: dict[str, str] | None = None, extra: dict | None = None) -> str:
    """One row per arm from the newest of ``runs`` that measured it (arms limited to and
    ordered by ``arm_order`` when given): each metric's median (and [min–max] when the passes
    differ), the passes, the git commit and the result file."""
    rows: dict[str, tuple[Path, dict, dict]] = {}
    for path, doc in runs:
        for arm, per in summary_of(doc, metrics).items():
            rows.setdefault(arm, (path, doc, per))
    order = [a for a in (arm_order or rows) if a in rows]
    names = {**LABELS, **(label or {})}
    extra = extra or {}
    head = ["arm", *(names.get(m["name"], m["name"]) for m in metrics), *extra, "passes", "git",
            "result file"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in order:
        path, doc, per = rows[arm]
        meta = machine(doc)
        n = max((s.get("n") or 0) for s in per.values())
        cells = [f"`{arm}`", *(_value(per.get(m["name"]), formats.get(m["name"], ".4g"))
                               for m in metrics),
                 *(fn(arm, doc) for fn in extra.values()), str(n), meta["sha"][:7],
                 f"[{path.name}]({os.path.relpath(path, docs)})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def merged_block(results: Path, docs: Path, pattern: str, command: str, keys: tuple[str, ...],
                 metrics: list[dict], formats: dict[str, str], arm_order: list[str] | None = None,
                 label: dict[str, str] | None = None, partial: bool = False,
                 extra: dict | None = None) -> str:
    """Per CPU class, :func:`merged_table` of :func:`comparable_runs`, with the machine and
    the command (``extra``: column title -> function(arm, doc) -> cell)."""
    parts = []
    for runs in comparable_runs(results, pattern, keys, partial):
        meta = machine(runs[0][1])
        partial_note = f" The newest is {meta['partial']}." if meta["partial"] else ""
        parts += [merged_table(runs, docs, metrics, formats, arm_order, label, extra), "",
                  f"Machine: {meta['cpu']} ({meta['isa']}), {meta['cores']} cores. Each row is "
                  f"the newest run of that arm on this CPU class with the same settings "
                  f"({', '.join(keys)}).{partial_note} Command: `{command}`.", ""]
    if not parts:
        return "Not measured yet: no result file of this suite is committed."
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
