"""``verify --source SRC``: every quantized module read back and compared with the source weight.

verify's other checks read headers, shapes and small tensors; they cannot see a module whose
codes are another module's (k and v swapped), transposed, permuted or scaled absurdly. This
check dequantizes each quantized linear through its format (``SafetensorsFormat.dequantize``,
or ``Format.dequantized_modules`` for a format with its own container such as GGUF) and takes
the plain SNR against the source's weight, ``10 log10(sum W^2 / sum (W - W_hat)^2)`` in dB,
unweighted: verify has no calibration Hessian, and the quantizer's own report already gives the
Hessian-weighted figure.

Threshold, :data:`MIN_SNR_DB` = 6 dB (``findings.SOURCE_MIN_SNR_DB``). A correct 4-bit artifact
reads back at about 15-25 dB per module (16-20 dB on the tiny random test model at group 32),
GPTQ a dB or two below round-to-nearest since it trades weight error for output error. A wrongly
wired module is near or below 0 dB: two unrelated weights of the same scale give -3 dB (the
error has twice the signal's energy), a transposed or permuted matrix the same, scales x1000
about -60 dB. 6 dB leaves a margin of ~9 dB on the correct side and ~6 dB on the wrong side.

A module below the threshold is an error, and its cause is named where it can be told: the
weights of another source module of the same shape in the same layer (swapped), the transposed
source weight, or a magnitude far from the source's (the scales).

A vision-language artifact's kept tensors (its vision tower and projector) must equal the
source's bit for bit in bf16; any other is an error.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import CpuQuantError
from ..core.findings import SOURCE_MIN_SNR_DB as MIN_SNR_DB
from ..core.findings import Finding, error
from ..core.io.checkpoint import Checkpoint, check_float_weights, open_checkpoint
from ..core.naming import HEAD_NAME
from ..core.smoothing_factors import HEAD, SmoothedCheckpoint, load_factors, smoothed_source
from ..core.vision_language import family_of
from ..formats import format_for_quant_method, format_owning

WORST_SHOWN = 5


@dataclass
class ModuleSnr:
    module: str
    snr_db: float


def snr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    signal = float(w.double().pow(2).sum())
    noise = float((w.double() - w_hat.double()).pow(2).sum())
    if noise == 0.0:
        return math.inf
    if not math.isfinite(noise):
        return -math.inf
    return 10.0 * math.log10(max(signal, 1e-300) / noise)


def _artifact_modules(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    owner = format_owning(root)
    if owner is not None:
        yield from owner.dequantized_modules(root)
        return
    from .checks import load_quantization_config

    ckpt = open_checkpoint(root)
    try:
        qcfg = load_quantization_config(root, ckpt.config) or {}
        spec = format_for_quant_method(str(qcfg.get("quant_method", "")))
        if spec is None:
            raise CpuQuantError(f"{root} is not a quantized checkpoint verify can read")
        for module in spec.modules(ckpt):
            yield module, spec.dequantize(spec.read_tensors(ckpt, module), qcfg)
    finally:
        ckpt.close()


def _source_name(src: Checkpoint, module: str) -> str | None:
    names = set(src.names)
    if f"{module}.weight" in names:
        return f"{module}.weight"
    if module == HEAD_NAME:  # a tied head is the embedding
        return next((n for n in src.names if n.endswith("embed_tokens.weight")), None)
    return None


def _siblings(src: Checkpoint, name: str, shape: tuple[int, ...]) -> list[str]:
    """The other weights of the same shape in the same decoder layer (``...layers.<i>.``)."""
    parts = name.split(".")
    if "layers" not in parts:
        return []
    prefix = ".".join(parts[: parts.index("layers") + 2]) + "."
    return [n for n in src.names if n.startswith(prefix) and n != name and n.endswith(".weight")
            and tuple(src.shape(n)) == shape]


def _cause(src: Checkpoint, name: str, w: torch.Tensor, w_hat: torch.Tensor) -> str:
    for other in _siblings(src, name, tuple(w.shape)):
        if snr_db(src.tensor(other).float(), w_hat) >= MIN_SNR_DB:
            return f"it holds the weights of {other.removesuffix('.weight')} (swapped modules)"
    if w.shape[0] == w.shape[1] and snr_db(w.t(), w_hat) >= MIN_SNR_DB:
        return "it is the source weight transposed"
    ratio = float(w_hat.double().norm()) / max(float(w.double().norm()), 1e-30)
    if not math.isfinite(ratio) or ratio > 4 or ratio < 0.25:
        return f"its magnitude is {ratio:.3g}x the source's (wrong scales)"
    return "it matches no source weight of its shape (permuted, or another model's)"


def _open_source(source: str | Path) -> Checkpoint:
    """The source checkpoint, refused in one line when it cannot be the reference (unreadable,
    integer weights)."""
    try:
        src = open_checkpoint(source)
        check_float_weights(src)
    except CpuQuantError as exc:
        raise CpuQuantError(f"--source: {exc}") from None
    return src


def check_source(source: str | Path) -> None:
    """Refuse an unusable ``--source`` (see :func:`_open_source`) in one line."""
    _open_source(source).close()


def _source_weight(src: Checkpoint, name: str) -> torch.Tensor:
    """A source weight as float; a NaN or Inf in it is the source's fault, not the artifact's."""
    try:
        return src.tensor(name, check_finite=True).float()
    except CpuQuantError as exc:
        raise CpuQuantError(f"--source: {exc}") from None


def _kept_pairs(root: Path, src: Checkpoint) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(source name, the artifact's tensor or None) for every tensor the run kept unquantized
    (a vision-language model's vision tower and projector)."""
    family = family_of(src.config)
    if family is None:
        return
    kept = [n for n in src.names if family.kept_module(n)]
    owner = format_owning(root)
    if owner is not None:
        yield from owner.kept_tensors(root, src.config, kept)
        return
    art = open_checkpoint(root)
    try:
        names = set(art.names)
        for name in kept:
            yield name, art.tensor(name) if name in names else None
    finally:
        art.close()


