"""Provenance of a run: versions, threads, compute dtype, machine, git SHA, time."""

from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

import torch

from .streaming import compute_dtype


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip()
        return sha if out.returncode == 0 and len(sha) == 40 else None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(src: Path) -> dict:
    import transformers

    from ..core import __version__

    return {
        "source": str(src),
        "cpu_quant": __version__,
        "git_sha": _git_sha(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "compute_dtype": str(compute_dtype()).removeprefix("torch."),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
