"""The built-in calibration mix (``--calib mix``) and the held-out judging domains.

The mix calibrates on seven domains, each a stated share of the calibration windows
(:data:`MIX`); each domain's windows are cut evenly from its own tokenised text
(``corpus.token_windows``), so the same tokenizer gives the same token ids on every machine:

=============  =====  ===========================================================================
domain         share  sources
=============  =====  ===========================================================================
``austen``     0.10   the built-in Austen corpus' calibration split (public domain)
``english``    0.20   English fortunes by many authors; the Python 3.11 HOWTOs (technical prose)
``dialogue``   0.20   the Python FAQ's questions and answers, in the model's chat template
``code``       0.20   Python 3.11 standard-library modules
``german``     0.10   German fortunes (quotations)
``spanish``    0.10   Spanish fortunes (proverbs, quotations)
``russian``    0.10   Russian fortunes
=============  =====  ===========================================================================

Held-out domains (:data:`HELDOUT`), never in the mix and sharing no line of 40 characters or
more with it (``scripts/build_calibration_mix.py`` drops such entries; a test checks): ``italian``
(Italian fortunes: a language the mix does not hold), ``javascript`` (jQuery 3.6.1's source:
code in another language, from another project) and ``debian-faq`` (the Debian FAQ's questions
and answers in the chat template: dialogue from another source). ``cpu-quant eval --text NAME``
scores on one of them; ``austen`` is the Austen held-out split.

The sources are built from pinned Debian packages by ``scripts/build_calibration_mix.py`` and
shipped as ``sources/*.jsonl.gz`` with their sha256 in ``sources/SHA256SUMS``, checked when read.
Each source's package and licence: :data:`SOURCES`.

Dialogue records (``{"user", "assistant"}``) are rendered with the tokenizer's chat template
(``apply_chat_template``); a tokenizer without one gets ``User: ...`` / ``Assistant: ...`` lines,
with a warning.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..core.errors import CpuQuantError
from .corpus import BUILTIN, builtin_split, load_texts, token_windows

logger = logging.getLogger("cpu_quant.data")

SOURCES_DIR = Path(__file__).with_name("sources")
BUILD_SCRIPT = "scripts/build_calibration_mix.py"


@dataclass(frozen=True)
class Source:
    name: str
    package: str  # the Debian package and version it is built from
    licence: str
    what: str


SOURCES = {s.name: s for s in (
    Source("austen", "r-cran-janeaustenr 1.0.0-1", "public domain (the novels); MIT (the package)",
           "Jane Austen's six novels, the calibration split (corpus.py)"),
    Source("fortunes-en", "fortunes 1:1.99.1-7.3", "BSD (fortune-mod's data files)",
           "English quotations by many authors: wisdom, people, humorists, art, education, "
           "science, work, love, songs-poems"),
    Source("python-howto", "python3.11-doc 3.11.2-6+deb12u9", "PSF License Version 2",
           "the Python HOWTOs (descriptor, functional, logging, regex, sorting, unicode, enum, "
           "sockets, argparse), reStructuredText markup removed"),
    Source("python-faq", "python3.11-doc 3.11.2-6+deb12u9", "PSF License Version 2",
           "the Python FAQ's questions and answers"),
    Source("python-stdlib", "libpython3.11-stdlib 3.11.2-6+deb12u9", "PSF License Version 2",
           "17 modules of Python 3.11's standard library (dataclasses, shutil, difflib, ...)"),
    Source("fortunes-de", "fortunes-de 0.35-1", "GPL-2+", "German quotations and sayings"),
    Source("fortunes-es", "fortunes-es 1.36", "GPL-2+", "Spanish proverbs and quotations"),
    Source("fortunes-ru", "fortunes-ru 1.52-3.1", "GPL-2+", "Russian quotations"),
    Source("fortunes-it", "fortunes-it 1.99-4.1", "GPL-2+ (Debian's packaging of fortune-it)",
           "Italian fortunes (held out)"),
    Source("jquery", "libjs-jquery 3.6.1+dfsg+~3.5.14-1", "Expat (MIT)",
           "jQuery 3.6.1's unminified source, its first 250,000 characters (held out)"),
    Source("debian-faq", "debian-faq 11.1", "the Debian FAQ's verbatim-copying licence "
           "(Copyright 1996-2003 Software in the Public Interest)",
           "the Debian FAQ's questions and answers (held out)"),
)}


@dataclass(frozen=True)
class Domain:
    name: str
    share: float  # of the calibration windows (the mix's shares add up to 1)
    sources: tuple[str, ...]
    dialogue: bool = False  # records are user/assistant turns, rendered in the chat template


MIX = (
    Domain("austen", 0.10, ("austen",)),
    Domain("english", 0.20, ("fortunes-en", "python-howto")),
    Domain("dialogue", 0.20, ("python-faq",), dialogue=True),
    Domain("code", 0.20, ("python-stdlib",)),
    Domain("german", 0.10, ("fortunes-de",)),
    Domain("spanish", 0.10, ("fortunes-es",)),
    Domain("russian", 0.10, ("fortunes-ru",)),
)
HELDOUT = {d.name: d for d in (
    Domain("italian", 1.0, ("fortunes-it",)),
    Domain("javascript", 1.0, ("jquery",)),
    Domain("debian-faq", 1.0, ("debian-faq",), dialogue=True),
)}
MIX_NAME = "mix"
# the sources shipped under sources/ (Austen is the built-in corpus, shipped beside them)
MIX_SOURCES = tuple(s for d in MIX for s in d.sources if s != "austen")
HELDOUT_SOURCES = tuple(s for d in HELDOUT.values() for s in d.sources)


@cache
def _checksums() -> dict[str, str]:
    path = SOURCES_DIR / "SHA256SUMS"
    if not path.is_file():
        raise CpuQuantError(f"the calibration mix's sources are missing ({path}); rebuild them "
                            f"with python {BUILD_SCRIPT}")
    return {name: digest for digest, name in
            (line.split() for line in path.read_text().splitlines() if line.strip())}


def read_source(name: str) -> list[dict]:
    """A shipped source's records, its bytes checked against ``SHA256SUMS``."""
    path = SOURCES_DIR / f"{name}.jsonl.gz"
    if not path.is_file():
        raise CpuQuantError(f"calibration source {name} is missing ({path}); rebuild it with "
                            f"python {BUILD_SCRIPT}")
    raw = path.read_bytes()
    expected = _checksums().get(path.name)
    if hashlib.sha256(raw).hexdigest() != expected:
        raise CpuQuantError(f"calibration source {path} does not match its sha256 in "
                            f"SHA256SUMS; rebuild it with python {BUILD_SCRIPT}")
    return [json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines()]


