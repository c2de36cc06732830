"""``gptq``: the GPTQ checkpoint layout that vLLM's GPTQ loader (and GPTQModel, transformers/optimum) read.

Per quantized linear ``<m>`` with out-features ``N``, in-features ``K`` and group ``g``
(``g = K`` when the config says ``-1``), four tensors:

=============  =========  ===============  ==================================================
tensor         dtype      shape            content
=============  =========  ===============  ==================================================
``qweight``    int32      [K/8, N]         codes packed along K: bits ``4j..4j+3`` of
                                           ``qweight[r, n]`` hold ``q[n, 8r + j]`` (j = 0..7,
                                           lowest nibble first). ``q ∈ [0, 15]``.
``qzeros``     int32      [K/g, N/8]       zero points packed along N the same way: nibble
                                           ``j`` of ``qzeros[i, c]`` is the zero of output
                                           channel ``8c + j`` in group ``i``.
``scales``     bfloat16   [K/g, N]         ``scales[i, n]`` for group ``i`` of channel ``n``.
``g_idx``      int32      [K]              ``g_idx[k] = k // g`` (always trivial: no
                                           act-order in the saved layout).
=============  =========  ===============  ==================================================

Dequantization: ``w[n, k] = (q[n, k] - z) * scales[k // g, n]`` with ``z = 8`` (symmetric).

**Zero storage: v1** (``checkpoint_format: "gptq"``). The v1 convention, from AutoGPTQ, stores
``z - 1``: every nibble of ``qzeros`` is 7, so every word is ``0x77777777``. v2
(``"gptq_v2"``) stores ``z`` itself (8). We write v1 because it is what every consumer reads
without conversion: vLLM's ``uint4b8`` type and ``int4_scaled_mm_cpu`` ignore ``qzeros`` and
hard-wire 8; GPTQModel and transformers/optimum read v1 by default and convert internally. The
reader below honours both conventions, so foreign checkpoints dequantize correctly too.

Scales are bf16, the model's dtype: vLLM casts scales to the model dtype at load, so fp16 scales
would be rounded a second time and its weights would differ from ours. Scales may be negative
(see ``core/grid.py``).

Limits (what the plan asks): groups 128, 64, 32 and -1 (one group per row); in- and
out-features multiples of 32 (``cpu_gemm_wna16``); symmetric only. ``verify`` checks the tensor
specs below, the zero convention against ``checkpoint_format`` and that ``g_idx`` is trivial.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...core.errors import CpuQuantError
from ...core.grid import QZERO, GroupQuant
from ..base import Limits, Serving, TensorSpec
from ..safetensors import SafetensorsFormat
from ..sink import ArtifactInfo
from . import serving as gptq_serving

if TYPE_CHECKING:
    from ...core.cpu import CpuFacts

BITS = 4
PACK = 32 // BITS
FORMAT_V1 = "gptq"
FORMAT_V2 = "gptq_v2"
TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def _pack_rows_int32(values: torch.Tensor) -> torch.Tensor:
    """Pack int values [R, C] (0..15) along R: out [R/8, C] int32, nibble j = row 8r+j."""
    r, c = values.shape
    if r % PACK:
        raise ValueError(f"cannot pack {r} rows in groups of {PACK}")
    v = values.reshape(r // PACK, PACK, c)
    # one nibble plane at a time, in int32 (a shift into the sign bit wraps, which is the bit
    # pattern wanted): the working set stays at the output's size, where an int64 [R, C]
    # expansion of the output head took 4x the codes' bytes twice over
    packed = torch.zeros(r // PACK, c, dtype=torch.int32)
    for j in range(PACK):
        packed |= v[:, j, :].to(torch.int32) << (BITS * j)
    return packed


def _unpack_rows_int32(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_rows_int32`: [R/8, C] int32 -> [R, C] int64 (0..15)."""
    rp, c = packed.shape
    p = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = (torch.arange(PACK, dtype=torch.int64) * BITS).view(1, PACK, 1)
    return ((p.unsqueeze(1) >> shifts) & 0xF).reshape(rp * PACK, c)


def pack_gptq_qweight(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] -> qweight int32 [K/8, N]."""
    return _pack_rows_int32(codes.t())


def unpack_gptq_qweight(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> codes [N, K] (int64)."""
    return _unpack_rows_int32(qweight).t()


def pack_gptq_qzeros(zeros: torch.Tensor) -> torch.Tensor:
    """zero codes [G, N] (as stored: z-1 for v1) -> qzeros int32 [G, N/8]."""
    return _pack_rows_int32(zeros.t()).t().contiguous()


