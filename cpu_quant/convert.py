"""``convert``: any safetensors format to any other, through ``unpack``/``pack``, bit-exactly.

Every module is unpacked to its :class:`GroupQuant`, packed into the target format, unpacked
again and dequantized: the result must equal the source's dequantization bit for bit, or the
conversion is refused with the module and the reason (a zero the target cannot hold, a shape or
group its kernel does not take, a scale its dtype rounds). Everything is checked before anything
is written, and the output appears at ``dst`` only when complete. The sharding is kept, every
other tensor is copied, and ``quantization_config`` is the target format's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .core.errors import CpuQuantError
from .core.io.artifact import StagedOutput, check_destination, write_shard_index
from .core.io.checkpoint import open_checkpoint
from .formats.base import format_for_quant_method, get_format
from .formats.repack import repack_module
from .formats.safetensors import SafetensorsFormat, artifact_config
from .formats.sink import ArtifactInfo
from .verify.checks import config_unusable, damage, inconsistency


@dataclass
class ConvertReport:
    source: str
    output: str
    source_format: str
    target_format: str
    modules: int
    groups: dict[str, int] = field(default_factory=dict)  # group size -> modules

    def as_dict(self) -> dict:
        return asdict(self)


def _read_report(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError, RecursionError):  # RecursionError: nested too deeply
        raise CpuQuantError(f"{path}: not valid JSON; not converted") from None
    if not isinstance(data, dict):
        raise CpuQuantError(f"{path}: not a JSON object; not converted")
    return data


def _refuse_unverified(out: StagedOutput) -> None:
    """Run ``verify``'s self-consistency checks on the staged output: convert never writes what
    its own verify rejects (scales that disagree with the config's group, a non-finite scale, a
    bad dynamic rule). The architecture checks are left out: convert keeps the source's
    tensors, so their agreement with the config is the source's, and verify reports it."""
    why = inconsistency(out.staging)
    if why:
        raise CpuQuantError(f"the converted checkpoint fails verify ({why}); not converted")


def convert_checkpoint(src: str | Path, dst: str | Path, to: str, overwrite: bool = False
                       ) -> ConvertReport:
    check_destination(dst, [src], overwrite)
    ckpt = open_checkpoint(src)
    qcfg = ckpt.config.get("quantization_config") or {}
    if not isinstance(qcfg, dict):
        raise CpuQuantError(f"{ckpt.path}: quantization_config is not a JSON object")
    why = config_unusable(qcfg)
    if why:
        raise CpuQuantError(f"{ckpt.path}: {why}; not converted")
    for key, kind in (("quant_method", str), ("lm_head", bool)):
        if qcfg.get(key) is not None and not isinstance(qcfg[key], kind):
            raise CpuQuantError(f"{ckpt.path}: quantization_config.{key} is {qcfg[key]!r}, not "
                                f"{kind.__name__}; not converted")
    source = format_for_quant_method(qcfg.get("quant_method"))
    if source is None:
        raise CpuQuantError(f"{ckpt.path} is not a checkpoint of a format convert reads "
                            f"(quant_method {qcfg.get('quant_method')!r})")
    target = get_format(to)
    if not isinstance(target, SafetensorsFormat):
        raise CpuQuantError(f"convert writes safetensors formats; {to} is written by "
                            "`cpu-quant gptq --format` from the calibrated run")
    if int(qcfg.get("bits", 4)) != 4:
        raise CpuQuantError(f"only 4-bit checkpoints convert (bits {qcfg.get('bits')})")
    why = damage(ckpt.path)
    if why:
        raise CpuQuantError(f"{ckpt.path} fails verify ({why}); not converted")
    modules = source.modules(ckpt)
    if not modules:
        raise CpuQuantError(f"{ckpt.path} holds no quantized modules (no *.{source.marker} tensors)")
    symmetric = True
    groups: dict[str, int] = {}
    converted: dict[str, dict[str, torch.Tensor]] = {}
    for m in modules:
        try:
            gq, converted[m] = repack_module(source, target, source.read_tensors(ckpt, m), qcfg, m)
        except CpuQuantError as exc:
            raise CpuQuantError(f"{exc}; not converted") from None
        symmetric = symmetric and gq.zeros is None
        groups[str(gq.group_size)] = groups.get(str(gq.group_size), 0) + 1

    owned = {f"{m}.{s}" for m in modules for s in source.suffixes}
    by_file: dict[Path, list[str]] = {}
    for name, file in ckpt.files.items():
        by_file.setdefault(file, []).append(name)
    shard_names: dict[str, list[str]] = {}
    total = 0
    with StagedOutput(dst, overwrite=overwrite, sources=[src]) as out:
        for file, names in sorted(by_file.items()):
            tensors: dict[str, torch.Tensor] = {}
            for name in names:
                if name.endswith("." + source.marker) and name[: -len(source.marker) - 1] in converted:
                    m = name[: -len(source.marker) - 1]
                    tensors.update({f"{m}.{k}": v for k, v in converted[m].items()})
                elif name not in owned:
                    tensors[name] = ckpt.tensor(name)
            out.write_tensors(file.name, tensors)
            shard_names[file.name] = sorted(tensors)
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        write_shard_index(out, shard_names, total)
        extra = {k: qcfg[k] for k in ("quantizer", "damp_percent", "cpu_quant") if k in qcfg}
        extra["converted_from"] = source.name
        info = ArtifactInfo(ckpt.path, ckpt.config, int(qcfg.get("group_size", 128)),
                            bool(qcfg.get("lm_head", False)), dict(qcfg.get("dynamic") or {}),
                            symmetric, extra)
        config = artifact_config(ckpt.config, target.quantization_config(info), False)
        out.write_json("config.json", config)
        out.copy_tokenizer_files(ckpt.path)
        report = ConvertReport(str(ckpt.path), str(out.dst), source.name, target.name,
                               len(modules), groups)
        report_src = ckpt.path / "quantization_report.json"
        if report_src.is_file():
            data = _read_report(report_src)
            data["layout"] = target.name
            data["converted"] = report.as_dict()
            out.write_json("quantization_report.json", data)
        _refuse_unverified(out)
        final = out.commit()
    ckpt.close()
    report.output = str(final)
    return report