def render_dialogue(records: list[dict], tokenizer) -> list[str]:
    """Each record as a one-exchange conversation in the tokenizer's chat template."""
    if getattr(tokenizer, "chat_template", None):
        return [tokenizer.apply_chat_template(
            [{"role": "user", "content": r["user"]}, {"role": "assistant", "content": r["assistant"]}],
            tokenize=False) for r in records]
    logger.warning("warning: the tokenizer has no chat template; dialogue is rendered as plain "
                   "'User:' / 'Assistant:' lines")
    return [f"User: {r['user']}\nAssistant: {r['assistant']}\n" for r in records]


def domain_texts(domain: Domain, tokenizer) -> list[str]:
    """A domain's texts, as the tokenizer will read them (dialogue in its chat template)."""
    texts: list[str] = []
    for name in domain.sources:
        if name == "austen":
            texts += builtin_split("calibration")
            continue
        records = read_source(name)
        texts += render_dialogue(records, tokenizer) if domain.dialogue else \
            [r["text"] for r in records]
    return texts


def window_counts(n_samples: int, domains: tuple[Domain, ...] = MIX) -> dict[str, int]:
    """Calibration windows per domain: ``n_samples`` split by the shares, largest remainder
    first (ties in the table's order), so the counts add up to ``n_samples``."""
    exact = [d.share * n_samples for d in domains]
    counts = [int(x) for x in exact]
    order = sorted(range(len(domains)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n_samples - sum(counts)]:
        counts[i] += 1
    return {d.name: c for d, c in zip(domains, counts, strict=True)}


def check_mix() -> None:
    """Every source of the mix is present and intact: before a model is read."""
    for name in MIX_SOURCES:
        read_source(name)


def mix_windows(tokenizer, n_samples: int, seqlen: int) -> list[list[int]]:
    """The mix's calibration windows, domain after domain in :data:`MIX`'s order."""
    windows: list[list[int]] = []
    for domain in MIX:
        count = window_counts(n_samples)[domain.name]
        if count:
            windows += token_windows(tokenizer, domain_texts(domain, tokenizer), count, seqlen,
                                     cache=True)
    return windows


@dataclass(frozen=True)
class Calibration:
    """What ``--calib`` names, read and checked before any model is: the mix, or plain texts
    (the Austen corpus, a user's files)."""

    name: str
    texts: tuple[str, ...] | None  # None: the mix, whose dialogue needs the tokenizer

    def windows(self, tokenizer, n_samples: int, seqlen: int) -> list[list[int]]:
        if self.texts is None:
            return mix_windows(tokenizer, n_samples, seqlen)
        return token_windows(tokenizer, list(self.texts), n_samples, seqlen,
                             cache=self.name == BUILTIN)


DEFAULT_CALIBRATION = "mix"  # measured: docs/gptq.md#calibration-text


def describe_calibration(calib: str | None) -> str:
    """``--calib`` as the model card names it."""
    calib = DEFAULT_CALIBRATION if calib is None else calib
    return {"austen": "austen (built-in: the first half of six Austen novels)",
            MIX_NAME: "mix (built-in: Austen, English prose, Python FAQ dialogue in the chat "
                      "template, Python code, German, Spanish and Russian)"}.get(calib, calib)


def load_calibration(calib: str | Path | None) -> Calibration:
    """``--calib``: None is :data:`DEFAULT_CALIBRATION`; ``mix``, ``austen`` or a path."""
    calib = DEFAULT_CALIBRATION if calib is None else str(calib)
    if calib == MIX_NAME:
        check_mix()
        return Calibration(MIX_NAME, None)
    return Calibration(calib, tuple(load_texts(calib, "calibration")))


def builtin_text(text: str | None) -> bool:
    """Whether ``eval --text`` names a built-in text (its token ids may be cached)."""
    return text is None or text == BUILTIN or text in HELDOUT


def heldout_texts(text: str | None, tokenizer) -> list[str]:
    """Held-out text for ``eval --text``: None or ``austen`` is the Austen held-out split, a
    name in :data:`HELDOUT` that domain (rendered for ``tokenizer``), anything else a file."""
    if text is None or text == "austen":
        return builtin_split("heldout")
    if text in HELDOUT:
        return domain_texts(HELDOUT[text], tokenizer)
    return load_texts(text, "heldout")


def check_heldout(text: str | None) -> None:
    """A bad ``--text`` before any model is read."""
    if text in HELDOUT:
        for name in HELDOUT[text].sources:
            read_source(name)
    elif text is not None and text != "austen":
        load_texts(text, "heldout")
