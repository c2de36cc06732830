"""Build the texts of the calibration mix and of the held-out judging domains from Debian packages.

Usage: ``python scripts/build_calibration_mix.py [--deb-dir DIR] [--out cpu_quant/data/sources]``

Every source is one Debian package at a pinned version whose ``.deb`` must have the sha256 in
:data:`PACKAGES` (``apt-get download NAME=VERSION`` in a temporary directory, or the files
already in ``--deb-dir``). A package that cannot be had, or whose bytes differ, stops the build
with a one-line error. The outputs are written with gzip's mtime 0, so a rebuild gives the same
bytes; ``cpu_quant/data/sources/SHA256SUMS`` lists them (``cpu_quant.data.mix`` checks a source
against it when it reads one).

Each output is a list of records, one JSON object per line (``.jsonl.gz``): ``{"text": ...}``
for prose and code, ``{"user": ..., "assistant": ...}`` for dialogue (rendered in the model's
chat template at load time). Licences: :data:`cpu_quant.data.mix.SOURCES`.

Held-out sources must not share text with the calibration sources: an entry of a held-out
source that holds a line of 40 or more characters found in any calibration source is dropped
here (fortunes travel between languages' collections), and a unit test checks the result.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cpu_quant.data.mix import HELDOUT_SOURCES, MIX_SOURCES, SOURCES  # noqa: E402

# package -> (version, sha256 of the .deb, its file name)
PACKAGES = {
    "fortunes": ("1:1.99.1-7.3",
                 "41d0551dc0ff52f875a2ecef7c39da2f672ab468c37e170119f7e0245a9d63c5"),
    "fortunes-de": ("0.35-1", "03fe7a7912935bd3d4e02e38d79ef32a289097f8718d4488c409595abce067a0"),
    "fortunes-es": ("1.36", "54636edc1a4384093b68d1666c7e702ce42d1fcc8b5ab402d9646c328dcca899"),
    "fortunes-ru": ("1.52-3.1",
                    "2dc76af9c0e02e2926d36f88dcb685bb171fab8677e553a6def41efe8a551cc6"),
    "fortunes-it": ("1.99-4.1",
                    "675df6ecb00c3b67d06b39ab223ff17f1ef1d0ec82a7e40f989356a2eb61a97e"),
    "libpython3.11-stdlib": ("3.11.2-6+deb12u9",
                             "10f13e000ee757f5f2d2d3569f9e30546214a0c850acd78695feae373bfa3e53"),
    "python3.11-doc": ("3.11.2-6+deb12u9",
                       "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be"),
    "debian-faq": ("11.1", "427426e0cfa6888622fc1d72631071cb4b5a1f86ccde722e7820bcef284de5d0"),
    "libjs-jquery": ("3.6.1+dfsg+~3.5.14-1",
                     "a58c9ff6afe96c769cb6535754c909410760e4efa1e1540236194e489adcfb25"),
}
CAP = 250_000  # characters per source: more than the largest calibration or evaluation needs
OVERLAP_CHARS = 40  # a shared line this long makes a held-out entry overlap the calibration
FORTUNES = "usr/share/games/fortunes"
PYDOC = "usr/share/doc/python3.11/html/_sources"


class BuildError(Exception):
    """A source that cannot be had: one line for the user."""


def deb_name(package: str, version: str) -> str:
    return f"{package}_{version.replace(':', '%3a')}_"


def fetch_deb(package: str, workdir: Path, deb_dir: Path | None) -> Path:
    """The package's ``.deb`` at its pinned version, its sha256 checked."""
    if package not in PACKAGES:
        raise BuildError(f"{package}: not a source of the calibration mix (PACKAGES)")
    version, sha = PACKAGES[package]
    if deb_dir is not None:
        found = sorted(deb_dir.glob(deb_name(package, version) + "*.deb"))
        if not found:
            raise BuildError(f"{package} {version}: no {deb_name(package, version)}*.deb in "
                             f"{deb_dir}")
        deb = found[0]
    else:
        proc = subprocess.run(["apt-get", "download", f"{package}={version}"], cwd=workdir,
                              capture_output=True, text=True)
        found = sorted(workdir.glob(deb_name(package, version) + "*.deb"))
        if proc.returncode != 0 or not found:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise BuildError(f"could not download the Debian package {package}={version} "
                             f"(apt-get download: {last})")
        deb = found[0]
    got = hashlib.sha256(deb.read_bytes()).hexdigest()
    if got != sha:
        raise BuildError(f"{deb.name}: sha256 {got}, expected {sha}")
    return deb