def _compare_kept(root: Path, src: Checkpoint) -> tuple[list[Finding], int]:
    """(error findings, tensors compared): a vision-language artifact's kept tensors (vision
    tower, projector) against the source's, which they must equal bit for bit in bf16 (a
    format that stores one in float32 holds the same values)."""
    findings, compared = [], 0
    for name, got in _kept_pairs(root, src):
        compared += 1
        if got is None:
            findings.append(error("source", name, "kept unquantized in the source's model, but "
                                  "the artifact has no such tensor"))
            continue
        want = src.tensor(name).to(torch.bfloat16)
        same = got.shape == want.shape and (
            torch.equal(got.view(torch.int16), want.view(torch.int16))
            if got.dtype == torch.bfloat16 else torch.equal(got.float(), want.float()))
        if not same:
            findings.append(error("source", name, "kept unquantized, but not the source's "
                                  "tensor (bf16, bit for bit)"))
    return findings, compared


def compare_with_source(root: str | Path, source: str | Path) -> tuple[list[Finding], dict]:
    """(error findings, the JSON summary) of every quantized module of ``root`` against the
    weights of ``source``."""
    src = _open_source(source)
    results: list[ModuleSnr] = []
    findings: list[Finding] = []
    try:
        factors = load_factors(root)
        if factors is not None:  # a --smooth run quantized the source folded with these
            src = smoothed_source(src, factors, str(root))
        for module, w_hat in _artifact_modules(Path(root)):
            name = _source_name(src, module)
            if name is None:
                findings.append(error("source", module, f"the source {source} has no weight for it"))
                continue
            if module == HEAD_NAME and isinstance(src, SmoothedCheckpoint) and HEAD in src.changed:
                w = src.head_tensor(name, HEAD).float()
            else:
                w = _source_weight(src, name)
            if tuple(w_hat.shape) != tuple(w.shape):
                why = ("it is transposed" if tuple(w_hat.shape) == tuple(w.shape[::-1])
                       else f"the source's is {list(w.shape)}")
                findings.append(error("source", module, f"shape {list(w_hat.shape)}: {why}"))
                continue
            snr = snr_db(w, w_hat)
            results.append(ModuleSnr(module, snr))
            if snr < MIN_SNR_DB:
                findings.append(error("source", module, f"SNR {snr:.1f} dB against the source "
                                      f"(a correct 4-bit module gives >= {MIN_SNR_DB:g}): "
                                      f"{_cause(src, name, w, w_hat)}"))
        kept_findings, kept = _compare_kept(Path(root), src)
        findings += kept_findings
    finally:
        src.close()
    worst = sorted(results, key=lambda r: r.snr_db)[:WORST_SHOWN]
    finite = [r.snr_db for r in results if math.isfinite(r.snr_db)]
    summary = {
        "source": str(source), "metric": "snr_db", "weighting": "none",
        "threshold_db": MIN_SNR_DB, "modules": len(results),
        "min_db": round(min(finite), 2) if finite else None,
        "median_db": round(sorted(finite)[len(finite) // 2], 2) if finite else None,
        "worst": [{"module": r.module, "snr_db": round(r.snr_db, 2)} for r in worst],
    }
    if kept:  # a vision-language artifact: its vision tower and projector, copied unchanged
        summary["kept_tensors"] = kept
    if not results and not findings:
        findings.append(error("source", None, "the artifact holds no quantized module to compare"))
    return findings, summary
