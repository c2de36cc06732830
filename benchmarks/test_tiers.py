"""How long CI's steps take: the setup, the unit tier and the end-to-end tier, one run each.

    python -m benchmarks.test_tiers [--setup] [--only unit|unit-xdist|e2e] [--out DIR]

Runs, from the repository root, the commands of ``.ci/run`` in its order: with ``--setup``,
``scripts/setup.sh --tests`` first (on a clean clone this is the install CI does); then
its pytest lines (the unit tier in one process, then the end-to-end tier ``-m e2e`` on two
workers), each with the venv's
Python, exactly as ``.ci/run`` states them. For each step it records the wall time, the exit
status, pytest's closing line (passed / skipped / failed counts and pytest's own time), every
test's seconds (setup, call and teardown, from a JUnit XML report the runner asks pytest for;
the only argument it adds), the load average before and after, and the tail of its output; the
result carries the benchmark provenance (git
SHA and cleanliness, CPU model and flags, package versions). Result file:
``<out>/test-tiers-<UTC time>.json``, written atomically once every step has run; the run
exits non-zero when any step failed (the file is written either way).

This is one timed run, not a comparison: the README states its times as "one clean-clone run
on <CPU>", with the load average it ran under.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from . import provenance
from .harness import write_result

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
TAIL = 3000
SUMMARY_RE = re.compile(r"^=*\s*(?P<body>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s")


def steps(with_setup: bool) -> list[tuple[str, list[str]]]:
    """The commands of ``.ci/run``, in its order, as (name, argv): the setup (only
    ``with_setup``), then each pytest line, named ``e2e`` when it selects ``-m e2e``, else
    ``unit-xdist`` when it runs on workers (``-n``) and ``unit`` in one process (earlier
    ``.ci/run`` files ran the unit tier both ways)."""
    out = []
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        argv = shlex.split(line, comments=True)
        if argv[:1] == ["./scripts/setup.sh"] and with_setup:
            out.append(("setup", argv))
        elif argv[:3] == [".venv/bin/python", "-m", "pytest"]:
            marks = [argv[i + 1] for i in range(3, len(argv) - 1) if argv[i] == "-m"]
            name = "e2e" if "e2e" in marks else "unit-xdist" if "-n" in argv else "unit"
            out.append((name, [str(REPO / argv[0]), *argv[1:]]))
    return out


def pytest_summary(output: str) -> dict | None:
    """pytest's closing line (``12 passed, 1 skipped in 34.56s``) as counts and seconds."""
    for line in reversed(output.splitlines()):
        m = SUMMARY_RE.match(line.strip())
        if m:
            counts = {}
            for part in m.group("body").split(", "):
                n, word = part.split(" ", 1)
                counts[word] = int(n)
            return {"counts": counts, "pytest_seconds": float(m.group("seconds"))}
    return None


def test_seconds(junit_xml: Path) -> dict[str, float]:
    """Seconds per test (setup, call and teardown) from pytest's JUnit XML report, longest
    first, keyed ``path::name`` as pytest names the test."""
    if not junit_xml.is_file():
        return {}
    seconds = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        seconds[f"{module}.py::{case.get('name')}"] = float(case.get("time") or 0)
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


