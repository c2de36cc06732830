"""The GPTQ checkpoint layout that vLLM's GPTQ loader (and GPTQModel, transformers/optimum) read.

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
(see ``quantize/grid.py``).
"""

from __future__ import annotations

import torch

from .grid import QZERO, GroupQuant

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


class GPTQLayout:
    """The layout object the quantization pipeline writes through."""

    name = "gptq"
    symmetric = True

    def module_tensors(self, module: str, gq: GroupQuant) -> dict[str, torch.Tensor]:
        return {f"{module}.{k}": v for k, v in gptq_module_tensors(gq).items()}

    def quantization_config(self, group_size: int, head_quantized: bool,
                            dynamic: dict[str, dict], extra: dict) -> dict:
        return gptq_quantization_config(group_size, head_quantized, dynamic, extra)
