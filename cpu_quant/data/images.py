"""Calibration images of vision-language models.

Built-in: 16 public-domain and CC0 pictures from scikit-image's sample data (photographs of
people, animals, objects, a rocket, galaxies, printed text, microscopy, textures), at most 384
pixels on a side, built by ``scripts/build_calibration_images.py`` into
``cpu_quant/data/images/`` (``SOURCES.md`` there has each one's subject and licence;
``SHA256SUMS`` their digests, checked when read). A user's images: a directory of ``.jpg``,
``.jpeg``, ``.png`` or ``.webp`` files, read in sorted order.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..core.errors import CpuQuantError

IMAGES_DIR = Path(__file__).with_name("images")
SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def _builtin_digests() -> dict[str, str]:
    lines = (IMAGES_DIR / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (ln.split("  ", 1) for ln in lines if ln.strip())}


def image_files(directory: str | Path | None = None) -> list[Path]:
    """The image files of ``directory`` (None: the built-in set), sorted by name; a directory
    without one, or missing, is a one-line error."""
    root = IMAGES_DIR if directory is None else Path(directory)
    if not root.is_dir():
        raise CpuQuantError(f"--images {root}: not a directory")
    files = sorted(p for p in root.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())
    if not files:
        raise CpuQuantError(f"--images {root}: no {', '.join(SUFFIXES)} file in it")
    return files


def load_images(directory: str | Path | None = None, count: int | None = None) -> list:
    """The first ``count`` images (all when None) of :func:`image_files`, as RGB PIL images,
    taken round-robin when ``count`` exceeds them; an unreadable file, or a built-in one whose
    digest differs from ``SHA256SUMS``, is a one-line error."""
    from PIL import Image, UnidentifiedImageError

    files = image_files(directory)
    digests = _builtin_digests() if directory is None else {}
    n = len(files) if count is None else count
    out = []
    for path in (files[i % len(files)] for i in range(n)):
        data = path.read_bytes()
        if digests and hashlib.sha256(data).hexdigest() != digests.get(path.name):
            raise CpuQuantError(f"{path}: not the built-in image (its sha256 differs from "
                                "SHA256SUMS); reinstall cpu-quant")
        try:
            with Image.open(path) as image:
                out.append(image.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise CpuQuantError(f"--images: {path} is not a readable image ({e})") from None
    return out
