"""Build the built-in calibration/evaluation corpus from Debian's ``r-cran-janeaustenr``.

Usage: ``python scripts/build_corpus.py [--deb PATH] [--out cpu_quant/data/austen]``

Without ``--deb`` the script runs ``apt-get download r-cran-janeaustenr`` in a temporary
directory. The package stores the six novels as character vectors (one element per printed
line) in an R lazy-load database: ``data/Rdata.rdx`` is a gzip-compressed serialized index
(``variables``: name -> (offset, length) into ``Rdata.rdb``), and each ``.rdb`` entry is a
4-byte big-endian uncompressed length followed by zlib data holding an R XDR serialization.

Each novel is written as ``<name>.txt.gz``: paragraphs joined from the line vectors, blank-line
separated. The split into calibration and held-out text is made at load time by
``cpu_quant.data.corpus`` (the first part of each novel calibrates, the rest is held out).
"""

from __future__ import annotations

import argparse
import gzip
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

NOVELS = {
    "emma": "Emma",
    "mansfieldpark": "Mansfield Park",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
    "prideprejudice": "Pride and Prejudice",
    "sensesensibility": "Sense and Sensibility",
}

NILVALUE_SXP, REFSXP = 254, 255
SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 1, 2, 9, 10, 13, 14, 16, 19


class RXdrReader:
    """Minimal reader for R's XDR serialization (format versions 2 and 3).

    Handles the types that janeaustenr's data uses: character, integer, real, logical
    vectors, generic vectors (lists), pairlists (attributes) and symbols.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[object] = []

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def read(self) -> object:
        if self.data[:2] != b"X\n":
            raise ValueError("not an R XDR serialization")
        self.pos = 2
        version = self._int()
        self._int()  # writer's R version
        self._int()  # minimal R version
        if version == 3:
            encoding_len = self._int()  # native encoding name follows
            self.pos += encoding_len
        return self._item()

    def _item(self) -> object:
        flags = self._int()
        sxp = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if sxp == NILVALUE_SXP:
            return None
        if sxp == REFSXP:
            return self.refs[(flags >> 8) - 1]
        if sxp == SYMSXP:
            name = self._item()
            self.refs.append(name)
            return name
        if sxp == LISTSXP:
            out: dict = {}
            while True:
                attr = self._item() if has_attr else None
                del attr
                tag = self._item() if has_tag else None
                out[tag if tag is not None else len(out)] = self._item()
                nxt = self._int()
                if nxt & 0xFF == NILVALUE_SXP:
                    return out
                has_attr = bool(nxt & (1 << 9))
                has_tag = bool(nxt & (1 << 10))
                if nxt & 0xFF != LISTSXP:
                    raise ValueError(f"unexpected pairlist tail type {nxt & 0xFF}")
        if sxp == CHARSXP:
            length = self._int()
            if length == -1:
                return None
            raw = self.data[self.pos : self.pos + length]
            self.pos += length
            return raw.decode("utf-8", errors="replace")
        if sxp in (LGLSXP, INTSXP):
            n = self._int()
            vals = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif sxp == REALSXP:
            n = self._int()
            vals = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif sxp in (STRSXP, VECSXP):
            n = self._int()
            vals = [self._item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R type {sxp}")
        if has_attr:
            attrs = self._item()
            if isinstance(attrs, dict) and "names" in attrs and sxp == VECSXP:
                return dict(zip(attrs["names"], vals, strict=True))
        return vals


def read_lazyload(data_dir: Path) -> dict[str, object]:
    index = RXdrReader(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).read()
    blob = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (offset, length) in index["variables"].items():
        chunk = blob[int(offset) : int(offset) + int(length)]
        (expected,) = struct.unpack(">I", chunk[:4])
        raw = zlib.decompress(chunk[4:])
        if len(raw) != expected:
            raise ValueError(f"{name}: length mismatch {len(raw)} != {expected}")
        out[name] = RXdrReader(raw).read()
    return out


def lines_to_text(lines: list[str | None]) -> str:
    paragraphs: list[str] = []
    current: list[str] = []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs) + "\n"


def fetch_deb(workdir: Path) -> Path:
    subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=workdir, check=True)
    return next(workdir.glob("r-cran-janeaustenr_*.deb"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deb", type=Path, help="path to r-cran-janeaustenr_*.deb")
    parser.add_argument("--out", type=Path, default=Path("cpu_quant/data/austen"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        deb = args.deb or fetch_deb(tmpdir)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmpdir / "x")], check=True)
        data_dir = next((tmpdir / "x").glob("usr/lib/R/site-library/janeaustenr/data"))
        objects = read_lazyload(data_dir)
        args.out.mkdir(parents=True, exist_ok=True)
        for name in NOVELS:
            if name not in objects:
                raise SystemExit(f"novel {name!r} missing from the package")
            text = lines_to_text(objects[name])
            with gzip.GzipFile(args.out / f"{name}.txt.gz", "wb", mtime=0) as fh:
                fh.write(text.encode("utf-8"))
            print(f"{name}: {len(text):,} characters", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
