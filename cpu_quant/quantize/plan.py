"""The quantization plan: which tensors are quantized, and with what group. One place only.

Rules, in the spirit of llama.cpp's ``llama_tensor_get_type``:

* every ``nn.Linear`` inside a decoder layer is quantized to 4 bits;
* the output head (``lm_head``) is quantized unless ``--no-lm-head`` (it is the most sensitive
  tensor and, left bf16, the costliest GEMM of a decode step); under calibrated symmetric GPTQ
  it takes groups of :data:`HEAD_GROUP` by default (:func:`head_group`), and the MLP's down
  projection groups of :data:`DOWN_GROUP` (:func:`down_group`);
* the input embedding and all norms stay bf16;
* the plan asks the requested formats what they can hold (``formats.combined_limits``): their
  groups, whether one group per row is stored, and the dimension multiples of their kernels;
* group size: the requested one when it divides the in-features; otherwise the largest stored
  group below it that does, recorded as a per-module ``dynamic`` override so that vLLM loads
  it (``--strict-group`` refuses instead); ``-1`` (one group per row) when nothing divides and
  the formats store it;
* a linear whose in- or out-features is not a multiple the formats' kernels need stays bf16.
  It is recorded as a negative ``dynamic`` rule so vLLM leaves it unquantized;
* a format with grids of its own (``Format.own_grids``: a GGUF of one of llama.cpp's file
  types) is asked each tensor's grid (``Format.tensor_grid``): every quantized linear and the
  head take it (:func:`on_format_grid`), and the embedding is quantized on its grid too when
  the format gives it one (:func:`embedding_plan`). Such a format is written alone.
* a vision-language checkpoint's vision tower and projector stay bf16, copied unchanged
  (``core.vision_language``), each recorded as a negative ``dynamic`` rule.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.block_grid import BlockGrid
from ..core.errors import CpuQuantError
from ..core.naming import DOWN_LEAF, VLLM_FUSED
from ..core.vision_language import VisionLanguageFamily
from ..formats.base import Format, Limits

if TYPE_CHECKING:
    from .settings import QuantSettings

# The head's default group under calibrated symmetric GPTQ when ``--group`` is larger. On the
# demo model it cut held-out KL from 0.0928 to 0.0878 (W4A8: 0.1065 to 0.1017) with smoothing
# folded in, for 1.1 MB more scales (fidelity-20261204T185718Z.json).
HEAD_GROUP = 32
# The MLP's down projection's default group under calibrated symmetric GPTQ when ``--group`` is
# larger. Its input (the gated activation) carries the largest outliers. On the demo
# model (whose other linears already take 64: 576 in-features) it cut held-out KL from 0.0892
# to 0.0840 and W4A8 KL from 0.1031 to 0.0975, and lowered both on a tiny model of every
# architecture (docs/results.md, fidelity), for 1/16 bit more per down-projection weight.
DOWN_GROUP = 64


@dataclass(frozen=True)
class LinearPlan:
    name: str  # HF module name, e.g. model.layers.3.self_attn.q_proj
    in_features: int
    out_features: int
    quantize: bool
    group_size: int  # -1 = one group per row
    reason: str = ""
    grid: BlockGrid | None = None  # the format's own grid (then group_size is its block)

    @property
    def effective_group(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size


def choose_group(name: str, in_features: int, requested: int, strict: bool, limits: Limits,
                 flag: str = "--group") -> tuple[int, str]:
    if requested == -1 or in_features % requested == 0:
        return requested, ""
    if strict:
        raise CpuQuantError(f"--strict-group: {flag} {requested} does not divide the in-features "
                            f"{in_features} of {name}")
    for g in limits.groups:
        if g < requested and in_features % g == 0:
            return g, f"group {requested} does not divide in-features {in_features}; using {g}"
    if limits.row_group:
        return -1, f"no accepted group divides in-features {in_features}; one group per row"
    raise CpuQuantError(f"{name}: no group that {limits.kernel} takes divides its in-features "
                        f"{in_features}")


def head_group(settings: QuantSettings, hidden_size: int, limits: Limits) -> tuple[int, str]:
    """The head's requested group and the flag it comes from: ``--head-group`` when given;
    else :data:`HEAD_GROUP` for calibrated symmetric GPTQ whose ``--group`` is larger, when it
    divides the head's in-features and the formats store it; else ``--group`` (``-1``, one
    scale per row, stays that: the phone's 16a4w stores nothing else)."""
    if settings.head_group is not None:
        return settings.head_group, "--head-group"
    g = settings.group_size
    if (settings.method == "gptq" and settings.symmetric and not settings.data_free
            and g > HEAD_GROUP and hidden_size % HEAD_GROUP == 0
            and HEAD_GROUP in limits.groups):
        return HEAD_GROUP, "--group"
    return g, "--group"


