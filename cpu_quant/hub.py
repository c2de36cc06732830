"""A checkpoint named by its Hugging Face Hub id, found in the local cache only (never downloaded).

``resolve_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")`` returns the cached snapshot
directory that ``refs/main`` (or the given ``@revision``) points to, as
``huggingface_hub.snapshot_download(..., local_files_only=True)`` does with ``HF_HUB_OFFLINE=1``.
The cache is ``HF_HUB_CACHE`` (default ``$HF_HOME/hub``, ``~/.cache/huggingface/hub``), read
when called. A local path always wins over a Hub id of the same spelling.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .core.errors import CpuQuantError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "/", "~"))


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home) / "hub"


def resolve_hub_id(repo_id: str, label: str = "SRC") -> Path:
    """The cached snapshot of ``repo_id`` (``org/name`` or ``org/name@revision``)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    name, _, revision = repo_id.partition("@")
    cache = hub_cache_dir()
    try:
        path = snapshot_download(name, revision=revision or None, cache_dir=cache,
                                 local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        raise CpuQuantError(
            f"{label} {repo_id} is neither a local directory nor in the Hugging Face cache "
            f"({cache}); cpu-quant does not download: fetch it first with "
            f"`hf download {name}{f' --revision {revision}' if revision else ''}` "
            "(or `huggingface-cli download`), or give a local directory") from None
    except HFValidationError as exc:
        raise CpuQuantError(f"{label} {repo_id} is not a valid Hub id: {exc}") from None
    return Path(path)


def repo_id_of(path: Path) -> str | None:
    """``org/name`` for a Hub cache snapshot directory, else None."""
    path = Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    return None


def checkpoint_name(path: Path) -> str:
    """The model's name: the repository's for a Hub cache snapshot
    (``models--org--name/snapshots/<rev>`` gives ``name``), else the directory's."""
    path = Path(path)
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.split("--")[-1]
    return path.name


def resolve_checkpoint(name: str, label: str = "SRC") -> Path:
    """A local directory as it is; otherwise a Hub id resolved from the local cache."""
    path = Path(name).expanduser()
    if path.exists() or not looks_like_hub_id(name):
        return path
    return resolve_hub_id(name, label)
