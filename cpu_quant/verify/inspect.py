"""A human summary of a quantized (or bf16) checkpoint.

``inspect_checkpoint(DIR)`` reads the safetensors headers, and of an unquantized checkpoint
sampled rows of its linears. It reports:

* the format (``gptq`` with its ``checkpoint_format``, ``cpu_int4``, or unquantized), bits,
  default group and the number of ``dynamic`` rules;
* bits per weight over the quantized linears, two ways (the convention of
  ``shared/MEASURING.md``): *effective* counts the 4-bit codes, one scale per group and a zero
  per group only where the zero is free (``cpu_int4`` asymmetric; a symmetric zero is pinned
  and costs nothing), so group 128 with bf16 scales is 4.125; *on disk* divides every byte of
  the quantized tensors (packed codes, scales, ``qzeros``, ``g_idx``) by the weight count;
* tensors grouped by kind and dtype (count and bytes). Kinds come from the name: the format's
  tensor suffixes, ``embedding`` (the input embedding), ``head`` (``lm_head.weight``),
  ``linear (unquantized)`` for other 2-D ``.weight`` tensors, ``vector`` for 1-D weights
  (norms), ``bias`` and ``other``;
* the head and embedding state, total tensor bytes against the same model in bf16, and the
  headline of ``quantization_report.json`` when present;
* of an unquantized checkpoint, the quantization grid its linears already sit on
  (``core/source_grid.py``): a model that was stored as a GGUF quantization and dequantized
  keeps that grid, and a method on the same grid recovers it almost exactly.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.errors import CpuQuantError
from ..core.io.checkpoint import open_checkpoint
from ..core.naming import HEAD_NAME
from ..core.source_grid import checkpoint_grid
from ..core.vision_language import family_of
from ..formats import format_owning
from .checks import (
    DTYPE_BYTES,
    config_unusable,
    format_for,
    load_quantization_config,
    module_params,
    quant_modules,
    tensor_bytes,
)

SCHEMA = "cpu-quant.inspect/1"


@dataclass
class KindRow:
    kind: str
    dtype: str
    count: int
    bytes: int


@dataclass
class InspectReport:
    path: str
    format: str  # gptq | cpu_int4 | unquantized | <other quant_method>
    checkpoint_format: str | None
    bits: int | None
    group_size: int | None
    sym: bool | None
    dynamic_rules: int
    quantized_linears: int
    quantized_weights: int
    bits_per_weight: float | None
    bits_per_weight_on_disk: float | None
    kinds: list[KindRow]
    head: str
    embedding: str
    total_bytes: int
    bf16_bytes: int
    report: dict | None = None
    files: int = 0
    notes: list[str] = field(default_factory=list)
    # an unquantized checkpoint: the quantization grid its linears already sit on
    source_grid: dict | None = None
    # a vision-language checkpoint: the modules kept unquantized (prefix, tensors, bytes,
    # dtypes, quantized modules among them, why)
    kept: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}

    def lines(self) -> list[str]:
        mb = 1e6
        fmt = self.format + (f" ({self.checkpoint_format})" if self.checkpoint_format else "")
        out = [f"checkpoint   {self.path} ({self.files} safetensors files)", f"format       {fmt}"]
        if self.bits is not None:
            out.append(f"quantization {self.bits}-bit, group {self.group_size}, sym {self.sym}, "
                       f"{self.dynamic_rules} dynamic rule(s)")
            out.append(f"linears      {self.quantized_linears} quantized "
                       f"({self.quantized_weights / 1e6:.1f} M weights)")
            if self.bits_per_weight is not None:
                out.append(f"bits/weight  {self.bits_per_weight:.3f} effective (codes + scales"
                           f" + free zeros), {self.bits_per_weight_on_disk:.3f} on disk")
        out.append(f"head         {self.head}")
        out.append(f"embedding    {self.embedding}")
        ratio = self.total_bytes / self.bf16_bytes if self.bf16_bytes else 0.0
        out.append(f"size         {self.total_bytes / mb:.1f} MB of tensors, "
                   f"{ratio:.3f}x the {self.bf16_bytes / mb:.1f} MB of the same model in bf16")
        out.append("tensors      kind                   dtype   count        MB")
        for row in self.kinds:
            out.append(f"             {row.kind:<22} {row.dtype:<6} {row.count:>6} "
                       f"{row.bytes / mb:>9.2f}")
        if self.source_grid is not None:
            out.append(f"source grid  {self.source_grid['summary']} (rows sampled, blocks of "
                       f"{self.source_grid['block']})")
        for k in self.kept:
            out.append(f"kept         {k['prefix']}* {k['tensors']} tensors, "
                       f"{k['bytes'] / mb:.2f} MB {'/'.join(k['dtypes'])}, "
                       f"{k['quantized']} quantized: {k['why']}")
        if self.report:
            out.append("report       " + ", ".join(f"{k}={v}" for k, v in self.report.items()))
        out.extend(f"note         {n}" for n in self.notes)
        return out


def _kept_modules(ckpt, modules: dict) -> list[dict]:
    """A vision-language checkpoint's modules that cpu-quant keeps unquantized, as stored."""
    family = family_of(ckpt.config)
    rows = []
    for kept in family.kept if family else ():
        names = [n for n in ckpt.names if n.startswith(kept.prefix)]
        rows.append({"prefix": kept.prefix, "tensors": len(names),
                     "bytes": sum(tensor_bytes(ckpt, n) for n in names),
                     "dtypes": sorted({ckpt.dtype(n) for n in names}),
                     "quantized": sum(m.startswith(kept.prefix) for m in modules),
                     "why": kept.why})
    return rows