def unpack_gptq_qzeros(qzeros: torch.Tensor) -> torch.Tensor:
    """qzeros int32 [G, N/8] -> stored zero codes [G, N]."""
    return _unpack_rows_int32(qzeros.t().contiguous()).t()


def gptq_module_tensors(gq: GroupQuant) -> dict[str, torch.Tensor]:
    """One symmetric quantization result in the v1 GPTQ layout (suffix -> tensor)."""
    if gq.zeros is not None:
        raise ValueError("the GPTQ layout for vLLM's CPU kernels is symmetric (zero pinned at 8)")
    n, k = gq.codes.shape
    n_groups = k // gq.group_size
    stored_zero = torch.full((n_groups, n), QZERO - 1, dtype=torch.int64)  # v1: z - 1
    return {
        "qweight": pack_gptq_qweight(gq.codes).contiguous(),
        "qzeros": pack_gptq_qzeros(stored_zero),
        "scales": gq.scales.t().to(torch.bfloat16).contiguous(),
        "g_idx": (torch.arange(k, dtype=torch.int32) // gq.group_size).contiguous(),
    }


def zero_offset(checkpoint_format: str) -> int:
    """What to add to a stored zero to get the real one: 1 for v1, 0 for v2."""
    if checkpoint_format in (FORMAT_V1, "", None):
        return 1
    if checkpoint_format == FORMAT_V2:
        return 0
    raise ValueError(f"unknown GPTQ checkpoint_format {checkpoint_format!r}")


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, checkpoint_format: str = FORMAT_V1
                    ) -> torch.Tensor:
    """Reference dequantization of one 4-bit GPTQ module to float32 [N, K].

    Honours ``qzeros`` (v1 or v2) and ``g_idx``: a faithful reading of what is on disk. (vLLM's
    CPU path reads ``z = 8`` and ``g_idx = k // g`` instead, which agrees for our checkpoints.)
    """
    codes = unpack_gptq_qweight(qweight)  # [N, K]
    n, k = codes.shape
    zeros = unpack_gptq_qzeros(qzeros) + zero_offset(checkpoint_format)  # [G, N]
    if g_idx is None:
        g_idx = torch.arange(k) // (k // scales.shape[0])
    g = g_idx.to(torch.int64)
    s = scales.to(torch.float32)[g].t()  # [N, K]
    z = zeros[g].t().to(torch.float32)  # [N, K]
    return (codes.to(torch.float32) - z) * s


def gptq_quantization_config(group_size: int, lm_head: bool, dynamic: dict[str, dict],
                             extra: dict | None = None) -> dict:
    cfg = {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": group_size,
        "sym": True,
        "desc_act": False,
        "static_groups": False,
        "true_sequential": False,
        "checkpoint_format": FORMAT_V1,
        "lm_head": lm_head,
        "dynamic": dynamic,
        "pack_dtype": "int32",
        "damp_percent": 0.01,
        "quantizer": ["cpu-quant"],
    }
    cfg.update(extra or {})
    return cfg


