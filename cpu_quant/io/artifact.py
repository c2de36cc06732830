"""Writing artifacts atomically: a staging directory renamed into place only when complete.

``StagedOutput(dst)`` creates ``.<name>.partial`` beside ``dst`` and takes the lock file
``.<name>.lock`` (created with ``O_EXCL``; it holds the owner's pid, and a lock whose pid is
gone is taken over). Shards are written into the staging directory; ``commit()`` renames it to
``dst``. On an error the staging directory is removed and ``dst`` is untouched; after Ctrl-C,
or when the run asks (``keep_on_exit``), it is kept for ``--resume``. It never holds a
``config.json`` before the commit, so nothing half-written looks like a finished artifact.
``OSError`` from a full disk or an unwritable directory becomes a one-line ``CpuQuantError``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch

from ..errors import CpuQuantError
from .safetensors_writer import write_safetensors

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_os_error(exc: OSError, where: Path) -> str:
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device while writing {where}"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {where}: {exc.strerror}"
    return f"cannot write {where}: {exc.strerror or exc}"


class StagedOutput:
    def __init__(self, dst: str | Path, overwrite: bool = False, resume: bool = False) -> None:
        self.dst = Path(dst).absolute()
        self.overwrite = overwrite
        self.resume = resume
        # set by a run that stopped at a safe point: keep the staging directory for --resume
        self.keep_on_exit = False
        self.staging = self.dst.parent / f".{self.dst.name}.partial"
        self.lock = self.dst.parent / f".{self.dst.name}.lock"
        self._locked = False

    def __enter__(self) -> StagedOutput:
        if self.dst.exists() and not self.overwrite:
            raise CpuQuantError(f"output {self.dst} already exists (use --overwrite to replace it)")
        parent = self.dst.parent
        if not parent.is_dir():
            raise CpuQuantError(f"output parent directory {parent} does not exist")
        self._take_lock()
        try:
            if self.resume:
                if not self.staging.is_dir():
                    self._release_lock()
                    raise CpuQuantError(f"nothing to resume: no interrupted run at {self.staging}")
                # the interrupted run's files are the user's progress: a refused or failed resume
                # must leave them for the next attempt
                self.keep_on_exit = True
            else:
                if self.staging.exists():  # a crashed run's leftovers, not asked to resume
                    shutil.rmtree(self.staging)
                self.staging.mkdir()
        except OSError as exc:
            self._release_lock()
            raise CpuQuantError(describe_os_error(exc, self.staging)) from None
        return self

    def _take_lock(self) -> None:
        for _ in range(2):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.lock.read_text().strip() or 0)
                except (OSError, ValueError):
                    pid = 0
                if pid and _pid_alive(pid):
                    raise CpuQuantError(f"another cpu-quant run (pid {pid}) is writing {self.dst}; "
                                        f"remove {self.lock} if it is not") from None
                self.lock.unlink(missing_ok=True)
                continue
            except OSError as exc:
                raise CpuQuantError(describe_os_error(exc, self.lock)) from None
            with os.fdopen(fd, "w") as fh:
                fh.write(str(os.getpid()))
            self._locked = True
            return
        raise CpuQuantError(f"could not take the lock {self.lock}")

    def _release_lock(self) -> None:
        if self._locked:
            self.lock.unlink(missing_ok=True)
            self._locked = False

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is KeyboardInterrupt:
            self.keep_on_exit = True  # state is consistent up to the last completed layer
        try:
            if exc_type is not None and not self.keep_on_exit:
                shutil.rmtree(self.staging, ignore_errors=True)
        finally:
            self._release_lock()
        if isinstance(exc, OSError):
            raise CpuQuantError(describe_os_error(exc, self.dst)) from None
        return False

    # -- writing -------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        return self.staging / name

    def write_json(self, name: str, obj: object) -> None:
        write_json_atomic(self.path(name), obj)

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        write_safetensors(self.path(name), tensors)

    def copy_tokenizer_files(self, src: Path) -> list[str]:
        return copy_tokenizer_files(src, self.staging)

    def commit(self) -> Path:
        try:
            if self.dst.exists():
                trash = self.dst.parent / f".{self.dst.name}.old"
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(self.dst, trash)
                os.replace(self.staging, self.dst)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(self.staging, self.dst)
        except OSError as exc:
            raise CpuQuantError(describe_os_error(exc, self.dst)) from None
        return self.dst


def write_shard_index(out: StagedOutput, shards: dict[str, list[str]], total_size: int) -> None:
    write_shard_index_at(out.staging, shards, total_size)

def write_json_atomic(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def copy_tokenizer_files(src: Path, dst_dir: Path) -> list[str]:
    """Copy the source's tokenizer files (those inside the checkpoint directory) to ``dst_dir``."""
    copied = []
    for fname in TOKENIZER_FILES:
        f = src / fname
        if f.is_file():
            try:
                f.resolve().relative_to(src.resolve())
            except ValueError:
                raise CpuQuantError(f"{f} points outside the checkpoint directory") from None
            shutil.copyfile(f, dst_dir / fname)
            copied.append(fname)
    return copied


def write_shard_index_at(directory: Path, shards: dict[str, list[str]], total_size: int) -> None:
    """``model.safetensors.index.json`` in ``directory``, mapping every tensor to its shard."""
    weight_map = {name: shard for shard, names in shards.items() for name in names}
    write_json_atomic(directory / "model.safetensors.index.json",
                      {"metadata": {"total_size": total_size},
                       "weight_map": dict(sorted(weight_map.items()))})
