"""``verify --source``: every quantized module read back against the source weight (SNR).

A correct 4-bit artifact of the tiny random model reads back at 16-20 dB per module; each
broken variant below puts at least one module far under the 6 dB threshold (swapped or
transposed: about -3 dB; scales x1000: about -60 dB)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpu_quant.formats.gptq.layout import gptq_module_tensors
from cpu_quant.quantize.gptq import GridSpec, quantize_rtn

from .hostile.generate import invoke

LAYER = "model.layers.0."


@pytest.fixture(scope="module")
def artifact(hostile_bases) -> Path:
    """A round-to-nearest GPTQ artifact (group 32, head quantized) of the tiny model."""
    return hostile_bases.quant / "gptq"


def _rewrite(q: Path, edit) -> None:
    [f] = [p for p in q.glob("*.safetensors") if f"{LAYER}mlp.up_proj.qweight" in load_file(p)]
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _swap_k_v(t: dict) -> None:
    for suffix in ("qweight", "qzeros", "scales"):
        k, v = f"{LAYER}self_attn.k_proj.{suffix}", f"{LAYER}self_attn.v_proj.{suffix}"
        t[k], t[v] = t[v], t[k]


def _transpose_o_proj(t: dict, source: Path) -> None:
    w = load_file(source / "model.safetensors")[f"{LAYER}self_attn.o_proj.weight"].float()
    gq = quantize_rtn(w.t().contiguous(), 32, GridSpec())  # square [64, 64]: shapes unchanged
    for suffix, tensor in gptq_module_tensors(gq).items():
        name = f"{LAYER}self_attn.o_proj.{suffix}"
        t[name] = tensor.to(t[name].dtype)


def _scales_x1000(t: dict) -> None:
    name = f"{LAYER}mlp.up_proj.scales"
    t[name] = (t[name].float() * 1000).to(t[name].dtype)


def _permute_rows(t: dict) -> None:
    rows = t[f"{LAYER}mlp.gate_proj.qweight"].shape[1]
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    for suffix in ("qweight", "scales"):  # symmetric: every zero is 8, qzeros need no change
        name = f"{LAYER}mlp.gate_proj.{suffix}"
        t[name] = t[name][:, perm].contiguous()


def test_a_correct_artifact_passes(artifact, tiny_llama):
    proc = invoke(["verify", artifact, "--source", tiny_llama, "--json"])
    assert proc.exit_code == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)  # one JSON document, nothing else on stdout
    src = doc["source"]
    assert src["modules"] == 15 and src["weighting"] == "none" and src["threshold_db"] == 6.0
    assert src["min_db"] > 12.0, src  # a correct 4-bit group-32 module: 16-20 dB here
    assert len(src["worst"]) == 5


@pytest.mark.parametrize("fault, module, needle", [
    ("swap", "self_attn.k_proj", "holds the weights of model.layers.0.self_attn.v_proj"),
    ("transpose", "self_attn.o_proj", "transposed"),
    ("scales", "mlp.up_proj", "wrong scales"),
    ("permute", "mlp.gate_proj", "matches no source weight"),
])
def test_a_broken_artifact_fails_naming_the_module(artifact, tiny_llama, tmp_path, fault, module,
                                                   needle):
    q = Path(shutil.copytree(artifact, tmp_path / "q"))
    edit = {"swap": _swap_k_v, "transpose": lambda t: _transpose_o_proj(t, tiny_llama),
            "scales": _scales_x1000, "permute": _permute_rows}[fault]
    _rewrite(q, edit)
    plain = invoke(["verify", q])
    assert plain.exit_code == 0, plain.stdout[-2000:]  # what the structural checks cannot see
    proc = invoke(["verify", q, "--source", tiny_llama])
    assert proc.exit_code == 1 and not proc.traceback, proc.stderr[-2000:]
    errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")]
    assert any(LAYER + module in ln and needle in ln for ln in errors), errors
    assert all(" source " in ln for ln in errors), errors
