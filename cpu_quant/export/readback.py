"""The integer weights a written XNNPACK ``.pte`` holds, read back from the file itself.

The acceptance check of the phone export: the program must hold the codes and scales that
``weights`` decided, not values some later pass re-rounded. This reads them from the bytes a
phone would load, in executorch 1.5.1's layout:

* the ``.pte`` is parsed with executorch's own deserializer
  (``exir._serialize._program.deserialize_pte_binary``): program flatbuffer, delegate
  payloads, and the named data (the constants XNNPACK looks up by key);
* each ``XnnpackBackend`` payload is an ``XNNHeader`` (magic ``XH00``: flatbuffer offset and
  size) followed by an ``XNNGraph`` flatbuffer (``backends/xnnpack/serialization/schema.fbs``),
  decoded to JSON with the ``flatc`` that executorch ships;
* every constant ``XNNQuantizedTensorValue`` of type ``qbint4`` (blockwise int4,
  ``PerChannelGroupQuant``: scales bf16), ``qcint4`` or ``qcint8`` (``PerChannelQuant``:
  scales float32) with dims ``[N, K]`` is a linear's weight. Its data, found by
  ``constant_data[constant_buffer_idx].named_key``, is ``q + 8`` as unsigned nibbles, two per
  byte along K, the even column in the low nibble (int4), or int8 as is; its scales by
  ``scale_buffer_idx``.

The methods (``prefill``, ``decode``) share their weights (the same named keys), so each stored
weight is returned once.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import CpuQuantError

XNN_HEADER_MAGIC = b"XH00"
QCINT8, QCINT4, QBINT4 = "xnn_datatype_qcint8", "xnn_datatype_qcint4", "xnn_datatype_qbint4"


@dataclass
class StoredWeight:
    """One linear's weight as the program stores it: ``w = qdata · scale`` per block."""

    qdata: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K // group]
    bits: int
    group: int
    key: str  # the named-data key of its codes


def _xnn_graph(payload: bytes) -> dict:
    """The ``XNNGraph`` of one delegate payload, as a dict (flatc's JSON)."""
    from executorch.backends.xnnpack.serialization import xnnpack_graph_serialize as ser
    from executorch.exir._serialize._flatbuffer import _flatc_decompile

    if payload[4:8] != XNN_HEADER_MAGIC:
        raise CpuQuantError("an XNNPACK delegate payload has no XNNHeader")
    header = ser.XNNHeader.from_bytes(payload[:ser.XNNHeader.EXPECTED_LENGTH])
    flatbuffer = payload[header.flatbuffer_offset:header.flatbuffer_offset + header.flatbuffer_size]
    schema = Path(ser.__file__).with_name("schema.fbs")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "schema.fbs").write_bytes(schema.read_bytes())
        (Path(tmp) / "graph.bin").write_bytes(flatbuffer)
        _flatc_decompile(tmp, os.path.join(tmp, "schema.fbs"), os.path.join(tmp, "graph.bin"),
                         ["--raw-binary"])
        text = (Path(tmp) / "graph.json").read_text()
    # flatc writes non-finite floats (a clamp's output_max) as bare inf/nan, which is not JSON
    return json.loads(re.sub(r"(:\s*)(-?(?:inf|nan))\b", r'\1"\2"', text))


def _named_bytes(named, key: str) -> bytes:
    entry = named.pte_data.get(key)
    if entry is None:
        raise CpuQuantError(f"the program's named data has no entry {key!r}")
    return named.buffers[entry.buffer_index]


def _unpack_int4(data: bytes, n: int, k: int) -> torch.Tensor:
    packed = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if packed.numel() != n * ((k + 1) // 2):
        raise CpuQuantError(f"an int4 weight of shape [{n}, {k}] has {packed.numel()} bytes")
    packed = packed.view(n, (k + 1) // 2).to(torch.int16)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, -1)[:, :k]
    return (codes - 8).to(torch.int8)


def _stored_weight(value: dict, graph: dict, named) -> StoredWeight | None:
    tensor = value["tensor_value"]
    dtype, idx = tensor["datatype"], tensor["constant_buffer_idx"]
    if idx == 0 or dtype not in (QCINT8, QCINT4, QBINT4) or tensor["num_dims"] != 2:
        return None
    n, k = tensor["dims"]
    key = graph["constant_data"][idx]["named_key"]
    data = _named_bytes(named, key)
    params = value["quant_params"]
    scale_key = graph["constant_data"][params["scale_buffer_idx"]]["named_key"]
    scale_bytes = bytearray(_named_bytes(named, scale_key))
    if dtype == QBINT4:
        group = params["group_size"]
        scale = torch.frombuffer(scale_bytes, dtype=torch.bfloat16).to(torch.float32)
    else:
        group = k
        scale = torch.frombuffer(scale_bytes, dtype=torch.float32).clone()
    if dtype == QCINT8:
        qdata = torch.frombuffer(bytearray(data), dtype=torch.int8).view(n, k).clone()
    else:
        qdata = _unpack_int4(data, n, k)
    return StoredWeight(qdata, scale.view(n, k // group), 8 if dtype == QCINT8 else 4, group, key)


def xnnpack_weights(pte: str | Path) -> list[StoredWeight]:
    """Every quantized linear weight in the XNNPACK delegates of ``pte``, each once."""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from executorch.exir.schema import DataLocation

    pte_file = deserialize_pte_binary(Path(pte).read_bytes())
    program, named = pte_file.program, pte_file.named_data
    found: dict[str, StoredWeight] = {}
    for plan in program.execution_plan:
        for delegate in plan.delegates:
            if delegate.id != "XnnpackBackend":
                continue
            if delegate.processed.location != DataLocation.INLINE:
                raise CpuQuantError("an XNNPACK delegate's payload is not in the program")
            payload = program.backend_delegate_data[delegate.processed.index].data
            graph = _xnn_graph(bytes(payload))
            for xvalue in graph.get("xvalues", []):
                if xvalue.get("xvalue_union_type") != "XNNQuantizedTensorValue":
                    continue
                stored = _stored_weight(xvalue["xvalue_union"], graph, named)
                if stored is not None:
                    found.setdefault(stored.key, stored)
    return list(found.values())


def unmatched(weights, stored: list[StoredWeight]) -> list[str]:
    """The linears of ``weights`` (``weights.PhoneWeights``) whose codes and scales no stored
    weight equals exactly."""
    by_codes: dict[tuple, list[StoredWeight]] = {}
    for w in stored:
        by_codes.setdefault((tuple(w.qdata.shape), w.bits, w.group), []).append(w)
    missing = []
    for name, lw in weights.linears.items():
        candidates = by_codes.get((tuple(lw.qdata.shape), lw.bits, lw.group), [])
        if not any(torch.equal(c.qdata, lw.qdata) and torch.equal(c.scale, lw.scale)
                   for c in candidates):
            missing.append(name)
    return missing
