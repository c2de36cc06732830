"""Writing artifacts atomically: a staging directory renamed into place only when complete.

``StagedOutput(dst)`` creates ``.<name>.partial`` beside ``dst`` and takes the lock file
``.<name>.lock`` (created with ``O_EXCL``; it holds the owner's pid, and a lock whose pid is
gone is taken over). Shards are written into the staging directory; ``commit()`` renames it to
``dst``. On an error the staging directory is removed and ``dst`` is untouched; after Ctrl-C
in a run that resumes (``keep_on_interrupt``), or when the run asks (``keep_on_exit``), it is
kept for ``--resume``. It never holds a
``config.json`` before the commit, so nothing half-written looks like a finished artifact.
``OSError`` from a full disk or an unwritable directory becomes a one-line ``CpuQuantError``.

:func:`check_destination` is the one guard for every command's output path (``gptq``,
``tinygemm``, ``convert``, ``export-phone``, ``eval --output-json`` and ``--save-reference``):
the output may not be a source, an ancestor of one, or inside one (symlinks resolved), nor
locked by another live run, and ``--overwrite`` replaces only what cpu-quant itself wrote
(:func:`is_replaceable_artifact`) or an empty directory. ``commit()``
swaps the new directory with the old one in one ``renameat2(RENAME_EXCHANGE)`` and removes
the old one from the staging name, so nothing new is ever left beside ``dst``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from ..errors import CpuQuantError
from .safetensors_writer import write_safetensors

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
    # a vision-language model's processor (its image processor's settings)
    "processor_config.json", "preprocessor_config.json",
)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_path(dst: Path) -> Path:
    """The lock file of an output: ``.<name>.lock`` beside it."""
    return dst.parent / f".{dst.name}.lock"


def live_lock_owner(lock: Path) -> int | None:
    """The pid of the live process (not this one) holding ``lock``, or None (no lock, a stale
    one, or this process's own)."""
    try:
        pid = int(lock.read_text().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if pid and pid != os.getpid() and _pid_alive(pid) else None


def describe_os_error(exc: OSError, where: Path) -> str:
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device while writing {where}"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {where}: {exc.strerror}"
    return f"cannot write {where}: {exc.strerror or exc}"


# what marks a directory as written by cpu-quant: a format's config, a quantization report,
# an export-phone report
ARTIFACT_MARKERS = ("quantization_report.json", "export_report.json")


def _has_quantization_config(config: Path) -> bool:
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested too deeply
        return False
    return isinstance(data, dict) and isinstance(data.get("quantization_config"), dict)


def is_replaceable_artifact(directory: Path, _depth: int = 0) -> bool:
    """Is ``directory`` something ``--overwrite`` may replace: empty, a cpu-quant artifact
    (a ``config.json`` with ``quantization_config``, a ``quantization_report.json``, an
    ``export_report.json``), or a multi-format output whose every entry is such an artifact?"""
    entries = list(directory.iterdir())
    if not entries:
        return True
    if any((directory / m).is_file() for m in ARTIFACT_MARKERS):
        return True
    # a file format's artifact names its report after its file (``X-Q4_0.quantization_report.json``)
    if any(e.is_file() and e.name.endswith(".quantization_report.json") for e in entries):
        return True
    if _has_quantization_config(directory / "config.json"):
        return True
    return _depth == 0 and all(e.is_dir() and not e.is_symlink()
                               and is_replaceable_artifact(e, 1) for e in entries)


def _resolved(path: Path) -> Path | None:
    """``path`` with its links resolved, or None for a symlink loop."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a loop, before Python 3.13
        return None


def check_destination(dst: str | Path, sources: Iterable[str | Path], overwrite: bool,
                      *, directory: bool = True) -> None:
    """Refuse an output path that would destroy or write into a source, or replace something
    cpu-quant did not write. ``directory=False`` for an output file (``eval --json``)."""
    dst_path = Path(dst)
    real = _resolved(dst_path)
    if real is None:
        raise CpuQuantError(f"output {dst} is a symlink loop; choose another output path")
    for src in sources:
        src_real = _resolved(Path(src))
        if src_real is None:  # it cannot be read either: reading it says so, in one line
            continue
        if real == src_real:
            raise CpuQuantError(f"output {dst} is the source {src}; choose another output path")
        if real in src_real.parents:
            raise CpuQuantError(f"output {dst} contains the source {src}; choose another "
                                "output path")
        if src_real in real.parents:
            raise CpuQuantError(f"output {dst} is inside the source {src}; choose another "
                                "output path")
    if not real.parent.is_dir():
        raise CpuQuantError(f"output parent directory {dst_path.parent} does not exist")
    owner = live_lock_owner(lock_path(dst_path.absolute())) if directory else None
    if owner is not None:  # before any work, not when the staging directory is made
        raise CpuQuantError(f"another cpu-quant run (pid {owner}) is writing {dst}; remove "
                            f"{lock_path(dst_path.absolute())} if it is not")
    if not (dst_path.exists() or dst_path.is_symlink()):
        return
    if not directory:
        if dst_path.is_dir():
            raise CpuQuantError(f"output {dst} is a directory; give a file name")
        return
    if not overwrite:
        raise CpuQuantError(f"output {dst} already exists (use --overwrite to replace it)")
    if dst_path.is_symlink() or not dst_path.is_dir():
        raise CpuQuantError(f"output {dst} is not a directory; --overwrite replaces only a "
                            "cpu-quant artifact or an empty directory")
    if not is_replaceable_artifact(dst_path):
        raise CpuQuantError(f"output {dst} is not a cpu-quant artifact (no config.json with "
                            "quantization_config, no quantization_report.json or "
                            "export_report.json) and not empty; --overwrite replaces only those")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the system call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # old kernel, or a filesystem without the flag
        return False
    raise OSError(err, os.strerror(err), str(b))


class StagedOutput:
    """``keep_on_interrupt``: a Ctrl-C that reaches ``__exit__`` keeps the staging directory
    (a run that can be resumed from it); otherwise it is removed like on any error."""

    def __init__(self, dst: str | Path, overwrite: bool = False, resume: bool = False,
                 sources: Iterable[str | Path] = (), keep_on_interrupt: bool = False) -> None:
        self.dst = Path(dst).absolute()
        self.overwrite = overwrite
        self.resume = resume
        self.sources = list(sources)
        self.keep_on_interrupt = keep_on_interrupt
        # set by a run that stopped at a safe point: keep the staging directory for --resume
        self.keep_on_exit = False
        self.staging = self.dst.parent / f".{self.dst.name}.partial"
        self.lock = lock_path(self.dst)
        self._locked = False

    def __enter__(self) -> StagedOutput:
        check_destination(self.dst, self.sources, self.overwrite)
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
                pid = live_lock_owner(self.lock)
                if pid is not None:
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
        if exc_type is KeyboardInterrupt and self.keep_on_interrupt:
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
                # checked again here: the run may have taken hours since __enter__
                check_destination(self.dst, self.sources, self.overwrite)
                if exchange_paths(self.staging, self.dst):
                    shutil.rmtree(self.staging, ignore_errors=True)  # now the old artifact
                else:
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

def write_text_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or is as it was: written beside it, then renamed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: object) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


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