def _kind(name: str, suffixes: tuple[str, ...], ndim: int, head: str) -> str:
    module, _, leaf = name.rpartition(".")
    if leaf in suffixes:
        return leaf
    if leaf == "bias":
        return "bias"
    if leaf == "weight" and ndim == 2:
        if module == head:
            return "head"
        if "embed" in module or module.endswith("wte"):
            return "embedding"
        return "linear (unquantized)"
    if leaf == "weight" and ndim == 1:
        return "vector (norm)"
    return "other"


def _report_headline(root: Path) -> dict | None:
    path = root / "quantization_report.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json recurses
        return {"error": "quantization_report.json is not valid JSON"}
    if not isinstance(data, dict):
        return {"error": "quantization_report.json is not a JSON object"}
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
    head: dict = {
        "layout": data.get("layout"),
        "method": settings.get("method"),
        "group_size": settings.get("group_size"),
        "head_quantized": data.get("head_quantized"),
        "bits_per_weight": data.get("bits_per_weight"),
        "total_seconds": data.get("total_seconds"),
    }
    tensors = data.get("tensors") if isinstance(data.get("tensors"), list) else []
    snrs = [t.get("weighted_snr_db") for t in tensors if isinstance(t, dict)]
    snrs = [s for s in snrs if isinstance(s, int | float) and not isinstance(s, bool)]
    if snrs:
        head["worst_weighted_snr_db"] = min(snrs)
    if data.get("fidelity"):
        head["fidelity"] = data["fidelity"]
    if isinstance(data.get("plan_notes"), list) and data["plan_notes"]:
        head["plan_notes"] = len(data["plan_notes"])
    return {k: v for k, v in head.items() if v is not None}


@dataclass
class FormatSummary:
    """The summary of an artifact whose format has its own container (``Format.owns``)."""

    path: str
    format: str
    summary: dict

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "path": self.path, "format": self.format, **self.summary}

    def lines(self) -> list[str]:
        rows = [("artifact", self.path), ("format", self.format)]
        rows += [(k.replace("_", " "), v if isinstance(v, str) else json.dumps(v))
                 for k, v in self.summary.items()]
        width = max(len(k) for k, _ in rows)
        return [f"{k:<{width}}  {v}" for k, v in rows]


