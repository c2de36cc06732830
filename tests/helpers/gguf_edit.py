"""Damaged GGUF files for verify's tests, made with gguf-py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def copy_without_tensor(src: Path, dst: Path, tensor: str) -> Path:
    """``dst``: ``src``'s metadata and every tensor but ``tensor``."""
    reader = gguf.GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name != tensor:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
