"""Stream a Hugging Face checkpoint through the GGUF sink with RTN, as the pipeline does.

RTN (``quantize_rtn``) gives real GroupQuants without calibration; the sink sees what the
pipeline hands it: per decoder layer its linears and float tensors, then the outer tensors
(and the head, quantized or not), with ``end_layer`` after each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cpu_quant.core.grid import GroupQuant
from cpu_quant.core.io.checkpoint import open_checkpoint
from cpu_quant.formats.gguf.format import GGUFFormat
from cpu_quant.formats.gguf.sink import GGUFSink
from cpu_quant.formats.sink import ArtifactInfo
from cpu_quant.quantize.gptq import GridSpec, quantize_rtn

LAYER = re.compile(r"model\.layers\.(\d+)\.")


def rtn_results(src: Path, group: int, head_quantized: bool = False, scale_search: bool = False
                ) -> tuple[dict[str, GroupQuant], dict[str, object], dict]:
    """(quantized linears by module, float tensors by name, config) of ``src``."""
    cfg = json.loads((src / "config.json").read_text())
    ckpt = open_checkpoint(src)
    grid = GridSpec(symmetric=True, scale_search=scale_search)
    quant, floats = {}, {}
    for name in ckpt.names:
        t = ckpt.tensor(name)
        module = name[: -len(".weight")]
        is_linear = name.endswith("_proj.weight") and LAYER.match(name)
        if is_linear or (name == "lm_head.weight" and head_quantized):
            quant[module] = quantize_rtn(t, _group_for(t, group), grid)
        else:
            floats[name] = t
    if head_quantized and "lm_head" not in quant:  # tied: the head is the embedding's copy
        emb = floats["model.embed_tokens.weight"]
        quant["lm_head"] = quantize_rtn(emb, _group_for(emb, group), grid)
    return quant, floats, cfg


def _group_for(weight, group: int) -> int:
    """``group``, or one group per row (-1) where it does not divide K (tiny models' K = 64)."""
    return group if weight.shape[1] % group == 0 else -1


def _layer_of(name: str, n_layers: int) -> int:
    m = LAYER.match(name)
    return int(m.group(1)) if m else n_layers


def feed(sink: GGUFSink, quant: dict, floats: dict, n_layers: int, layers: range | None = None) -> None:
    """Hand ``layers`` (default all, then the outer index ``n_layers``) to ``sink``."""
    for index in layers if layers is not None else range(n_layers + 1):
        for m, gq in sorted(quant.items()):
            if _layer_of(m + ".", n_layers) == index:
                sink.add_module(m, gq)
        for n, t in sorted(floats.items()):
            if _layer_of(n, n_layers) == index:
                sink.add_tensor(n, t)
        sink.end_layer(index)


def info_for(src: Path, cfg: dict, group: int, head_quantized: bool) -> ArtifactInfo:
    return ArtifactInfo(source=src, source_config=cfg, default_group=group,
                        head_quantized=head_quantized, dynamic={}, symmetric=True,
                        report={"method": "rtn", "group": group})


def write_gguf(src: Path, dst: Path, group: int = 32, head_quantized: bool = False,
               scale_search: bool = False) -> tuple[Path, dict[str, GroupQuant], dict]:
    """A GGUF of ``src`` in ``dst``; returns (file, the GroupQuants written, the floats)."""
    quant, floats, cfg = rtn_results(src, group, head_quantized, scale_search)
    n = int(cfg["num_hidden_layers"])
    sink = GGUFFormat().open_sink(dst, n, None)
    feed(sink, quant, floats, n)
    sink.finish(info_for(src, cfg, group, head_quantized))
    return next(dst.glob("*.gguf")), quant, floats
