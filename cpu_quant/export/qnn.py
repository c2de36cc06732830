"""Phone-NPU programs: w8a16 with ExecuTorch's Qualcomm quantizer, calibrated on real text.

Scheme ``w8a16`` (``QnnQuantizer``, ``QuantDtype.use_16a8w``):

* weights: int8 symmetric, one scale per output channel (linears, the head included) and per
  row (the embedding table);
* activations: uint16 affine, one (scale, zero point) per tensor, from ``MinMaxObserver``s
  (16 bits leave enough resolution to cover the full observed range, so nothing is clipped);
* the ranges are calibrated by running the prepared prefill and decode graphs through the same
  host loop the program uses (``runner.StaticKVRunner``), on calibration text only.

What is written (``QNN_SDK_ROOT`` unset, which is the case on any machine without Qualcomm's SDK):

* ``qnn_prefill.pt2`` / ``qnn_decode.pt2``: the calibrated, converted programs
  (``torch.export.save``; reference q/dq ops ``quantized_decomposed.*`` with int8 weights and
  the calibrated activation encodings). These are what the QNN lowering consumes. Load them
  after ``import torchao.quantization.pt2e.quantize_pt2e``, which registers those ops.
* ``model.pte``: the same program for ExecuTorch's portable CPU kernels (q/dq executed as ops),
  which is what verification runs; it proves the calibrated program, not the HTP.

With ``QNN_SDK_ROOT`` set, ``lower_to_qnn`` partitions the converted graphs with
``QnnPartitioner`` into an HTP ``.pte``. That path needs the SDK's libraries and cannot run
here; it is written against executorch 1.5.1's
``backends/qualcomm/utils/utils.py:to_edge_transform_and_lower_to_qnn``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import CpuQuantError
from .graph import GraphShape
from .model import export_methods
from .runner import StaticKVRunner

QNN_SCHEMES = ("w8a16", "16a4w")
DEFAULT_SOC = "SM8650"


def qnn_sdk_root() -> Path | None:
    root = os.environ.get("QNN_SDK_ROOT")
    return Path(root) if root else None


@contextlib.contextmanager
def _no_sdk_download():
    """executorch sets up (downloads) Qualcomm's SDK when QNN_SDK_ROOT is unset; an empty value
    tells it the caller is in charge. We only ever fetch from package registries."""
    if "QNN_SDK_ROOT" in os.environ:
        yield
        return
    os.environ["QNN_SDK_ROOT"] = ""
    try:
        yield
    finally:
        os.environ.pop("QNN_SDK_ROOT", None)


def make_quantizer(scheme: str = "w8a16"):
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
    from torchao.quantization.pt2e import MinMaxObserver

    dtype = {"w8a16": QuantDtype.use_16a8w, "16a4w": QuantDtype.use_16a4w}[scheme]
    with _no_sdk_download():
        quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(
        dtype, is_linear_per_channel=True, is_conv_per_channel=True,
        is_embedding_per_channel=True, act_observer=MinMaxObserver)
    return quantizer


def prepare(model: torch.nn.Module, shape: GraphShape, scheme: str = "w8a16"
            ) -> dict[str, torch.fx.GraphModule]:
    """Annotated graphs with observers, by method name (``prefill``, ``decode``)."""
    from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e

    quantizer = make_quantizer(scheme)
    programs = export_methods({name: model for name in shape.methods()}, shape)
    return {name: prepare_pt2e(ep.module(), quantizer) for name, ep in programs.items()}


@dataclass
class CalibrationStats:
    samples: int
    prefill_tokens: int
    decode_tokens: int


@torch.no_grad()
def calibrate(prepared: dict[str, torch.fx.GraphModule], shape: GraphShape,
              windows: list[list[int]], decode_tokens: int,
              progress: Callable[[], object] | None = None) -> CalibrationStats:
    """Each window is prefilled except its last ``decode_tokens`` tokens, which are decoded one
    at a time, so both graphs see real text in the way they are used.

    No windows means no calibration: the observers then see only the trace input (token ids
    1..T), the baseline that shows what calibration is worth.
    """
    stats = CalibrationStats(0, 0, 0)
    if not windows:
        for name, t in shape.methods().items():
            prepared[name](*shape.example_inputs(t))
        return stats
    runner = StaticKVRunner(shape, *shape.step_pair(prepared))
    for window in windows:
        split = max(1, len(window) - decode_tokens)
        runner.reset()
        runner.prefill(window[:split])
        for token in window[split:]:
            runner.decode(token)
        stats.samples += 1
        stats.prefill_tokens += split
        stats.decode_tokens += len(window) - split
        if progress is not None:
            progress()
    return stats


def _drop_unused_attributes(gm: torch.fx.GraphModule) -> None:
    """convert_pt2e folds weights into new int8 constants and leaves the float originals as
    attributes; torch.export would save every attribute, so drop the unreferenced ones."""
    gm.graph.eliminate_dead_code()
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name not in used and not any(u.startswith(name + ".") for u in used):
            owner, _, leaf = name.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, leaf)
    gm.delete_all_unused_submodules()
    gm.recompile()


def convert(prepared: dict[str, torch.fx.GraphModule]) -> dict[str, torch.fx.GraphModule]:
    """The quantized eager graphs (reference q/dq), by method name."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

    converted = {}
    for name, gm in prepared.items():
        out = convert_pt2e(gm)
        _drop_unused_attributes(out)
        converted[name] = out
    return converted