def down_group(settings: QuantSettings, limits: Limits) -> tuple[int, str]:
    """The MLP down projections' requested group and the flag it comes from: ``--down-group``
    when given; else :data:`DOWN_GROUP` for calibrated symmetric GPTQ whose ``--group`` is
    larger, when the formats store it; else ``--group``. A module that the group does not
    divide falls back as any other (:func:`choose_group`)."""
    if settings.down_group is not None:
        return settings.down_group, "--down-group"
    g = settings.group_size
    if (settings.method == "gptq" and settings.symmetric and not settings.data_free
            and g > DOWN_GROUP and DOWN_GROUP in limits.groups):
        return DOWN_GROUP, "--group"
    return g, "--group"


def linear_group(name: str, settings: QuantSettings, limits: Limits) -> tuple[int, str]:
    """A decoder linear's requested group and its flag: :func:`down_group` for the MLP's down
    projection, ``--group`` for every other."""
    if name.endswith(DOWN_LEAF):
        return down_group(settings, limits)
    return settings.group_size, "--group"


def check_group(flag: str, group: int, limits: Limits) -> None:
    """Refuse, before any work, a group the requested formats cannot store."""
    if limits.group_problem(group) is not None:
        raise CpuQuantError(f"{flag} {group} is not stored by {limits.kernel}: {flag} must be "
                            f"one of {limits.accepted_groups()}")


def plan_linear(name: str, in_features: int, out_features: int, group_size: int,
                strict_group: bool, limits: Limits, quantize: bool = True,
                flag: str = "--group") -> LinearPlan:
    if not quantize:
        return LinearPlan(name, in_features, out_features, False, group_size, "kept bf16 by request")
    if in_features % limits.k_multiple or out_features % limits.n_multiple:
        return LinearPlan(name, in_features, out_features, False, group_size,
                          f"dims {out_features}x{in_features} are not multiples of "
                          f"{limits.n_multiple}x{limits.k_multiple}")
    g, reason = choose_group(name, in_features, group_size, strict_group, limits, flag)
    return LinearPlan(name, in_features, out_features, True, g, reason)


def check_own_grids(formats: list[Format], processes: int = 1) -> None:
    """A format with grids of its own is written in a run of its own (its results are not the
    group grid every other format shares) and by one process (the ranks exchange group-grid
    results only)."""
    own = [f.name for f in formats if f.own_grids]
    if own and len(formats) > 1:
        raise CpuQuantError(f"--format {own[0]} quantizes every tensor on its own grid; write "
                            "it in a run of its own (not with "
                            + ", ".join(f.name for f in formats if f.name != own[0]) + ")")
    if own and processes > 1:
        raise CpuQuantError(f"--format {own[0]} is written by one process (not --nproc or "
                            "torchrun)")


def grid_format(formats: list[Format]) -> Format | None:
    """The (one) requested format with grids of its own, or None."""
    return next((f for f in formats if f.own_grids), None)


def on_format_grid(plan: LinearPlan, fmt: Format | None, source_config: dict,
                   calibrated: bool) -> LinearPlan:
    """``plan`` on the grid ``fmt`` stores its tensor on, when it has one."""
    if fmt is None or not plan.quantize:
        return plan
    grid = fmt.tensor_grid(plan.name, plan.in_features, source_config, calibrated)
    if grid is None:
        return plan
    return LinearPlan(plan.name, plan.in_features, plan.out_features, True, grid.block, "", grid)


