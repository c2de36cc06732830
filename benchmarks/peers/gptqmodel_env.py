"""GPTQModel 7.6.0 as a peer arm, installed by the harness into its own virtual environment.

GPTQModel pins numpy 2.2.6 and pulls datasets/pyarrow/torchao, which our dev venv must not
take, so it lives in ``$XDG_CACHE_HOME/cpu-quant/peers/gptqmodel-7.6.0`` (``CPU_QUANT_CACHE``
overrides the cache root, as for the demo model). Installation:

1. ``python -m venv DIR`` from the harness' own base interpreter;
2. ``pip install torch==2.13.0`` under a constraints file that pins it to the CPU build
   (``torch==2.13.0+cpu``, which only the local wheel satisfies: PyPI's plain ``2.13.0`` is
   the CUDA build and would drag in ``nvidia-*``);
3. ``pip install gptqmodel==7.6.0 optimum==2.3.0`` under the same constraints (optimum is what
   transformers' own GPTQ integration loads through; ``tests/test_peer_loaders.py`` needs it);
4. a check that the venv holds no ``nvidia-*``/``triton`` distribution and that
   ``torch.version.cuda is None``; otherwise the venv is deleted and the install fails.

The venv is built in ``DIR.partial`` and renamed into place when complete, so a half-built
environment is never mistaken for a ready one. ``READY`` inside it records the versions.

``python -m benchmarks.peers.gptqmodel_env`` installs (or reports) the venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

GPTQMODEL_VERSION = "7.6.0"
OPTIMUM_VERSION = "2.3.0"
TORCH_PIN = "2.13.0"
RUNNER = Path(__file__).with_name("gptqmodel_runner.py")


def cache_root() -> Path:
    """cpu-quant's cache directory (the peers' venvs live under it)."""
    from cpu_quant.core.cache import cache_dir

    return cache_dir()


def venv_dir() -> Path:
    return cache_root() / "peers" / f"gptqmodel-{GPTQMODEL_VERSION}"


def venv_python(root: Path | None = None) -> Path:
    return (root or venv_dir()) / "bin" / "python"


@dataclass
class PeerEnv:
    path: Path
    python: Path
    versions: dict

    def describe(self) -> dict:
        return {"path": str(self.path), "python": str(self.python), "versions": self.versions}


class PeerInstallError(RuntimeError):
    """The peer environment could not be built; the message holds pip's last lines."""


def ready_env() -> PeerEnv | None:
    """The installed environment, or None when it is absent or incomplete."""
    root = venv_dir()
    marker = root / "READY"
    if not marker.is_file() or not venv_python(root).exists():
        return None
    return PeerEnv(root, venv_python(root), json.loads(marker.read_text()))


def _run(cmd: list[str], log) -> None:
    print("+ " + " ".join(cmd), file=log, flush=True)
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise PeerInstallError(f"`{' '.join(cmd[:6])} ...` exited {proc.returncode}; "
                               f"see {getattr(log, 'name', 'the log')}")


def _base_python() -> str:
    # Create the peer venv from the base interpreter, not from inside our dev venv.
    return getattr(sys, "_base_executable", None) or sys.executable


def _torch_constraint_lines() -> list[str]:
    # `+cpu` is only on the local wheel (PIP_FIND_LINKS / /etc/xdg/pip): PyPI's 2.13.0 is CUDA.
    return [f"torch=={TORCH_PIN}+cpu"]


def _check_no_cuda(python: Path) -> dict:
    code = (
        "import json, importlib.metadata as md, torch\n"
        "dists = sorted(d.metadata['Name'] for d in md.distributions())\n"
        "bad = [d for d in dists if d.lower().startswith(('nvidia-', 'triton'))]\n"
        "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'bad': bad,\n"
        "  'gptqmodel': md.version('gptqmodel'), 'transformers': md.version('transformers'),\n"
        "  'optimum': md.version('optimum'),\n"
        "  'numpy': md.version('numpy')}))\n"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise PeerInstallError(f"the peer venv cannot import torch: {out.stderr.strip()[-300:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    if info["cuda"] is not None or info["bad"] or "+cpu" not in info["torch"]:
        raise PeerInstallError(f"the peer venv pulled a CUDA build: torch {info['torch']}, "
                               f"cuda {info['cuda']}, {info['bad']}")
    return info


def build_staged(root: Path, build, log_path: Path) -> None:
    """Build a peer venv in ``ROOT.partial`` with ``build(staging, log) -> versions`` and rename
    it to ``root`` with a ``READY`` marker holding the versions; nothing half-built stays."""
    staging = root.with_name(root.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        try:
            versions = build(staging, log)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    # venv scripts hard-code their directory; the interpreter itself is what we call, by path,
    # with `-m`, so renaming the venv directory is safe for our use.
    (staging / "READY").write_text(json.dumps(versions, indent=2, sort_keys=True) + "\n")
    if root.exists():
        shutil.rmtree(root)
    os.replace(staging, root)


def install(force: bool = False, log_path: Path | None = None) -> PeerEnv:
    """Build the GPTQModel venv (several minutes, network to PyPI); idempotent."""
    existing = ready_env()
    if existing is not None and not force:
        return existing
    root = venv_dir()

    def build(staging: Path, log) -> dict:
        _run([_base_python(), "-m", "venv", str(staging)], log)
        py = str(venv_python(staging))
        constraints = staging / "constraints.txt"
        constraints.write_text("\n".join(_torch_constraint_lines()) + "\n")
        pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-c", str(constraints)]
        if Path("/opt/wheels").is_dir():
            pip += ["--find-links", "/opt/wheels"]
        _run(pip + [f"torch=={TORCH_PIN}"], log)
        _run(pip + [f"gptqmodel=={GPTQMODEL_VERSION}", f"optimum=={OPTIMUM_VERSION}"], log)
        return _check_no_cuda(venv_python(staging))

    build_staged(root, build, log_path or root.with_name(root.name + ".install.log"))
    env = ready_env()
    assert env is not None
    return env


def peer_main(description: str, install_fn) -> int:
    """``python -m benchmarks.peers.<peer>``: install (or report) the venv."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--force", action="store_true", help="rebuild even if present")
    args = parser.parse_args()
    try:
        env = install_fn(force=args.force)
    except PeerInstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(env.describe(), indent=2))
    return 0


def main() -> int:
    return peer_main(__doc__.splitlines()[0], install)


if __name__ == "__main__":
    raise SystemExit(main())