def unpack(deb: Path, into: Path) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(into)], check=True)
    return into


# -- readers: a package's unpacked tree -> records --------------------------------------------
def fortunes(root: Path, files: list[str]) -> list[dict]:
    """Fortune files: entries separated by lines holding only ``%``."""
    out = []
    for name in files:
        raw = (root / name).read_text(encoding="utf-8", errors="replace")
        for entry in re.split(r"^%\s*$", raw, flags=re.M):
            entry = "\n".join(line.rstrip() for line in entry.strip("\n").splitlines())
            if entry.strip():
                out.append({"text": entry})
    return out


def python_files(root: Path, files: list[str]) -> list[dict]:
    return [{"text": (root / f).read_text(encoding="utf-8")} for f in files]


RST_ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
RST_LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")


def rst_plain(text: str) -> str:
    """reStructuredText to plain text: roles and links to their words, directives dropped."""
    text = RST_ROLE.sub(r"\1", text)
    text = RST_LINK.sub(r"\1", text)
    text = text.replace("``", "`")
    lines = [ln for ln in text.splitlines() if not re.match(r"\s*\.\. [\w-]+::", ln)
             and not re.match(r"\s*:[\w-]+:\s", ln) and not re.match(r"^\s*\.\. _", ln)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


HEADING = re.compile(r"^(?P<title>[^\n]+)\n(?P<bar>[=\-^~*+#]{3,})\s*$", re.M)


def rst_sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every section of an rst file."""
    marks = list(HEADING.finditer(text))
    out = []
    for i, m in enumerate(marks):
        if len(m.group("bar").strip()) < len(m.group("title").strip()):
            continue
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        out.append((m.group("title").strip(), text[m.end():end]))
    return out


def python_howto(root: Path, files: list[str]) -> list[dict]:
    out = []
    for f in files:
        for title, body in rst_sections((root / f).read_text(encoding="utf-8")):
            body = rst_plain(body)
            if len(body) > 200:
                out.append({"text": f"{title}\n\n{body}"})
    return out


def python_faq(root: Path, files: list[str]) -> list[dict]:
    """The Python FAQ's questions (headings that end in ``?``) and their answers."""
    out = []
    for f in files:
        for title, body in rst_sections((root / f).read_text(encoding="utf-8")):
            answer = rst_plain(body)
            if title.endswith("?") and len(answer) > 80:
                out.append({"user": title, "assistant": answer})
    return out


FAQ_QUESTION = re.compile(r"^(\d+(?:\.\d+)+)\. (.+?)\n\s*\n", re.M | re.S)


def debian_faq(root: Path, files: list[str]) -> list[dict]:
    """The Debian FAQ's numbered questions and their answers (the body's headings start in the
    first column; the table of contents' entries are indented)."""
    text = gzip.decompress((root / files[0]).read_bytes()).decode("utf-8").replace("\u00a0", " ")
    heads = list(FAQ_QUESTION.finditer(text))
    out = []
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        answer = re.sub(r"^\d+\. .*$", "", text[m.end():end], flags=re.M)  # chapter titles
        answer = re.sub(r"\n{3,}", "\n\n", "\n".join(ln.strip() for ln in answer.splitlines()))
        question = " ".join(m.group(2).split())
        if question.endswith("?") and len(answer.strip()) > 80:
            out.append({"user": question, "assistant": answer.strip()})
    return out


READERS: dict[str, Callable[[Path, list[str]], list[dict]]] = {
    "fortunes": fortunes, "python": python_files, "howto": python_howto, "faq": python_faq,
    "debian-faq": debian_faq,
}

# source -> (package, reader, files inside the package)
EXTRACT = {
    "fortunes-en": ("fortunes", "fortunes", [f"{FORTUNES}/{n}" for n in (
        "wisdom", "people", "humorists", "art", "education", "science", "work", "love",
        "songs-poems")]),
    "python-howto": ("python3.11-doc", "howto", [f"{PYDOC}/howto/{n}.rst.txt" for n in (
        "descriptor", "functional", "logging", "regex", "sorting", "unicode", "enum",
        "sockets", "argparse")]),
    "python-faq": ("python3.11-doc", "faq", [f"{PYDOC}/faq/{n}.rst.txt" for n in (
        "general", "programming", "design", "library", "extending", "windows", "gui",
        "installed")]),
    "python-stdlib": ("libpython3.11-stdlib", "python", [f"usr/lib/python3.11/{n}.py" for n in (
        "dataclasses", "shutil", "fractions", "statistics", "difflib", "json/decoder",
        "json/encoder", "fileinput", "graphlib", "gzip", "pprint", "queue", "sched", "shlex",
        "cmd", "plistlib", "netrc")]),
    "fortunes-de": ("fortunes-de", "fortunes", [f"{FORTUNES}/de/{n}" for n in (
        "zitate", "sprueche", "wusstensie", "mathematiker", "regeln", "kinderzitate",
        "lieberals", "letzteworte")]),
    "fortunes-es": ("fortunes-es", "fortunes", [f"{FORTUNES}/es/{n}.fortunes" for n in (
        "refranes", "sabiduria", "sentimientos", "arte", "humanos", "vida", "poder",
        "ciencia", "libertad")]),
    "fortunes-ru": ("fortunes-ru", "fortunes", [f"{FORTUNES}/ru/{n}" for n in (
        "education", "book", "friendship", "wealth", "freewill", "relations", "murphy")]),
    "fortunes-it": ("fortunes-it", "fortunes", [f"{FORTUNES}/it/{n}" for n in (
        "italia", "leggi", "definizioni", "formiche", "norm", "zuse")]),
    "jquery": ("libjs-jquery", "python", ["usr/share/javascript/jquery/jquery.js"]),
    "debian-faq": ("debian-faq", "debian-faq", ["usr/share/doc/debian/FAQ/debian-faq.en.txt.gz"]),
}


def capped(records: list[dict], cap: int = CAP) -> list[dict]:
    """Records spread evenly over the source until ``cap`` characters (a long text: its first
    ``cap`` characters, cut at a line end)."""
    size = sum(len("".join(r.values())) for r in records)
    if len(records) == 1 and size > cap:
        text = records[0]["text"]
        return [{"text": text[: text.rfind("\n", 0, cap) + 1]}]
    if size <= cap:
        return records
    step = size / cap  # keep about one record in ``step``, evenly spaced
    kept, total, i = [], 0, 0.0
    while int(i) < len(records) and total < cap:
        r = records[int(i)]
        kept.append(r)
        total += len("".join(r.values()))
        i += step
    return kept


def long_lines(records: list[dict]) -> set[str]:
    return {ln.strip() for r in records for v in r.values() for ln in v.splitlines()
            if len(ln.strip()) >= OVERLAP_CHARS}


def without_overlap(records: list[dict], calibration_lines: set[str]) -> list[dict]:
    return [r for r in records if not (long_lines([r]) & calibration_lines)]


def write_records(path: Path, records: list[dict]) -> str:
    data = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                filename="") as fh:
        fh.write(data.encode("utf-8"))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, deb_dir: Path | None) -> dict[str, str]:
    records: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        trees: dict[str, Path] = {}
        for name in [*MIX_SOURCES, *HELDOUT_SOURCES]:
            package, reader, files = EXTRACT[name]
            if package not in trees:
                trees[package] = unpack(fetch_deb(package, tmpdir, deb_dir), tmpdir / package)
            records[name] = capped(READERS[reader](trees[package], files))
    calibration = set().union(*(long_lines(records[n]) for n in MIX_SOURCES))
    from cpu_quant.data.corpus import builtin_split

    calibration |= long_lines([{"text": t} for t in builtin_split("calibration")])
    for name in HELDOUT_SOURCES:
        records[name] = without_overlap(records[name], calibration)
    out.mkdir(parents=True, exist_ok=True)
    sums = {}
    for name, recs in records.items():
        sums[f"{name}.jsonl.gz"] = write_records(out / f"{name}.jsonl.gz", recs)
        print(f"{name}: {len(recs)} records, {sum(len(''.join(r.values())) for r in recs):,} "
              f"characters ({SOURCES[name].licence})", file=sys.stderr)
    (out / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sorted(sums.items())))
    return sums


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deb-dir", type=Path, help="directory holding the pinned .deb files")
    parser.add_argument("--out", type=Path, default=ROOT / "cpu_quant" / "data" / "sources")
    args = parser.parse_args(argv)
    try:
        build(args.out, args.deb_dir)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