def _module_name(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    return next(reversed(stack.values()))[0] if stack else None


def put_weights(gm: torch.fx.GraphModule, weights) -> int:
    """Replace the converted graph's linear weights with ``weights`` (``weights.PhoneWeights``,
    one scale per output channel): the int8 constant behind each linear's
    ``dequantize_per_channel`` becomes our codes, its scale ours, zero points 0, and the code
    range the codes' own (-8..7 for the 4-bit codes: QNN encodes any range of at most 16
    levels as 4-bit, ``builders/node_visitor.py``). Returns how many were replaced; every
    linear must be found."""
    done = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or "dequantize_per_channel" not in str(node.target):
            continue
        users = list(node.users)
        if len(users) != 1 or users[0].target != torch.ops.aten.linear.default:
            continue
        name = _module_name(users[0])
        lw = weights.linears.get(name)
        if lw is None:
            continue
        if not lw.per_channel:
            raise CpuQuantError(f"{name}: QNN's per-channel weights cannot hold groups of "
                                f"{lw.group}")
        q_attr, s_attr, z_attr = (a.target for a in node.args[:3])
        old_scale, old_zero = getattr(gm, s_attr), getattr(gm, z_attr)
        setattr(gm, q_attr, lw.qdata.clone())
        setattr(gm, s_attr, lw.scale[:, 0].to(old_scale.dtype).clone())
        setattr(gm, z_attr, torch.zeros_like(old_zero))
        node.args = (*node.args[:4], lw.levels.lo, lw.levels.hi, *node.args[6:])
        done.add(name)
    missing = sorted(set(weights.linears) - done)
    if missing:
        raise CpuQuantError(f"the QNN graph has no per-channel weight for {missing[0]} "
                            f"({len(missing)} linears)")
    gm.recompile()
    return len(done)


def save_programs(programs: dict[str, torch.export.ExportedProgram], directory: Path
                  ) -> list[str]:
    files = []
    for name, program in programs.items():
        fname = f"qnn_{name}.pt2"
        torch.export.save(program, str(directory / fname))
        files.append(fname)
    return files


def lower_to_portable(programs: dict[str, torch.export.ExportedProgram]):
    """The calibrated program for ExecuTorch's portable (+ quantized) CPU kernels."""
    from executorch.exir import (
        EdgeCompileConfig,
        ExecutorchBackendConfig,
        to_edge_transform_and_lower,
    )

    # quantize/dequantize_per_tensor with uint16 encodings are not core ATen, hence no IR check.
    edge = to_edge_transform_and_lower(programs,
                                       compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch(ExecutorchBackendConfig())


def lower_to_qnn(programs: dict[str, torch.export.ExportedProgram], shape: GraphShape,
                 soc: str):
    """HTP program with ``QnnPartitioner``. Needs QNN_SDK_ROOT (Qualcomm's SDK); untested here.

    Takes the same calibrated programs that are saved as ``qnn_<method>.pt2``, so lowering in
    the command and lowering the saved files later (``finish_qnn_lowering``) are one path.
    """
    if qnn_sdk_root() is None:
        raise CpuQuantError("lowering to the HTP needs Qualcomm's QNN SDK: set QNN_SDK_ROOT")
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
        to_edge_transform_and_lower_to_qnn,
    )

    try:
        chipset = getattr(QcomChipset, soc)
    except AttributeError:
        raise CpuQuantError(f"unknown Qualcomm SoC {soc!r} (e.g. SM8550, SM8650, SM8750)") from None
    specs = generate_qnn_executorch_compiler_spec(
        soc_model=chipset, backend_options=generate_htp_compiler_spec(use_fp16=False))
    lengths = shape.methods()
    modules = {name: program.module() for name, program in programs.items()}
    inputs = {name: shape.example_inputs(lengths[name]) for name in programs}
    edge = to_edge_transform_and_lower_to_qnn(modules, inputs, specs)
    return edge.to_executorch()


def load_saved_programs(directory: Path) -> dict[str, torch.export.ExportedProgram]:
    """``qnn_prefill.pt2`` (unless the prefill length is 1) and ``qnn_decode.pt2`` of an
    export-phone output directory."""
    import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401  registers the q/dq ops

    return {name: torch.export.load(str(directory / f"qnn_{name}.pt2"))
            for name in ("prefill", "decode") if (directory / f"qnn_{name}.pt2").is_file()}


def finish_qnn_lowering(directory: str | Path, soc: str = DEFAULT_SOC) -> Path:
    """On a machine with the QNN SDK: lower a qnn export's saved programs to
    ``model_htp.pte`` in the same directory (written to a temporary name, then renamed)."""
    import json

    directory = Path(directory)
    report = json.loads((directory / "export_report.json").read_text())
    shape = GraphShape(**report["graph"])
    manager = lower_to_qnn(load_saved_programs(directory), shape, soc)
    target = directory / "model_htp.pte"
    tmp = directory / ".model_htp.pte.partial"
    with open(tmp, "wb") as fh:
        manager.write_to_file(fh)
    os.replace(tmp, target)
    return target
