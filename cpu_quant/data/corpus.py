"""Calibration and evaluation text.

Built-in corpus: the six Jane Austen novels (public domain), built by
``scripts/build_corpus.py`` from Debian's ``r-cran-janeaustenr`` and shipped as
``cpu_quant/data/austen/*.txt.gz``. Each novel is split at a paragraph boundary near
``CALIBRATION_FRACTION`` of its length: the first part is the **calibration** split, the rest the
**held-out** split. Fidelity is only ever measured on the held-out split.

The built-in calibration mix (``--calib mix``) and the held-out judging domains
(``eval --text italian|javascript|debian-faq``) are in ``mix.py``.

User calibration (``--calib``): a ``.txt`` file, a ``.jsonl`` file with a ``text`` field per
line, or a directory holding such files (read in sorted order).

Samples are ``seqlen``-token windows cut from the tokenised text at evenly spaced offsets, so
the same inputs give the same samples on every machine.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path

from ..core.errors import CpuQuantError

logger = logging.getLogger("cpu_quant.data")

AUSTEN_DIR = Path(__file__).with_name("austen")
NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
          "sensesensibility")
CALIBRATION_FRACTION = 0.5
BUILTIN = "austen"


def _novel(name: str) -> str:
    with gzip.open(AUSTEN_DIR / f"{name}.txt.gz", "rt", encoding="utf-8") as fh:
        return fh.read()


def _split(text: str) -> tuple[str, str]:
    cut = text.find("\n\n", int(len(text) * CALIBRATION_FRACTION))
    cut = len(text) if cut < 0 else cut
    return text[:cut], text[cut:].lstrip("\n")


def builtin_split(split: str) -> list[str]:
    """The built-in corpus' ``calibration`` or ``heldout`` split, one string per novel."""
    if split not in ("calibration", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    index = 0 if split == "calibration" else 1
    return [_split(_novel(name))[index] for name in NOVELS]


def _text_problem(raw: bytes) -> str | None:
    """Why bytes read as a .txt calibration file are probably not UTF-8 text, or None."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or (
            len(raw) >= 16 and raw[1::2].count(0) > 0.4 * (len(raw) // 2)):
        return "looks like UTF-16 text (convert it to UTF-8)"
    bad = raw.count(0) + raw.decode("utf-8", errors="replace").count("\ufffd")
    if raw and bad > 0.01 * len(raw):
        return f"looks binary ({bad} NUL or non-UTF-8 bytes of {len(raw)})"
    return None


def _read_user_file(path: Path) -> list[str]:
    if path.suffix == ".txt":
        raw = path.read_bytes()
        why = _text_problem(raw)
        if why:
            logger.warning(f"warning: calibration file {path} {why}; using it as decoded")
        return [raw.decode("utf-8", errors="replace")]
    if path.suffix == ".jsonl":
        texts = []
        try:
            content = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise CpuQuantError(f"{path}: not UTF-8 text (byte {exc.start}); .jsonl files must "
                                "be UTF-8") from None
        for lineno, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CpuQuantError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CpuQuantError(f"{path}:{lineno}: each line needs a string field 'text'")
            texts.append(record["text"])
        return texts
    raise CpuQuantError(f"{path}: calibration files must be .txt or .jsonl")


def load_texts(calib: str | Path | None, split: str = "calibration") -> list[str]:
    """Texts for ``--calib``: None or ``austen`` gives the built-in split."""
    if calib is None or str(calib) == BUILTIN:
        return builtin_split(split)
    path = Path(calib)
    if not path.exists():
        raise CpuQuantError(f"calibration path {path} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise CpuQuantError(f"calibration directory {path} holds no .txt or .jsonl files")
        return [t for f in files for t in _read_user_file(f)]
    if not path.is_file():  # a FIFO or a device would block the read, or never end
        raise CpuQuantError(f"calibration path {path} is not a regular file or a directory")
    return _read_user_file(path)


def _tokenize(tokenizer, texts: list[str]) -> list[int]:
    ids: list[int] = []
    # one text at a time: a batched call is 0.45 s faster on the built-in split, but the fast
    # tokenizer's parallel workers hold their memory afterwards, and the quantizer's peak
    # RssAnon rose from 808 to 1000 MiB (one run each, docs/results.md)
    for text in texts:
        if text.strip():
            ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


TOKEN_CACHE = "tokens"  # under core.cache.cache_dir()


def _token_cache_file(tokenizer, texts: list[str]) -> Path | None:
    """Where the token ids of ``texts`` under ``tokenizer`` are kept: named by the digest of
    the tokenizer's whole definition (a fast tokenizer's serialized pipeline, vocabulary and
    special tokens included), the tokenizers library's version and the texts; None for a
    tokenizer without such a definition."""
    import hashlib

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    import tokenizers

    from ..core.cache import cache_dir

    h = hashlib.sha256(f"{tokenizers.__version__}\0{len(texts)}\0".encode())
    h.update(backend.to_str().encode())
    for text in texts:
        h.update(b"\0" + text.encode())
    return cache_dir() / TOKEN_CACHE / f"{h.hexdigest()}.npy"


def token_ids(tokenizer, texts: list[str], cache: bool = False) -> list[int]:
    """The token ids of ``texts``, one text after another, without special tokens.

    ``cache``: for the built-in texts (the same megabytes tokenized by every run, seconds
    each time): the ids are kept in the cache directory, under the digest of the tokenizer's
    definition and the texts, and read back instead of tokenizing again (the same ids; a file
    that cannot be read is tokenized again and rewritten)."""
    import numpy as np

    path = _token_cache_file(tokenizer, texts) if cache else None
    if path is not None and path.is_file():
        try:
            return np.load(path, allow_pickle=False).tolist()
        except (OSError, ValueError, EOFError):
            pass
    ids = _tokenize(tokenizer, texts)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as fh:
                np.save(fh, np.asarray(ids, dtype=np.int64))
            os.replace(tmp, path)
        except OSError:  # a read-only or full cache: the ids are right, only not kept
            pass
    return ids


def token_windows(tokenizer, texts: list[str], n_samples: int, seqlen: int,
                  cache: bool = False) -> list[list[int]]:
    """``n_samples`` windows of exactly ``seqlen`` tokens, evenly spaced over the texts
    (``cache``: :func:`token_ids`' for the built-in texts).

    Raises a one-line error when the text is too short to give that many distinct tokens.
    """
    if n_samples < 1 or seqlen < 2:
        raise CpuQuantError("--samples must be >= 1 and --seqlen >= 2")
    ids = token_ids(tokenizer, texts, cache)
    need = seqlen
    if len(ids) < need:
        raise CpuQuantError(
            f"calibration text is too short: {len(ids)} tokens, need at least {need} "
            f"(--seqlen {seqlen})")
    span = len(ids) - seqlen
    if n_samples == 1:
        starts = [0]
    else:
        starts = [round(i * span / (n_samples - 1)) for i in range(n_samples)]
    windows = [ids[s:s + seqlen] for s in starts]
    distinct = len({tuple(w) for w in windows})
    if distinct < len(windows):
        logger.warning(f"warning: {len(windows) - distinct} of {len(windows)} calibration windows "
                       f"repeat another window's tokens ({len(ids)} tokens of text for --samples "
                       f"{n_samples} x --seqlen {seqlen}); give more text or fewer samples")
    return windows
