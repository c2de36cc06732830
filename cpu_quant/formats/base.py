"""The registry of on-disk formats, and what every format provides.

A format is a class registered by name with ``__init_subclass__(name=...)`` (the pattern of
gguf-py's quant types). It owns its byte layout, its limits (:class:`Limits`, which the plan
asks before any work) and a *sink*: the object the pipeline hands each quantization result to.
One run writes one :class:`GroupQuant` per linear to as many sinks as formats were asked for.

Safetensors formats (``gptq``, ``cpu_int4``) share ``formats.safetensors.SafetensorsFormat``:
per quantized linear ``<m>`` a fixed set of tensors ``<m>.<suffix>`` (:class:`TensorSpec`, also
what ``verify`` checks), ``pack``/``unpack`` between those tensors and a :class:`GroupQuant`, and
the ``quantization_config`` written into ``config.json``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from ..core.block_grid import BlockGrid, BlockQuant
from ..core.errors import CpuQuantError
from ..core.grid import GroupQuant
from .sink import ArtifactInfo, Sink

if TYPE_CHECKING:
    from ..core.cpu import CpuFacts

REGISTRY: dict[str, type[Format]] = {}

Shape = Callable[[int, int, int, int], tuple[int, ...]]  # (N, K, groups, bits) -> shape


@dataclass(frozen=True)
class Serving:
    """How an artifact is served: the runtime, the command for this artifact, and lines that
    explain the command."""

    runtime: str
    command: str
    notes: tuple[str, ...] = ()


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

    def accepted_groups(self, groups: tuple[int, ...] | None = None) -> str:
        """The group sizes it stores, as a message lists them (``-1`` first when stored)."""
        groups = sorted(groups or self.groups)
        return ", ".join(map(str, (-1, *groups) if self.row_group else groups))

    def group_problem(self, group: int, k: int | None = None,
                      groups: tuple[int, ...] | None = None) -> str | None:
        """Why ``group`` cannot be stored for in-features ``k`` (None: for any in-features;
        ``groups``: the sizes to
        accept instead of :attr:`groups`, as ``verify`` reads a format); None if it can. The
        one answer to "can this group be stored?": the plan refuses a flag with it, ``verify``
        an artifact's config and its modules."""
        groups = groups or self.groups
        if group == -1:
            if self.row_group or (k is not None and k in groups):
                return None
            if k is None:  # for every in-features: only a format that stores rows as such
                return f"one group per row is not stored ({self.kernel} takes groups of " \
                       f"{self.accepted_groups(groups)})"
            return f"group -1 means one group of {k}, and {self.kernel} takes only groups of " \
                   f"{self.accepted_groups(groups)}"
        if group not in groups:
            return f"group {group} is not one {self.kernel} takes " \
                   f"(accepted: {self.accepted_groups(groups)})"
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


@dataclass(frozen=True)
class ProbeRule:
    """One row of ``probe``'s decision table: when it holds (``when(facts, priority, target)``),
    the path it names, the kernel that runs it and why. ``order`` places it in the table (rows
    are tried in ascending order, the first that holds wins). A format package declares the
    rows that name it (:attr:`Format.probe_rules`; the registry fills ``format``); rows whose
    path is not a format's give their ``command`` instead."""

    order: int
    name: str
    when: Callable[[CpuFacts, str, str], bool]
    path: str
    kernel: str
    verified: bool
    reason: str
    alternative: str | None = None  # the name of a second row worth printing
    format: str | None = None
    command: str | None = None

    def command_line(self) -> str:
        return self.command or get_format(self.format).write_command()


