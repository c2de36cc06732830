"""The one safetensors writer: artifacts' shards, resume points and offloaded activations.

``write_safetensors(path, tensors)`` writes the file straight from the tensors' memory (no
serialised copy of them, unlike ``safetensors.torch.save``), fsyncs it, and renames it into
place, so a crash leaves either the old file or the whole new one, never a torn one. It uses
Python I/O: a full disk is a plain ``OSError`` (the callers turn it into one line), and the GIL
is free while the bytes go out. Tensors are laid out by decreasing element size, then name, as
``safetensors`` itself does, so every tensor starts aligned to its element size. Files read
back with ``safetensors.safe_open``/``load_file`` and with transformers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
             torch.float64: "F64", torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16",
             torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` to ``path`` atomically and durably; returns the tensor bytes written."""
    path = Path(path)
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": dict(metadata if metadata is not None else {"format": "pt"})}
    parts = []
    offset = 0
    for name in order:
        t = tensors[name].detach()
        if t.dtype not in ST_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors type here")
        t = t.contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        parts.append(t)
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little"))
            f.write(head)
            for t in parts:
                if t.numel():
                    f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return offset
