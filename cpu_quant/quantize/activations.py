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
artifact as an in-memory one. A distributed rank holds the batches from ``offset`` on, under
the run's batch numbers, in the generation directory every rank shares.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..core.errors import CpuQuantError
from ..core.io.safetensors_writer import write_safetensors

ACTIVATIONS_DIR = "activations"


class DiskActivations:
    def __init__(self, root: Path, generation: int, count: int = 0, offset: int = 0) -> None:
        self.root = Path(root)
        self.generation = generation
        self.count = count
        self.offset = offset
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def dir(self) -> Path:
        return self.root / f"gen-{self.generation:05d}"

    def _file(self, b: int) -> Path:
        return self.dir / f"batch-{self.offset + b:05d}.safetensors"

    @classmethod
    def open(cls, root: Path, generation: int, count: int, offset: int = 0) -> DiskActivations:
        """A generation written by an earlier (interrupted) run."""
        store = cls.__new__(cls)
        store.root, store.generation, store.count = Path(root), generation, count
        store.offset = offset
        missing = [b for b in range(count) if not store._file(b).is_file()]
        if missing:
            raise CpuQuantError(f"{store.dir} lacks {len(missing)} of its {count} activation "
                                "files; run without --resume to start over")
        return store

    def append(self, h: torch.Tensor) -> None:
        write_safetensors(self._file(self.count), {"h": h})
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
        nxt = DiskActivations(self.root, self.generation + 1, offset=self.offset)
        for b in range(self.count):  # leftovers of a run killed mid-layer (this share's only:
            nxt._file(b).unlink(missing_ok=True)  # other ranks write theirs meanwhile)
        for h in outputs:
            nxt.append(h)
        return nxt

    def drop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class Discard(list):
    """A sink that keeps nothing (a resumed run records the layers' call arguments only)."""

    def append(self, _item) -> None:
        pass


def one_slab(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same values as views of one tensor: one large block, mapped and unmapped whole.
    Sixteen separate 4.7 MB blocks (the demo model's activations at 128 x 512), made among a
    layer's short-lived temporaries and kept to the next layer, fragmented the heap
    (docs/reliability.md#memory)."""
    if not tensors:
        return tensors
    rows = [t.shape[:-1].numel() for t in tensors]
    slab = torch.empty(sum(rows), tensors[0].shape[-1], dtype=tensors[0].dtype)
    views, start = [], 0
    for t, n in zip(tensors, rows, strict=True):
        view = slab[start:start + n].view(t.shape)
        view.copy_(t)
        views.append(view)
        start += n
    return views


def in_place(outputs: Iterable[torch.Tensor], hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """A layer's outputs written over its inputs, batch by batch: each output is made after
    its batch's input was last read (the passes go batch by batch), and the run's resume point
    is the copy on disk, not this one. So the next layer's activations take no second copy."""
    for b, out in enumerate(outputs):
        hidden[b].copy_(out)
    return hidden
