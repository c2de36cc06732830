"""``export_report.json``: what was produced, how, and how well it agrees.

Top-level keys (JSON object, written with sorted keys):

* ``backend``, ``scheme``, ``settings``: the export settings as given (``settings`` is the
  ``PhoneExportSettings`` dataclass);
* ``produced``: ``{file name: {"bytes": int, "sha256": str, "what": str}}`` for every file in
  the output directory except the report, and ``qnn_lowering``: ``"htp"`` when the ``.pte`` was
  lowered to Qualcomm's HTP, ``"not-done"`` (with ``qnn_next_step``) when it was not;
* ``sizes``: ``pte_bytes``, ``float32_bytes`` (4 bytes per parameter of the exported graph,
  the size of an unquantized program), ``ratio_vs_float32``;
* ``ops``: per method, ``delegated`` ``{backend id: {op: count}}`` counted inside the delegate
  payloads' original graphs, ``portable`` ``{op: count}`` run by the portable/quantized kernels
  (memory-planning bookkeeping such as ``alloc`` and ``getitem`` is not counted), and totals;
* ``calibration``: ``{"source", "samples", "prefill_tokens", "decode_tokens"}``: the windows
  that calibrate QNN's activation observers and weigh the 8-bit weights' input channels
  (XNNPACK's activations are quantized at run time; its 4-bit codes come from a GPTQ run with
  its own calibration, recorded under ``weights``);
* ``weights``, ``stored_weights``: where the linears' weights came from (the GPTQ codes, the
  weighted 8-bit search, a group rule's fallback) and what the program stores;
* ``verification``: ``verify.VerifyResult.to_dict()``, with ``tolerance``: each fixed floor the
  program had to meet (against the float model, against its own quantized eager graph), the
  value it measured and whether it met it. A program that misses one is never written;
* ``timings_s``: seconds per stage; ``provenance``: source path and hash, package versions, git SHA,
  threads, time.

Non-finite floats (an SNR of ±inf) are written as the strings ``"inf"``/``"-inf"``.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from pathlib import Path

import torch


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _is_delegate_call(node: torch.fx.Node) -> bool:
    return getattr(node.target, "__name__", "") == "executorch_call_delegate"


def _kernel_ops(nodes) -> Counter:
    """Operator calls by name; plain Python targets (memory-planning ``alloc``/``view``,
    ``getitem``) are bookkeeping, not kernels."""
    return Counter(str(n.target) for n in nodes
                   if n.op == "call_function" and hasattr(n.target, "_schema"))


def count_ops(manager) -> dict:
    """Delegated vs portable call counts per method of an ExecutorchProgramManager."""
    out = {}
    for method in manager.methods:
        gm = manager.exported_program(method).graph_module
        delegated: dict[str, Counter] = {}
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and _is_delegate_call(n)]
        for node in calls:
            lowered = getattr(gm, node.args[0].target)
            inner = lowered.original_module.graph_module.graph.nodes
            delegated.setdefault(lowered.backend_id, Counter()).update(_kernel_ops(inner))
        portable = _kernel_ops(gm.graph.nodes)
        out[method] = {
            "delegated": {k: dict(sorted(v.items())) for k, v in delegated.items()},
            "portable": dict(sorted(portable.items())),
            "delegated_total": sum(sum(v.values()) for v in delegated.values()),
            "portable_total": sum(portable.values()),
            "delegate_calls": len(calls),
        }
    return out


def float32_bytes(model: torch.nn.Module) -> int:
    return 4 * sum(p.numel() for p in model.parameters())


def provenance(src: Path) -> dict:
    import executorch.version
    import torchao

    from ..quantize.pipeline import provenance as base_provenance

    out = base_provenance(src)
    out["executorch"] = executorch.version.__version__
    out["torchao"] = torchao.__version__
    out["source_sha256"] = {p.name: sha256_file(p) for p in sorted(src.glob("*.safetensors"))}
    return out


def json_safe(obj):
    """Replace non-finite floats, which JSON cannot represent."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
