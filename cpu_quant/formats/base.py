"""The registry of on-disk formats, and what every format provides.

A format is a class registered by name with ``__init_subclass__(name=...)`` (the pattern of
gguf-py's quant types). It owns its byte layout, its limits (:class:`Limits`, which the plan
asks before any work) and a *sink*: the object the pipeline hands each quantization result to.
One run writes one :class:`GroupQuant` per linear to as many sinks as formats were asked for.

Safetensors formats (``gptq``, ``cpu_int4``) share :class:`SafetensorsFormat`: per quantized
linear ``<m>`` a fixed set of tensors ``<m>.<suffix>`` (:class:`TensorSpec`, also what
``verify`` checks), ``pack``/``unpack`` between those tensors and a :class:`GroupQuant`, and the
``quantization_config`` written into ``config.json``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from ..errors import CpuQuantError
from ..quantize.grid import GroupQuant

if TYPE_CHECKING:
    from ..io.checkpoint import Checkpoint

REGISTRY: dict[str, type[Format]] = {}

Shape = Callable[[int, int, int, int], tuple[int, ...]]  # (N, K, groups, bits) -> shape


@dataclass(frozen=True)
class TensorSpec:
    """One per-module tensor of a safetensors format: suffix, accepted dtypes, shape."""

    suffix: str
    dtypes: tuple[str, ...]  # safetensors dtype strings
    shape: Shape


@dataclass(frozen=True)
class Limits:
    """What a format can hold; the plan asks these of every requested format.

    ``groups``: the group sizes it stores, largest first; ``row_group``: whether ``-1`` (one
    group per row) is stored as such; ``k_multiple``/``n_multiple``: the in-/out-features a
    quantized linear must be a multiple of (otherwise the plan keeps it bf16);
    ``stores_zeros``: whether it holds the asymmetric grid's per-group zeros.
    """

    groups: tuple[int, ...]
    row_group: bool
    k_multiple: int
    n_multiple: int
    stores_zeros: bool
    kernel: str  # who reads it, named in messages

    def group_problem(self, group: int, k: int | None = None) -> str | None:
        """Why ``group`` cannot be stored for in-features ``k``; None if it can."""
        if group == -1:
            if self.row_group or (k is not None and k in self.groups):
                return None
            return f"one group per row is not stored ({self.kernel} takes groups of " \
                   f"{', '.join(map(str, self.groups))})"
        if group not in self.groups:
            accepted = (-1, *self.groups) if self.row_group else self.groups
            return f"group {group} is not one {self.kernel} takes " \
                   f"({', '.join(map(str, accepted))})"
        return None


def combined_limits(formats: list[Format]) -> Limits:
    """What every one of ``formats`` can hold (the plan of a run writing all of them)."""
    groups = tuple(g for g in formats[0].limits.groups if all(g in f.limits.groups for f in formats))
    return Limits(
        groups=tuple(sorted(groups, reverse=True)),
        row_group=all(f.limits.row_group for f in formats),
        k_multiple=math.lcm(*(f.limits.k_multiple for f in formats)),
        n_multiple=math.lcm(*(f.limits.n_multiple for f in formats)),
        stores_zeros=all(f.limits.stores_zeros for f in formats),
        kernel=" and ".join(f.limits.kernel for f in formats),
    )


@dataclass
class ArtifactInfo:
    """What a sink needs at the end of a run to write its config and metadata."""

    source: Path
    source_config: dict
    default_group: int
    head_quantized: bool
    dynamic: dict[str, dict]
    symmetric: bool
    extra: dict = field(default_factory=dict)  # provenance for the quantization config
    report: dict = field(default_factory=dict)  # quantization_report.json


class Sink:
    """Where one format's share of a run goes. ``end_layer`` persists what it has so far (the
    run's resume point names it in ``state()``); ``finish`` writes the rest."""

    def add_module(self, module: str, gq: GroupQuant) -> int:
        """Take one quantized linear; return the bytes it stores."""
        raise NotImplementedError

    def add_tensor(self, name: str, tensor: torch.Tensor) -> int:
        """Take one float tensor (bf16), by its Hugging Face name; return its bytes."""
        raise NotImplementedError

    def end_layer(self, index: int) -> None:
        raise NotImplementedError

    def state(self) -> dict:
        return {}

    def finish(self, info: ArtifactInfo) -> None:
        raise NotImplementedError


