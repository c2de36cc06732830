"""Build the built-in calibration images of vision-language models from scikit-image's sample data.

Usage: ``python scripts/build_calibration_images.py [--wheel PATH] [--out cpu_quant/data/images]``

The images are the sample pictures scikit-image ships inside its wheel (``skimage/data/``),
each public domain or CC0 by the statement in scikit-image's own docstrings (copied into
:data:`IMAGES`). Without ``--wheel`` the script runs ``pip download`` of the pinned wheel in a
temporary directory; a wheel whose sha256 differs stops the build with a one-line error. Each
image is converted to RGB, scaled (Lanczos) so that its longest edge is :data:`LONGEST_EDGE`
pixels (smaller ones are kept as they are) and written as JPEG (quality 90); ``SOURCES.md``
beside them lists every file with its subject, its licence and where it came from, and
``SHA256SUMS`` their digests (``cpu_quant.data.images`` checks a file against it).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "scikit_image-0.26.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
WHEEL_SHA256 = "74aa5518ccea28121f57a95374581d3b979839adc25bb03f289b1bc9b99c58af"
LONGEST_EDGE = 384
# file in skimage/data -> (output name, subject, licence as scikit-image states it)
IMAGES = {
    "astronaut.png": ("astronaut", "an astronaut's portrait (Eileen Collins, NASA)",
                      "No known copyright restrictions, released into the public domain."),
    "camera.png": ("camera", "a photographer with a camera (grayscale)",
                   "No copyright restrictions. CC0 by the photographer (Lav Varshney)."),
    "chelsea.png": ("chelsea", "a cat", "No copyright restrictions. CC0 by the photographer "
                    "(Stefan van der Walt)."),
    "coffee.png": ("coffee", "a cup of coffee on a saucer", "No copyright restrictions. CC0 by "
                   "the photographer (Rachel Michetti)."),
    "rocket.jpg": ("rocket", "a rocket on its launch pad", "Captured by SpaceX and released "
                   "in the public domain."),
    "hubble_deep_field.jpg": ("hubble_deep_field", "galaxies of the Hubble deep field",
                              "Captured by NASA; may be freely used in the public domain."),
    "coins.png": ("coins", "Greek coins (grayscale)", "No known copyright restrictions."),
    "clock_motion.png": ("clock", "a wall clock, motion-blurred (grayscale)", "Released into "
                         "the public domain by the photographer (Stefan van der Walt)."),
    "horse.png": ("horse", "a horse's silhouette", "No copyright restrictions. CC0 given by "
                  "owner (Andreas Preuss (marauder))."),
    "text.png": ("text", "a photograph of printed text (grayscale)", "No known copyright "
                 "restrictions, released into the public domain."),
    "ihc.png": ("immunohistochemistry", "stained tissue under a microscope",
                "No known copyright restrictions."),
    "retina.jpg": ("retina", "a fundus photograph of an eye", "Creative Commons CC0 1.0 "
                   "Universal Public Domain Dedication."),
    "cell.png": ("cell", "a cell under a microscope (grayscale)", "CC0, dedicated to the "
                 "public domain."),
    "brick.png": ("brick", "a brick wall (grayscale)", "CC0Textures, Creative Commons CC0."),
    "grass.png": ("grass", "grass (grayscale)", "Creative Commons CC0."),
    "gravel.png": ("gravel", "gravel (grayscale)", "CC0Textures, Creative Commons CC0."),
}


def _wheel(path: Path | None, tmp: Path) -> Path:
    if path is None:
        name, version = WHEEL.split("-")[:2]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
               f"{name.replace('_', '-')}=={version}", "-d", str(tmp)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"error: pip download of {WHEEL} failed: "
                             f"{out.stderr.strip().splitlines()[-1:]}")
        path = tmp / WHEEL
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise SystemExit(f"error: {path.name} has sha256 {digest}, expected {WHEEL_SHA256}")
    return path


def build(wheel: Path, out: Path) -> None:
    from PIL import Image

    out.mkdir(parents=True, exist_ok=True)
    rows, sums = [], []
    with zipfile.ZipFile(wheel) as zf:
        for member, (name, subject, licence) in IMAGES.items():
            image = Image.open(io.BytesIO(zf.read(f"skimage/data/{member}"))).convert("RGB")
            scale = LONGEST_EDGE / max(image.size)
            if scale < 1:
                size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
                image = image.resize(size, Image.Resampling.LANCZOS)
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=90)
            (out / f"{name}.jpg").write_bytes(buf.getvalue())
            sums.append(f"{hashlib.sha256(buf.getvalue()).hexdigest()}  {name}.jpg")
            rows.append(f"| `{name}.jpg` | {image.width}×{image.height} | {subject} | "
                        f"{licence} | `skimage/data/{member}` |")
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    (out / "SOURCES.md").write_text("\n".join([
        "# Built-in calibration images", "",
        f"From scikit-image 0.26.0's sample data (the wheel `{WHEEL}`, sha256 "
        f"`{WHEEL_SHA256}`), each scaled to at most {LONGEST_EDGE} pixels on its longest edge "
        "and stored as JPEG (quality 90) by `scripts/build_calibration_images.py`. Each "
        "licence is the one scikit-image states for the image.", "",
        "| file | size | subject | licence | from |", "|---|---|---|---|---|", *rows, ""]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1]
                    / "cpu_quant" / "data" / "images")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        build(_wheel(args.wheel, Path(tmp)), args.out)
    print(f"wrote {len(IMAGES)} images to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
