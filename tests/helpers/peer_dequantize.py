"""Load a GPTQ checkpoint through a peer library and dump what that library computes from it.

Runs with the GPTQModel peer venv's interpreter (``benchmarks/peers/gptqmodel_env.py``), never
the project's: it imports GPTQModel 7.6.0 / transformers 5.24 / optimum 2.3, and nothing from
cpu_quant. Usage::

    <peer-python> peer_dequantize.py --loader gptqmodel|transformers MODEL_DIR OUT.safetensors \
        --tokens TOKENS.json --modules model.layers.0.self_attn.q_proj,lm_head

Loaders:

* ``gptqmodel``: ``GPTQModel.load(MODEL_DIR, device="cpu", backend=BACKEND.GPTQ_TORCH)``;
  every quantized linear is a ``TorchLinear``.
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(MODEL_DIR, device_map="cpu",
  dtype=bfloat16)``, i.e. transformers' ``GptqHfQuantizer`` -> optimum's ``GPTQQuantizer`` ->
  the GPTQModel kernel it auto-selects (``TorchAtenLinear`` on CPU).

For each quantized linear the weight is the library's own ``module.dequantize_weight()``
([in, out], in the dtype of the module's scales), called before any forward (``TorchAtenLinear``
repacks its buffers for ``_weight_int4pack_mm_for_cpu`` on its first forward). Then one forward
of the token batch gives the logits.

``OUT.safetensors`` holds:

* ``weight.<module>``: the dequantized weight of each ``--modules`` entry, transposed to
  ``[out, in]`` (a layout change only), in the library's dtype;
* ``logits``: float32 ``[batch, seq, vocab]`` (the model's bf16 logits, converted exactly);
* metadata ``info``: JSON with the versions, and per quantized module its kernel class,
  group size, weight dtype and the SHA-256 of its ``[out, in]`` dequantized weight bytes (every
  quantized module, so the caller can check all of them without moving every tensor).

The file is written to a temporary name and renamed. The last stdout line is ``RESULT <json>``
with the same ``info``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from importlib.metadata import version

# GPTQModel 7.6.0 sizes its CPU pool as (cores + 1) // 2 = 1 on a 2-core machine, then asks for a
# 2-worker sub-pool and fails; an explicit worker count avoids that.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def load_gptqmodel(path: str):
    from gptqmodel import BACKEND, GPTQModel

    return GPTQModel.load(path, device="cpu", backend=BACKEND.GPTQ_TORCH).model


def load_transformers(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.bfloat16)


LOADERS = {"gptqmodel": load_gptqmodel, "transformers": load_transformers}


def quantized_modules(model) -> dict[str, torch.nn.Module]:
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    return {n: m for n, m in model.named_modules() if isinstance(m, BaseQuantLinear)}


@torch.no_grad()
def library_weight(module) -> torch.Tensor:
    """The library's own dequantization, [in, out] -> [out, in]."""
    return module.dequantize_weight().t().contiguous()


def sha256(t: torch.Tensor) -> str:
    # bytes of the tensor as laid out in memory; the caller hashes its tensor the same way
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loader", choices=sorted(LOADERS), required=True)
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tokens", required=True, help="JSON list of equal-length token lists")
    parser.add_argument("--modules", required=True, help="comma-separated module names to dump")
    args = parser.parse_args()

    from safetensors.torch import save_file

    t0 = time.perf_counter()
    model = LOADERS[args.loader](args.model).eval()
    t_load = time.perf_counter() - t0

    qmods = quantized_modules(model)
    wanted = [m for m in args.modules.split(",") if m]
    missing = [m for m in wanted if m not in qmods]
    if missing:
        kinds = {m: type(model.get_submodule(m)).__name__ for m in missing}
        print(f"error: not quantized after loading with {args.loader}: {kinds}", file=sys.stderr)
        return 2

    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict] = {}
    t1 = time.perf_counter()
    for name, mod in qmods.items():
        w = library_weight(mod)
        modules[name] = {"kernel": type(mod).__name__, "group_size": int(mod.group_size),
                         "dtype": str(w.dtype).removeprefix("torch."), "shape": list(w.shape),
                         "sha256": sha256(w)}
        if name in wanted:
            tensors[f"weight.{name}"] = w
    t_dequant = time.perf_counter() - t1

    tokens = torch.tensor(json.loads(open(args.tokens).read()), dtype=torch.long)
    t2 = time.perf_counter()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    t_forward = time.perf_counter() - t2
    tensors["logits"] = logits.float().contiguous()

    info = {
        "loader": args.loader,
        "model_class": type(model).__name__,
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "versions": {p: version(p) for p in ("gptqmodel", "transformers", "optimum", "torch")
                     if _installed(p)},
        "seconds": {"load": round(t_load, 2), "dequantize": round(t_dequant, 2),
                    "forward": round(t_forward, 2)},
        "modules": modules,
    }
    tmp = args.out + ".partial"
    save_file(tensors, tmp, metadata={"info": json.dumps(info)})
    os.replace(tmp, args.out)
    print("RESULT " + json.dumps(info), flush=True)
    return 0


def _installed(dist: str) -> bool:
    try:
        version(dist)
    except Exception:
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
