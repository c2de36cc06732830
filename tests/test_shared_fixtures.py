"""The end-to-end tier's sharing between pytest-xdist workers (tests/conftest.py): an artifact
built once per run whichever worker asks first, and tests that share an in-memory fixture
sent to one worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import LONGEST_FIRST, WORKER_GROUPS, build_once

REPO = Path(__file__).resolve().parents[1]


def test_two_processes_asking_at_once_build_once(tmp_path: Path) -> None:
    """Two processes ask for the same artifact at the same moment: one builds it (slowly),
    the other waits on the lock and gets the finished directory."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from tests.conftest import build_once
        dst = Path({str(tmp_path / "artifact")!r})
        def build():
            with open(Path({str(tmp_path)!r}) / "builds", "a") as fh:
                fh.write("x")
            dst.mkdir()
            time.sleep(1.0)
            (dst / "weights").write_text("done")
        print(build_once(dst, build).joinpath("weights").read_text())
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["done", "done"]
    assert (tmp_path / "builds").read_text() == "x"


def test_a_failed_build_is_not_reused(tmp_path: Path) -> None:
    dst = tmp_path / "artifact"

    def broken() -> None:
        dst.mkdir()
        (dst / "half").write_text("")
        raise RuntimeError("the build failed")

    with pytest.raises(RuntimeError):
        build_once(dst, broken)
    assert not dst.with_name("artifact.done").exists()
    built = []
    build_once(dst, lambda: (built.append(1), dst.mkdir(), (dst / "whole").write_text("")))
    assert built == [1] and sorted(p.name for p in dst.iterdir()) == ["whole"]
    build_once(dst, lambda: built.append(2))  # done: not built again
    assert built == [1]


@pytest.mark.e2e
def test_worker_groups_and_order_name_real_fixtures_and_tests() -> None:
    """Every grouped fixture and every entry of the longest-first list still exists, so a
    rename cannot silently undo the sharing (a group would then be split between workers)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "e2e", "-q",
                           "-p", "no:cacheprovider", "--setup-plan"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for fixture in WORKER_GROUPS:
        assert re.search(rf"SETUP +[SM] {fixture}\b", proc.stdout), fixture
    for fragment in LONGEST_FIRST:
        assert fragment in proc.stdout, fragment


@pytest.mark.e2e
def test_tests_sharing_a_grouped_fixture_run_on_one_worker(tmp_path: Path) -> None:
    """Under ``-n 2 --dist loadgroup`` (CI's end-to-end command) the six tests that use one
    grouped fixture run on one worker, the others wherever they fall. (pytest 9.2's structured
    node ids made pytest-xdist 3.8 drop the groups without a word, so each 1B test of the tier
    built the 1B artifact's fixture on its own worker; the test extras pin pytest below 9.2.)"""
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import time
        import pytest
        from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the groups)

        @pytest.fixture(scope="session")
        def engines():
            time.sleep(0.5)
            return 1
    """))
    (tmp_path / "test_grouped.py").write_text(textwrap.dedent("""
        import time
        import pytest

        @pytest.mark.parametrize("i", range(6))
        def test_grouped(engines, i):
            time.sleep(0.2)

        @pytest.mark.parametrize("i", range(6))
        def test_free(i):
            time.sleep(0.2)
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v",
                           "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir", str(tmp_path),
                           str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    workers = set(re.findall(r"\[(gw\d+)\] .*PASSED \S*::test_grouped\[", proc.stdout))
    assert len(re.findall(r"PASSED \S*::test_grouped\[", proc.stdout)) == 6, proc.stdout[-3000:]
    assert len(workers) == 1, proc.stdout[-3000:]
