"""Calibration activations between decoder layers, kept on disk (``--offload-activations``).

By default the streaming driver holds every calibration batch's hidden state in memory: bf16
``samples x seqlen x hidden`` (128 x 512 x 576 x 2 B = 75 MB on the demo model, 537 MB at
hidden 4096), plus within a layer the true-sequential stores (``sequential.py``).
``DiskActivations`` holds them as one safetensors file per batch instead, so the
peak holds one batch (plus the layer's own work) and no longer grows with ``--samples``; the
price is a write and two reads of every batch per layer.

Layout, inside the run's staging directory: ``activations/gen-NNNNN/batch-BBBBB.safetensors``
(tensor ``h``), where generation ``g`` is the input of decoder layer ``g`` (generation 0 the
embedding output). A generation is complete once the run state records ``completed_layers =
g``; the previous one is deleted after that, so a killed run always has the generation that
``--resume`` needs. The tensors round-trip bit for bit, so an offloaded run writes the same
artifact as an in-memory one.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import CpuQuantError

ACTIVATIONS_DIR = "activations"


class DiskActivations:
    def __init__(self, root: Path, generation: int, count: int = 0) -> None:
        self.root = Path(root)
        self.generation = generation
        self.count = count
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def dir(self) -> Path:
        return self.root / f"gen-{self.generation:05d}"

    def _file(self, b: int) -> Path:
        return self.dir / f"batch-{b:05d}.safetensors"

    @classmethod
    def open(cls, root: Path, generation: int, count: int) -> DiskActivations:
        """A generation written by an earlier (interrupted) run."""
        store = cls.__new__(cls)
        store.root, store.generation, store.count = Path(root), generation, count
        missing = [b for b in range(count) if not store._file(b).is_file()]
        if missing:
            raise CpuQuantError(f"{store.dir} lacks {len(missing)} of its {count} activation "
                                "files; run without --resume to start over")
        return store

    def append(self, h: torch.Tensor) -> None:
        save_file({"h": h.contiguous()}, str(self._file(self.count)))
        self.count += 1

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for b in range(self.count):
            yield load_file(str(self._file(b)))["h"]

    def rewrite(self, outputs: Iterable[torch.Tensor]) -> DiskActivations:
        """The next generation, filled from ``outputs`` (computed lazily from this one)."""
        nxt = DiskActivations(self.root, self.generation + 1)
        shutil.rmtree(nxt.dir, ignore_errors=True)  # leftovers of a run killed mid-layer
        nxt.dir.mkdir(parents=True)
        for h in outputs:
            nxt.append(h)
        return nxt

    def drop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class Discard(list):
    """A sink that keeps nothing (a resumed run records the layers' call arguments only)."""

    def append(self, _item) -> None:
        pass