class Format:
    """An on-disk format. Subclasses register with ``class X(Format, name="x")``."""

    name: ClassVar[str]
    limits: ClassVar[Limits]
    quant_methods: ClassVar[tuple[str, ...]] = ()  # config quant_method values it reads

    def __init_subclass__(cls, *, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:  # a shared base, not a format
            return
        if name in REGISTRY:
            raise TypeError(f"format {name!r} registered twice")
        cls.name = name
        REGISTRY[name] = cls

    def open_sink(self, directory: Path, n_layers: int, resume_state: dict | None) -> Sink:
        raise NotImplementedError

    def owns(self, path: Path) -> bool:
        """Whether ``path`` is this format's artifact and not a safetensors checkpoint (a file
        format's file, or a directory holding one); verify and inspect then ask the format."""
        return False

    def verify_artifact(self, path: Path) -> tuple[list, int]:
        """(verify's Finding objects, quantized tensors) for an artifact this format owns."""
        raise NotImplementedError

    def inspect_artifact(self, path: Path) -> dict:
        """A summary (JSON-able; one printed line per key) of an artifact this format owns."""
        raise NotImplementedError

    def dequantized_modules(self, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
        """Every quantized linear of an artifact this format owns, by its source module name,
        dequantized to float32 ``[N, K]`` (``verify --source``)."""
        raise CpuQuantError(f"verify --source cannot read {self.name} artifacts")

    def refuse_source(self, source_config: dict) -> str | None:
        """Why a model with this config.json cannot be written in this format, or None
        (checked before any work)."""
        return None

    def refuse_grid(self, symmetric: bool) -> str | None:
        """Why this format cannot store the run's grid, or None."""
        if not symmetric and not self.limits.stores_zeros:
            return f"{self.name} stores no zero points, so it holds only the symmetric grid"
        return None


# -- safetensors formats ------------------------------------------------------------------------
class SafetensorsFormat(Format):
    """A format of per-module safetensors tensors plus ``quantization_config`` in config.json."""

    tensors: ClassVar[tuple[TensorSpec, ...]]
    marker: ClassVar[str]  # the tensor whose shape gives N and K
    scales_suffix: ClassVar[str]
    scales_group_axis: ClassVar[int]  # the axis of the scales tensor that counts the groups
    head_kernel: ClassVar[str]  # the kernel a bf16 head slows down, named by verify
    # what verify accepts (its readers may take more than the writer writes); None: ``limits``
    verify_groups: ClassVar[tuple[int, ...] | None] = None
    verify_k_multiple: ClassVar[int | None] = None
    verify_n_multiple: ClassVar[int | None] = None
    bits: ClassVar[tuple[int, ...]] = (4,)

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(t.suffix for t in self.tensors)

    def tensor_spec(self, suffix: str) -> TensorSpec:
        return next(t for t in self.tensors if t.suffix == suffix)

    def dims_from_marker(self, shape: tuple[int, ...], bits: int) -> tuple[int, int]:
        """(N, K) of a module from its marker tensor's shape."""
        raise NotImplementedError

    def pack(self, gq: GroupQuant, module: str = "module") -> dict[str, torch.Tensor]:
        """One quantization result as this format's tensors (suffix -> tensor)."""
        raise NotImplementedError

    def unpack(self, tensors: dict[str, torch.Tensor], qcfg: dict, module: str = "module"
               ) -> GroupQuant:
        """This format's tensors of one module back to the quantization result, exactly."""
        raise NotImplementedError

    def dequantize(self, tensors: dict[str, torch.Tensor], qcfg: dict) -> torch.Tensor:
        """A faithful float32 [N, K] reading of one module, for eval (foreign files included)."""
        return self.unpack(tensors, qcfg).dequantize()

    def quantization_config(self, info: ArtifactInfo) -> dict:
        raise NotImplementedError

    def read_tensors(self, ckpt: Checkpoint, module: str) -> dict[str, torch.Tensor]:
        return {s: ckpt.tensor(f"{module}.{s}") for s in self.suffixes if f"{module}.{s}" in ckpt.files}

    def modules(self, ckpt: Checkpoint) -> list[str]:
        suffix = "." + self.marker
        return sorted(n[: -len(suffix)] for n in ckpt.names if n.endswith(suffix))

    def checkpoint_format(self, qcfg: dict) -> str | None:
        """The sub-format a config declares (GPTQ's zero convention), if the format has one."""
        return None

    def config_findings(self, qcfg: dict) -> Iterator:
        """Format-specific problems of ``quantization_config`` (verify's Finding objects)."""
        return iter(())

    def module_findings(self, ctx, mod) -> Iterator:
        """Format-specific checks of one module's stored values (verify's Finding objects)."""
        return iter(())

    def open_sink(self, directory: Path, n_layers: int, resume_state: dict | None) -> Sink:
        from .safetensors_sink import SafetensorsSink

        return SafetensorsSink(self, directory, n_layers, resume_state)


# -- the registry ---------------------------------------------------------------------------------
def get_format(name: str) -> Format:
    try:
        return REGISTRY[name]()
    except KeyError:
        raise CpuQuantError(f"unknown format {name!r} (known: {', '.join(sorted(REGISTRY))})") from None


def format_names() -> list[str]:
    return sorted(REGISTRY)


def format_for_quant_method(quant_method: str | None) -> SafetensorsFormat | None:
    """The safetensors format whose config says ``quant_method``, or None."""
    for cls in REGISTRY.values():
        if quant_method in cls.quant_methods:
            return cls()  # type: ignore[return-value]
    return None


def format_owning(path: Path) -> Format | None:
    """The format that owns ``path`` (see :meth:`Format.owns`), or None."""
    for cls in REGISTRY.values():
        fmt = cls()
        if fmt.owns(Path(path)):
            return fmt
    return None


def parse_formats(text: str) -> list[Format]:
    """``gptq,cpu_int4,gguf`` -> the formats, in order, each once."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise CpuQuantError("--format names no format (known: " + ", ".join(format_names()) + ")")
    if len(set(names)) != len(names):
        raise CpuQuantError(f"--format names a format twice: {text}")
    return [get_format(n) for n in names]


class SinkSet:
    """The sinks of one run: every result goes to each. With one format its files are the
    artifact itself; with several, each format has its own subdirectory, named after it."""

    def __init__(self, formats: list[Format], root: Path, n_layers: int,
                 resume: dict[str, dict] | None = None) -> None:
        resume = resume or {}
        self.directories = {f.name: root if len(formats) == 1 else root / f.name for f in formats}
        self.sinks = {f.name: f.open_sink(self.directories[f.name], n_layers, resume.get(f.name))
                      for f in formats}

    def add_module(self, module: str, gq: GroupQuant) -> int:
        """Hand one result to every sink; the bytes the first format stores."""
        stored = [sink.add_module(module, gq) for sink in self.sinks.values()]
        return stored[0]

    def add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        for sink in self.sinks.values():
            sink.add_tensor(name, tensor)

    def end_layer(self, index: int) -> None:
        for sink in self.sinks.values():
            sink.end_layer(index)

    def state(self) -> dict[str, dict]:
        return {name: sink.state() for name, sink in self.sinks.items()}

    def finish(self, info: ArtifactInfo) -> None:
        for sink in self.sinks.values():
            sink.finish(info)