def venv_provenance(settings: dict) -> dict:
    """The provenance as the venv's Python sees it (the interpreter the tiers ran under: its
    torch, vLLM and thread count), collected in a subprocess; this runner itself may run in a
    system Python without them. Without a venv (its setup failed) the provenance is this
    interpreter's, and validation then names what it lacks."""
    python = REPO / ".venv" / "bin" / "python"
    if not python.is_file():
        return provenance.collect(settings)
    code = ("import json, sys; from benchmarks import provenance; "
            "print(json.dumps(provenance.collect(json.loads(sys.argv[1]))))")
    proc = subprocess.run([str(python), "-c", code, json.dumps(settings)], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise provenance.ProvenanceError(
            f"the venv's Python could not collect the provenance: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def run_step(name: str, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="test-tiers-") as tmp:
        junit = Path(tmp) / "junit.xml"
        if name != "setup":
            argv = [*argv, f"--junit-xml={junit}"]
        load_before = list(os.getloadavg())
        t0 = time.perf_counter()
        proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        wall = time.perf_counter() - t0
        record = {"step": name, "command": " ".join(argv[:-1] if name != "setup" else argv),
                  "returncode": proc.returncode, "wall_seconds": round(wall, 1),
                  "loadavg_before": load_before, "loadavg_after": list(os.getloadavg()),
                  "output_tail": proc.stdout[-TAIL:]}
        if name != "setup":
            record["pytest"] = pytest_summary(proc.stdout)
            record["test_seconds"] = test_seconds(junit)
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.test_tiers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="run scripts/setup.sh --tests first")
    ap.add_argument("--only", choices=("unit", "unit-xdist", "e2e"), default=None,
                    help="time this tier alone (the result says which steps ran)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    chosen = [(n, c) for n, c in steps(args.setup) if args.only in (None, n) or n == "setup"]
    records = []
    for name, cmd in chosen:
        print(f"test_tiers: {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        records.append(run_step(name, cmd))
        print(f"test_tiers: {name}: rc {records[-1]['returncode']}, "
              f"{records[-1]['wall_seconds']} s", file=sys.stderr, flush=True)
        if name == "setup" and records[-1]["returncode"] != 0:
            break
    prov = venv_provenance({"steps": [n for n, _ in chosen]})
    try:
        provenance.validate(prov)
        prov_error = None
    except provenance.ProvenanceError as exc:
        prov_error = str(exc)
        print(f"test_tiers: {exc}; the result is written as incomplete", file=sys.stderr)
    doc = {"suite": "test-tiers", "complete": len(records) == len(chosen) and prov_error is None,
           "provenance_error": prov_error,
           "description": "CI's steps (.ci/run) timed on this checkout, one run each",
           "records": records, "total_wall_seconds": round(sum(r["wall_seconds"] for r in records), 1),
           "provenance": prov}
    path = write_result(args.out, "test-tiers", doc)
    print(f"test_tiers: wrote {path}", file=sys.stderr)
    return 0 if all(r["returncode"] == 0 for r in records) and doc["complete"] else 1


def _cell(record: dict | None) -> str:
    if record is None:
        return "not run"
    counts = (record.get("pytest") or {}).get("counts", {})
    said = ", ".join(f"{n} {word}" for word, n in counts.items()
                     if word in ("passed", "failed", "skipped", "xfailed", "error", "errors"))
    status = "" if record["returncode"] == 0 else f", exit {record['returncode']}"
    return f"{record['wall_seconds']:.0f} s" + (f" ({said}{status})" if said or status else "")


def _unit_cell(record: dict) -> str:
    """The unit tier's cell; a run from before CI ran it in one process says how it ran."""
    workers = "-n" in shlex.split(record["command"])
    return _cell(record) + (" on 2 workers" if workers else "")


def render(results: Path, docs: Path) -> str:
    """The testing page's table: per CPU class, the newest run that timed every tier (the
    setup too where it ran), with its machine, git and result file."""
    from .render import isa

    rows, seen = [], set()
    current = [name for name, _ in steps(False)]  # what .ci/run runs now, setup aside
    for path in sorted(results.glob("test-tiers-2*.json"), reverse=True):
        doc = json.loads(path.read_text())
        steps_run = {r["step"]: r for r in doc["records"]}
        if not set(current) <= set(steps_run):
            continue
        cpu = doc["provenance"]["cpu"]
        cls = isa(cpu)
        if cls in seen:
            continue
        seen.add(cls)
        git = doc["provenance"]["git"]
        total = sum(steps_run[n]["wall_seconds"] for n in ["setup", *current] if n in steps_run)
        rows.append(f"| {cpu['model']} ({cls}), {doc['provenance']['threads']['cpu_count']} cores "
                    f"| {git['sha'][:7]}{' (dirty)' if git['dirty'] else ''} "
                    f"| {_cell(steps_run.get('setup'))} | {_unit_cell(steps_run['unit'])} "
                    f"| {_cell(steps_run['e2e'])} "
                    f"| {total / 60:.1f} min | [{path.name}]({os.path.relpath(path, docs)}) |")
    if not rows:
        return "Not measured yet: no result file of a run of every tier is committed."
    return "\n".join(["| CPU | git | setup (clean clone) | unit tier, one process | "
                      "end-to-end tier, 2 workers | CI's steps, total | result file |",
                      "|---|---|---|---|---|---|---|", *rows, "",
                      "Command: `python -m benchmarks.test_tiers [--setup]`."])


if __name__ == "__main__":
    sys.exit(main())