class GPTQFormat(SafetensorsFormat, name="gptq"):
    quant_methods = ("gptq", "auto_gptq")
    vllm_patches = (f"{__package__}.vllm_kernel",)  # symmetric layers on tinygemm
    summary = "vLLM"
    legacy_config_file = "quantize_config.json"  # AutoGPTQ's, beside config.json
    probe_rules = gptq_serving.PROBE_RULES

    def serving(self, target: Path) -> Serving:
        return gptq_serving.serving(target)

    def unservable_here(self, facts: CpuFacts, target: Path) -> str | None:
        return gptq_serving.unservable_here(facts, target)

    def refuse_source(self, source_config: dict) -> str | None:
        return gptq_serving.refuse_experts(source_config)
    limits = Limits(groups=(128, 64, 32), row_group=True, k_multiple=32, n_multiple=32,
                    stores_zeros=False,
                    kernel="vLLM's CPU kernels (cpu_gemm_wna16 / int4_scaled_mm_cpu)")
    tensors = (
        TensorSpec("qweight", ("I32",), lambda n, k, g, b: (k * b // 32, n)),
        TensorSpec("qzeros", ("I32",), lambda n, k, g, b: (g, n * b // 32)),
        TensorSpec("scales", ("F16", "BF16", "F32"), lambda n, k, g, b: (g, n)),
        TensorSpec("g_idx", ("I32",), lambda n, k, g, b: (k,)),
    )
    marker = "qweight"
    scales_suffix, scales_group_axis = "scales", 0
    head_kernel = "the W4A8 kernel (int4_scaled_mm_cpu)"

    def dims_from_marker(self, shape: tuple[int, ...], bits: int) -> tuple[int, int]:
        return shape[1], shape[0] * 32 // bits

    def pack(self, gq: GroupQuant, module: str = "module") -> dict[str, torch.Tensor]:
        return gptq_module_tensors(gq)

    def unpack(self, tensors: dict[str, torch.Tensor], qcfg: dict, module: str = "module"
               ) -> GroupQuant:
        """The stored codes and scales; zeros other than 8 become the grid's float zeros
        ``(8 - z) * s`` (exact in float32). An act-order ``g_idx`` has no group layout and is
        refused."""
        codes = unpack_gptq_qweight(tensors["qweight"]).to(torch.uint8)
        n, k = codes.shape
        scales = tensors["scales"].to(torch.float32)
        groups = scales.shape[0]
        if groups == 0 or k % groups:
            raise CpuQuantError(f"{module}: {groups} scale groups do not divide the in-features {k}")
        g = k // groups
        g_idx = tensors.get("g_idx")
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(k) // g):
            raise CpuQuantError(f"{module}: g_idx is not k // {g} (act-order), so its groups are "
                                "not contiguous")
        try:
            offset = zero_offset(qcfg.get("checkpoint_format", FORMAT_V1))
        except ValueError as exc:
            raise CpuQuantError(str(exc)) from None
        z = (unpack_gptq_qzeros(tensors["qzeros"]) + offset).t().to(torch.float32)  # [N, G]
        s = scales.t().contiguous()
        if qcfg.get("sym", True) is not False:
            if not bool((z == QZERO).all()):
                raise CpuQuantError(f"{module}: qzeros are not all {QZERO} although sym is true: "
                                    "the checkpoint is inconsistent")
            return GroupQuant(codes, s, None, g)
        return GroupQuant(codes, s, (QZERO - z) * s, g)

    def dequantize(self, tensors: dict[str, torch.Tensor], qcfg: dict) -> torch.Tensor:
        if int(qcfg.get("bits", 4)) != 4:
            raise CpuQuantError(f"only 4-bit GPTQ is supported (config says {qcfg.get('bits')})")
        return dequantize_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"],
                               tensors.get("g_idx"), qcfg.get("checkpoint_format", FORMAT_V1))

    def quantization_config(self, info: ArtifactInfo) -> dict:
        return gptq_quantization_config(info.default_group, info.head_quantized, info.dynamic,
                                        info.extra)

    def checkpoint_format(self, qcfg: dict) -> str | None:
        return checkpoint_format(qcfg)

    def config_findings(self, q: dict):
        from ...core.findings import error, warning

        if q.get("sym") is False:
            yield error("config", None, "sym is false: vLLM's GPTQ path takes only symmetric "
                        "4-bit (uint4b8, zero pinned at 8) and its CPU kernels ignore qzeros")
        fmt = checkpoint_format(q)
        if fmt not in (FORMAT_V1, FORMAT_V2):
            yield error("config", None, f"checkpoint_format {fmt!r} is neither 'gptq' (v1) nor "
                        "'gptq_v2': consumers would misread the packed tensors")
        if q.get("format") and q.get("checkpoint_format") and q["format"] != q["checkpoint_format"]:
            yield warning("config", None, f"format {q['format']!r} and checkpoint_format "
                          f"{q['checkpoint_format']!r} disagree; consumers read checkpoint_format")
        pack = str(q.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack != "int32":
            yield error("config", None, f"pack_dtype {pack}: vLLM reads GPTQ tensors packed in "
                        "int32")
        group = q.get("group_size", -1)
        if q.get("desc_act") and group != -1:
            yield error("config", None, "desc_act is true (act-order): vLLM rejects act-order "
                        "GPTQ checkpoints, and its CPU path drops g_idx, so the groups would be "
                        "read wrong")
        for pattern, override in (q.get("dynamic") or {}).items():
            if pattern.startswith("-:") or not isinstance(override, dict):
                continue
            if override.get("sym") is False:
                yield error("config", None, f"dynamic rule {pattern!r} sets sym false, which "
                            "vLLM's GPTQ path does not take")
            if override.get("desc_act") and override.get("group_size", group) != -1 \
                    and _compiles(pattern.removeprefix("+:")):
                yield error("config", None, f"dynamic rule {pattern!r} enables desc_act, which "
                            "vLLM rejects")

    def module_findings(self, ctx):
        yield from _zero_convention_findings(self, ctx)
        yield from _g_idx_findings(ctx)


def _compiles(pattern: str) -> bool:
    """Is ``pattern`` a regex (verify's generic checks report the ones that are not)?"""
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def checkpoint_format(qcfg: dict) -> str:
    return str(qcfg.get("checkpoint_format") or qcfg.get("format") or FORMAT_V1)


def _zero_convention_findings(fmt: GPTQFormat, ctx):
    """v1 stores zero-1 (7 for sym 4-bit), v2 the zero (8); checked against the config."""
    from collections import defaultdict

    from ...core.findings import error, info

    q = ctx.qcfg
    declared_fmt = checkpoint_format(q)
    declared = {FORMAT_V1: "v1", FORMAT_V2: "v2"}.get(declared_fmt)
    ctx.report.checkpoint_format = declared_fmt
    by_value: dict[str, list[str]] = defaultdict(list)
    asym: list[tuple[str, int, int]] = []
    qzeros_spec = fmt.tensor_spec("qzeros")
    for mod in ctx.modules.values():
        tname = mod.tensors.get("qzeros")
        if tname is None or mod.params is None or mod.groups is None or mod.params.bits != 4 \
                or ctx.ckpt.shape(tname) != qzeros_spec.shape(mod.n, mod.k, mod.groups, 4):
            continue  # shape/completeness findings already cover it
        stored = torch.unique(unpack_gptq_qzeros(ctx.ckpt.tensor(tname)))
        if not mod.params.sym:
            asym.append((tname, int(stored.min()), int(stored.max())))
        elif stored.numel() == 1:
            by_value[str(int(stored))].append(tname)
        else:
            by_value["varying"].append(tname)
    if asym and not by_value:
        ctx.report.zero_convention = "asymmetric"
        lo, hi = min(a[1] for a in asym), max(a[2] for a in asym)
        yield info("zero-convention", asym[0][0], f"asymmetric zeros (stored {lo}..{hi}) in "
                   f"{len(asym)} modules: the convention cannot be read from the values; "
                   f"taken from checkpoint_format {declared_fmt!r}")
        return
    if not by_value:
        return
    detected = {"7": "v1", "8": "v2"}
    kinds = {detected.get(v, "other") for v in by_value}
    ctx.report.zero_convention = kinds.pop() if len(kinds) == 1 else "mixed"
    if ctx.report.zero_convention == "other":
        ctx.report.zero_convention = "mixed"
    total = sum(len(v) for v in by_value.values())
    for value, tensors in sorted(by_value.items()):
        where = f"{len(tensors)} of {total} modules"
        conv = detected.get(value)
        if conv is None:
            what = "values that are not constant" if value == "varying" else f"zero {value}"
            yield error("zero-convention", tensors[0], f"qzeros store {what} in {where}, but "
                        "sym is true: every stored zero must be 7 (v1) or 8 (v2); the checkpoint "
                        "was quantized asymmetrically or is corrupt")
        elif declared is not None and conv != declared:
            real = int(value) + (1 if declared == "v1" else 0)
            yield error("zero-convention", tensors[0], f"qzeros store {value} (the {conv} "
                        f"convention) in {where}, but checkpoint_format is {declared_fmt!r} "
                        f"({declared}): GPTQModel and transformers would dequantize with zero "
                        f"{real} instead of 8, the v1/v2 off-by-one (vLLM #26343); vLLM's CPU "
                        "path ignores qzeros and hides it")
        else:
            yield info("zero-convention", tensors[0], f"{conv} zeros (every stored nibble "
                       f"{value}) in {where}, matching checkpoint_format {declared_fmt!r}")


def _g_idx_findings(ctx):
    from ...core.findings import error

    for mod in ctx.modules.values():
        tname = mod.tensors.get("g_idx")
        if tname is None or mod.groups is None or ctx.ckpt.shape(tname) != (mod.k,):
            continue
        g_idx = ctx.ckpt.tensor(tname).to(torch.int64)
        trivial = torch.arange(mod.k, dtype=torch.int64) // (mod.k // mod.groups)
        if torch.equal(g_idx, trivial):
            continue
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= mod.groups:
            yield error("g_idx", tname, f"values {int(g_idx.min())}..{int(g_idx.max())} outside "
                        f"the {mod.groups} groups")
        else:
            yield error("g_idx", tname, "not trivial (g_idx[k] != k // group): an act-order "
                        "checkpoint; vLLM's CPU path drops g_idx and would read the groups wrong")
