"""The hostile-input corpus (``tests/hostile/generate.py``): every case, in-process.

Each case asserts the exit code; the one ``error:`` line holding the expected message (for
``verify`` on a broken artifact: exit 1 and an ``ERROR`` finding); no traceback (no exception
escaped the command, none printed); nothing at or beside the output that was not there before;
and every file of the case's directory, the sources included, byte-identical before and after.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from .hostile.generate import CASES, Bases, Case, Workspace, file_digests, invoke


@pytest.fixture(scope="session")
def bases(hostile_bases: Bases) -> Bases:
    return hostile_bases


def _beside(dst: Path) -> set[str]:
    return {p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}")} \
        if dst.parent.is_dir() else set()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_input(case: Case, bases: Bases, tmp_path: Path, monkeypatch) -> None:
    ws = Workspace(tmp_path / "case", bases)
    ws.root.mkdir()
    monkeypatch.chdir(ws.root)  # a default output path would land here, and be seen
    argv = case.build(ws)
    before = file_digests(ws.root)  # every file of the case, the sources among them
    dst_existed = ws.dst.exists() or ws.dst.is_symlink()
    beside_before = _beside(ws.dst)

    out = invoke(argv)

    shown = f"cpu-quant {' '.join(map(str, argv))}\n--- stdout\n{out.stdout[-2000:]}\n" \
            f"--- stderr\n{out.stderr[-3000:]}\n--- exception {out.exception!r}"
    assert not out.traceback, shown
    assert out.exit_code == case.exit_code, shown
    if case.kind == "error":
        assert len(out.error_lines) == 1 and case.needle in out.error_lines[0], shown
    else:
        findings = [ln for ln in out.stdout.splitlines() if ln.startswith("ERROR")]
        assert any(case.needle in ln for ln in findings), shown
    after = file_digests(ws.root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    sources = [str(p.relative_to(ws.root)) for p in ws.sources if ws.root in p.parents]
    touched = [k for k in changed if any(k == s or k.startswith(s + "/") for s in sources)]
    assert not touched, f"the source changed: {touched}"
    if not dst_existed:
        assert not (ws.dst.exists() or ws.dst.is_symlink()), f"{ws.dst} was written"
    assert _beside(ws.dst) == beside_before, f"left beside {ws.dst}: {_beside(ws.dst)}"
    assert not changed, f"files of the case directory changed: {changed}"


def test_the_corpus_covers_every_command() -> None:
    from cpu_quant.cli import main

    covered = {c.id.split("-")[0] for c in CASES}
    assert {"model", "artifact", "output", "eval", "resume", "gguf", "calib", "option",
            "probe"} <= covered
    named = " ".join(c.id for c in CASES)
    for command in main.commands:
        assert command in named, f"no hostile case for `cpu-quant {command}`"
    assert len({c.id for c in CASES}) == len(CASES), "case ids repeat"


def test_the_generator_script_writes_the_corpus(tmp_path: Path, bases: Bases) -> None:
    """``python -m tests.hostile.generate`` writes every case's input and the table; here on
    the session's bases, for one case of each group (the full corpus is the test above)."""
    from .hostile.generate import write_corpus

    firsts = {}
    for c in CASES:
        firsts.setdefault(c.id.split("-")[0], c)
    t0 = time.perf_counter()
    table = write_corpus(tmp_path / "corpus", bases, list(firsts.values()))
    assert time.perf_counter() - t0 < 60
    assert [row["id"] for row in table] == [c.id for c in firsts.values()]
    for row in table:
        assert (tmp_path / "corpus" / "cases" / row["id"] / "case.json").is_file()
        assert row["argv"][0] in {"gptq", "tinygemm", "eval", "convert", "verify", "inspect",
                                  "export-phone", "probe", "report", "quantize"}
    assert os.path.isfile(tmp_path / "corpus" / "cases.json")