def inspect_checkpoint(path: str | Path) -> InspectReport | FormatSummary:
    root = Path(path)
    owner = format_owning(root)
    if owner is not None:
        return FormatSummary(str(root), owner.name, owner.inspect_artifact(root))
    ckpt = open_checkpoint(root)
    try:
        qcfg = load_quantization_config(root, ckpt.config) or {}
        spec = format_for(str(qcfg.get("quant_method", "")))
        method = str(qcfg.get("quant_method") or "unquantized")
        why = config_unusable(qcfg) if spec else None
        if why:
            raise CpuQuantError(f"{root}: {why}; `cpu-quant verify` lists what is wrong")
        modules = quant_modules(ckpt.names, spec) if spec else {}
        suffixes = spec.suffixes if spec else ()
        notes: list[str] = []

        rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        total = 0
        bf16 = 0
        quant_tensors = {t for m in modules.values() for t in m.tensors.values()}
        for name in ckpt.names:
            shape, dtype = ckpt.shape(name), ckpt.dtype(name)
            nbytes = tensor_bytes(ckpt, name)
            row = rows[(_kind(name, suffixes, len(shape), HEAD_NAME), dtype)]
            row[0] += 1
            row[1] += nbytes
            total += nbytes
            if name not in quant_tensors:
                numel = nbytes // DTYPE_BYTES.get(dtype, 1)
                bf16 += 2 * numel if dtype in ("F16", "BF16", "F32", "F64") else nbytes

        weights = 0
        bits_eff = 0.0
        bits_disk = 0
        for mod in modules.values():
            marker = mod.tensors.get(spec.marker)
            params = module_params(qcfg, mod.name)
            if marker is None or params is None or params.bits not in spec.bits:
                notes.append(f"{mod.name}: incomplete or unexpected; run cpu-quant verify")
                continue
            n, k = spec.dims_from_marker(ckpt.shape(marker), params.bits)
            g = k if params.group_size == -1 else params.group_size
            groups = k // g if g > 0 else 0
            scale_name = mod.tensors.get(spec.scales_suffix)
            scale_bits = 8 * DTYPE_BYTES.get(ckpt.dtype(scale_name), 2) if scale_name else 16
            free_zero = spec.limits.stores_zeros and not params.sym
            weights += n * k
            bits_eff += n * k * params.bits + n * groups * scale_bits * (2 if free_zero else 1)
            bits_disk += 8 * sum(tensor_bytes(ckpt, t) for t in mod.tensors.values())
            bf16 += 2 * n * k

        head_module = HEAD_NAME
        text = ckpt.config.get("text_config") if isinstance(ckpt.config.get("text_config"),
                                                             dict) else ckpt.config
        embed = next((n for n in ckpt.names if n.endswith("embed_tokens.weight")), None)
        if head_module in modules:
            p = module_params(qcfg, head_module)
            head = f"quantized {spec.name} (group {p.group_size if p else '?'})"
        elif f"{head_module}.weight" in ckpt.names:
            w = f"{head_module}.weight"
            head = f"{ckpt.dtype(w)} {list(ckpt.shape(w))} ({w}, unquantized)"
        elif text.get("tie_word_embeddings", True) and embed:
            head = f"tied to {embed} ({ckpt.dtype(embed)}, unquantized)"
        else:
            head = "missing (no lm_head tensors and tie_word_embeddings is false)"
        embedding = f"{ckpt.dtype(embed)} {list(ckpt.shape(embed))} ({embed})" if embed else \
            "not found (no *embed_tokens.weight)"

        return InspectReport(
            path=str(root),
            format=spec.name if spec else method,
            checkpoint_format=spec.checkpoint_format(qcfg) if spec else None,
            bits=qcfg["bits"] if spec and "bits" in qcfg else None,
            group_size=qcfg.get("group_size") if spec else None,
            sym=qcfg.get("sym") if spec else None,
            dynamic_rules=len(qcfg.get("dynamic") or {}) if spec else 0,
            quantized_linears=len(modules),
            quantized_weights=weights,
            bits_per_weight=round(bits_eff / weights, 4) if weights else None,
            bits_per_weight_on_disk=round(bits_disk / weights, 4) if weights else None,
            kinds=[KindRow(k, d, c, b) for (k, d), (c, b) in sorted(rows.items())],
            head=head,
            embedding=embedding,
            total_bytes=total,
            bf16_bytes=bf16,
            report=_report_headline(root),
            files=len(ckpt.headers),
            notes=notes,
            source_grid=None if spec else checkpoint_grid(ckpt).to_json(),
            kept=_kept_modules(ckpt, modules),
        )
    finally:
        ckpt.close()