class Format:
    """An on-disk format. Subclasses register with ``class X(Format, name="x")``."""

    name: ClassVar[str]
    limits: ClassVar[Limits]
    quant_methods: ClassVar[tuple[str, ...]] = ()  # config quant_method values it reads
    # what the vLLM plugin loads for this format (``cpu_quant.runtime_patches.register``): a module
    # whose ``register()`` registers a quantization method named after the format, and patch
    # modules (``NAME``, ``ENV_SWITCH``, ``apply()``); full module names, in the format's package
    vllm_method: ClassVar[str | None] = None
    vllm_patches: ClassVar[tuple[str, ...]] = ()
    summary: ClassVar[str] = ""  # what reads it, for the command line's help
    command: ClassVar[str | None] = None  # the command that writes this format alone, if any
    repackable: ClassVar[bool] = False  # convert writes it (modules packed one by one)
    # a config file some writers of this format keep beside config.json instead of its
    # quantization_config (AutoGPTQ's quantize_config.json); read when config.json has none
    legacy_config_file: ClassVar[str | None] = None
    # the rows of probe's decision table that choose this format (``format`` left unset)
    probe_rules: ClassVar[tuple[ProbeRule, ...]] = ()
    # True: the format stores tensors on grids of its own (:meth:`tensor_grid`), so its results
    # are not the run's group grid and it is written in a run of its own
    own_grids: ClassVar[bool] = False

    def __init_subclass__(cls, *, name: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:  # a shared base, not a format
            return
        if name in REGISTRY:
            raise TypeError(f"format {name!r} registered twice")
        cls.name = name
        REGISTRY[name] = cls

    def write_command(self, args: str = "SRC DST --group 128") -> str:
        """The command line that writes this format (``args``: its positional arguments and
        options): its own command, or ``gptq`` with ``--format`` unless it is the default."""
        if self.command:
            return f"cpu-quant {self.command} {args}"
        fmt = "" if self.name == DEFAULT_FORMAT else f" --format {self.name}"
        return f"cpu-quant gptq {args}{fmt}"

    def serving(self, target: Path) -> Serving:
        """How an artifact of this format at ``target`` is served (the model card and the
        command's closing note print it)."""
        return Serving("see the cpu-quant docs", str(target))

    def unservable_here(self, facts: CpuFacts, target: Path) -> str | None:
        """Why what cpu-quant installs cannot serve ``target`` on a CPU of ``facts``, and what
        to do instead; None when it can."""
        return None

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

    def ties_head(self, source_config: dict) -> bool:
        """Whether this format stores a tied source's quantized head as its token embedding
        too: one tensor, as llama.cpp's own files of a tied model hold. The embedding is then
        not quantized on its own, and the head takes no smoothing fold (a fold scales the
        head's columns, which the embedding's lookups would return)."""
        return False

    def kept_tensors(self, path: Path, source_config: dict,
                     names: list[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """For each source tensor name in ``names`` that a run keeps unquantized (a
        vision-language model's vision tower and projector), that tensor as an artifact of
        this format stores it, or None where it lacks it (``verify --source``)."""
        yield from ()

    def refuse_source_files(self, source: Path, source_config: dict) -> str | None:
        """Why the files of the source directory (beside its weights) cannot give this format
        what it writes, or None; checked before any work, as :meth:`refuse_source`."""
        return None

    def refuse_source(self, source_config: dict) -> str | None:
        """Why a model with this config.json cannot be written in this format, or None
        (checked before any work)."""
        return None

    def tensor_grid(self, module: str, in_features: int, source_config: dict,
                    calibrated: bool) -> BlockGrid | None:
        """The block grid this format stores the tensor ``module`` (a linear, the head
        ``lm_head`` or the embedding ``model.embed_tokens``) on, for a source of
        ``source_config``; None: the run's group grid (or, for the embedding, not quantized).
        The plan asks it (``quantize/plan.py``)."""
        return None

    def refuse_grid(self, symmetric: bool) -> str | None:
        """Why this format cannot store the run's grid, or None."""
        if not symmetric and not self.limits.stores_zeros:
            return f"{self.name} stores no zero points, so it holds only the symmetric grid"
        return None


# -- the registry ---------------------------------------------------------------------------------
DEFAULT_FORMAT = "gptq"  # what ``gptq`` writes without --format, and a run without formats


def get_format(name: str) -> Format:
    try:
        return REGISTRY[name]()
    except KeyError:
        raise CpuQuantError(f"unknown format {name!r} (known: {', '.join(sorted(REGISTRY))})") from None


def format_names() -> list[str]:
    return sorted(REGISTRY)


def format_for_command(command: str) -> Format:
    """The format that the command ``command`` writes alone."""
    for cls in REGISTRY.values():
        if cls.command == command:
            return cls()
    raise CpuQuantError(f"no format is written by a command named {command!r}")


def repackable_format_names() -> list[str]:
    """The formats ``convert`` writes: those whose modules ``pack``/``unpack`` one by one."""
    return [name for name, cls in sorted(REGISTRY.items()) if cls.repackable]


def formats_help() -> str:
    """``name (what reads it)`` of every format, for the command line's help."""
    order = sorted(REGISTRY.items(), key=lambda kv: (kv[0] != DEFAULT_FORMAT, kv[0]))
    return ", ".join(f"{name} ({cls.summary})" if cls.summary else name for name, cls in order)


def format_for_quant_method(quant_method: str | None) -> Format | None:
    """The safetensors format whose config says ``quant_method``, or None."""
    for cls in REGISTRY.values():
        if quant_method in cls.quant_methods:
            return cls()  # type: ignore[return-value]
    return None


def format_probe_rules() -> list[ProbeRule]:
    """Every format's rows of probe's decision table, each naming its format."""
    return [replace(rule, format=name) for name, cls in sorted(REGISTRY.items())
            for rule in cls.probe_rules]


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

    def add_module(self, module: str, gq: GroupQuant | BlockQuant) -> int:
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