def embedding_plan(name: str, hidden_size: int, vocab: int, fmt: Format | None,
                   source_config: dict, calibrated: bool) -> LinearPlan:
    """The embedding (module ``name``): quantized (round-to-nearest: a lookup table has no
    Hessian) only on a grid its format gives it; else kept as it is."""
    grid = None if fmt is None else fmt.tensor_grid(name, hidden_size, source_config, calibrated)
    if grid is None:
        return LinearPlan(name, hidden_size, vocab, False, -1, "the embedding stays bf16")
    return LinearPlan(name, hidden_size, vocab, True, grid.block, "", grid)


def _role(name: str) -> tuple[str, str | None]:
    """Split ``model.layers.7.mlp.up_proj`` into (``model.layers.{}.mlp.up_proj``, ``7``)."""
    m = re.search(r"\.(\d+)\.", name)
    if not m:
        return name, None
    return name[: m.start()] + ".{}." + name[m.end():], m.group(1)


def _alternatives(leaf: str) -> list[str]:
    """The leaf name plus the fused vLLM module it becomes part of, if any."""
    names = [leaf]
    for fused, parts in VLLM_FUSED.items():
        if leaf in parts:
            names.append(fused)
    return names


def dynamic_overrides(plans: list[LinearPlan], default_group: int) -> dict[str, dict]:
    """GPTQModel/vLLM ``dynamic`` rules for every module that differs from the default.

    Keys are ``re.match`` patterns over module names, written to match both the HF names
    (GPTQModel, transformers) and vLLM's fused names (``qkv_proj``, ``gate_up_proj``).
    ``+:`` rules override the group; ``-:`` rules leave a module unquantized.
    """
    by_role: dict[tuple[str, str], list[str | None]] = defaultdict(list)
    role_count: dict[str, int] = defaultdict(int)
    for p in plans:
        role, idx = _role(p.name)
        role_count[role] += 1
        if not p.quantize:
            by_role[(role, "-")].append(idx)
        elif p.group_size != default_group:
            by_role[(role, f"+{p.group_size}")].append(idx)
    merged: dict[tuple[str, str], set[str]] = defaultdict(set)
    for (role, kind), idxs in sorted(by_role.items()):
        prefix, _, leaf = role.rpartition(".")
        if "{}" in prefix:
            if len(idxs) == role_count[role]:
                layer_pat = r"\d+"
            else:
                layer_pat = "(?:" + "|".join(sorted(set(i for i in idxs if i), key=int)) + ")"
            head, _, tail = prefix.partition("{}")
            prefix_pat = re.escape(head) + layer_pat + re.escape(tail) + r"\."
        else:
            prefix_pat = re.escape(prefix) + r"\." if prefix else ""
        merged[(prefix_pat, kind)].update(_alternatives(leaf))
    rules: dict[str, dict] = {}
    for (prefix_pat, kind), leaves in merged.items():
        pattern = prefix_pat + "(?:" + "|".join(sorted(leaves)) + ")$"
        if kind == "-":
            rules["-:" + pattern] = {}
        else:
            rules["+:" + pattern] = {"group_size": int(kind[1:])}
    return rules




@dataclass(frozen=True)
class KeptPlan:
    """Modules of a vision-language checkpoint copied unchanged (bf16), and why."""

    prefix: str
    why: str
    tensors: int
    parameters: int


def plan_kept(family: VisionLanguageFamily | None, shapes: dict[str, tuple[int, ...]]
              ) -> list[KeptPlan]:
    """The kept modules of a vision-language ``family`` found among the checkpoint's tensors
    (name -> shape); none for any other model."""
    if family is None:
        return []
    kept = []
    for module in family.kept:
        names = [n for n in shapes if n.startswith(module.prefix)]
        if names:
            kept.append(KeptPlan(module.prefix, module.why, len(names),
                                 sum(math.prod(shapes[n]) for n in names)))
    return kept


def kept_rules(kept: list[KeptPlan]) -> dict[str, dict]:
    """Negative ``dynamic`` rules that leave the kept modules unquantized in vLLM and
    GPTQModel (these families' module names there are the checkpoint's)."""
    return {"-:" + re.escape(k.prefix): {} for k in kept}
