"""Load GPTQ checkpoints through a peer library and dump what that library computes from them.

Runs with the GPTQModel peer venv's interpreter (``benchmarks/peers/gptqmodel_env.py``), never
the project's: it imports GPTQModel 7.6.0, transformers 5.24 and optimum 2.3, and nothing from
cpu_quant. Several jobs share one process so the slow imports are paid once::

    <peer-python> peer_dequantize.py JOBS.json RESULTS.json

``JOBS.json``::

    {"tokens": [[int, ...], ...],            # equal-length rows: the forward batch
     "jobs": [{"name": str, "loader": "gptqmodel" | "transformers", "model": DIR,
               "out": FILE.safetensors, "modules": [module name, ...]}, ...]}

Loaders:

* ``gptqmodel``: ``GPTQModel.load(DIR, device="cpu", backend=BACKEND.GPTQ_TORCH).model``;
  every quantized linear is a ``TorchLinear``.
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR, device_map="cpu",
  dtype=torch.bfloat16)``, i.e. transformers' ``GptqHfQuantizer`` -> optimum's
  ``GPTQQuantizer`` -> the GPTQModel kernel that optimum auto-selects (``TorchAtenLinear`` on a
  CPU).

For each quantized linear (every ``gptqmodel...BaseQuantLinear`` in the loaded model) the weight
is the library's own ``module.dequantize_weight()`` ([in, out], in the dtype of the module's
scales), called before any forward because ``TorchAtenLinear`` repacks its buffers for
``_weight_int4pack_mm_for_cpu`` on its first forward. Then one forward of the token batch.

Per job, ``out`` (written to a temporary name, then renamed) holds ``weight.<module>`` for each
requested module that the library quantized, transposed to ``[out, in]`` (a layout change only)
and in the library's dtype; ``plain.<module>``: the ``weight`` of each requested module that
the library did not quantize, as loaded; and ``logits``: float32 ``[batch, seq, vocab]`` (the model's bf16
logits, converted exactly).

``RESULTS.json`` maps each job name to ``{"ok", "error", "model_class", "model_dtype",
"tie_word_embeddings", "seconds", "modules", "not_quantized"}``: ``modules`` has, for every
quantized module, its kernel class, group size, weight dtype and shape and the SHA-256 of its
``[out, in]`` dequantized weight bytes, so the caller checks all of them without moving every
tensor; ``not_quantized`` names the class of each requested module that the library left as
something else. A job whose loader raises records ``"ok": false`` and the exception; the other
jobs still run. The top level also records the package versions.

Set ``TORCHDYNAMO_DISABLE=1`` to run GPTQModel's dequantization eagerly: it wraps
``TorchLinear.dequantize_weight`` in ``torch.compile``, and on a CPU its per-module cache
guards make dynamo recompile for every module until ``recompile_limit`` (128). Measured on the
demo artifact (211 modules): 54 s vs 30 s CPU, with bit-identical weights (all 211 digests)
and logits either way.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version

# GPTQModel 7.6.0 sizes its CPU pool as (cores + 1) // 2 = 1 on a 2-core machine, then asks for a
# 2-worker sub-pool and fails; an explicit worker count avoids that.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

PACKAGES = ("gptqmodel", "optimum", "transformers", "torch", "safetensors")


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


def sha256(t: torch.Tensor) -> str:
    # the bytes as laid out in memory; the caller hashes its own tensor the same way
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@torch.no_grad()
def run_job(job: dict, tokens: torch.Tensor) -> dict:
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    model = LOADERS[job["loader"]](job["model"]).eval()
    t_load = time.perf_counter() - t0

    qmods = quantized_modules(model)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict] = {}
    t1 = time.perf_counter()
    for name, mod in qmods.items():
        w = mod.dequantize_weight().t().contiguous()  # the library's own dequantization
        modules[name] = {"kernel": type(mod).__name__, "group_size": int(mod.group_size),
                         "dtype": str(w.dtype).removeprefix("torch."), "shape": list(w.shape),
                         "sha256": sha256(w)}
        if name in job["modules"]:
            tensors[f"weight.{name}"] = w
    t_dequant = time.perf_counter() - t1
    not_quantized = {m: type(model.get_submodule(m)).__name__
                     for m in job["modules"] if m not in qmods}
    for m in not_quantized:
        weight = getattr(model.get_submodule(m), "weight", None)
        if isinstance(weight, torch.Tensor):
            tensors[f"plain.{m}"] = weight.detach().contiguous()

    t2 = time.perf_counter()
    tensors["logits"] = model(input_ids=tokens).logits.float().contiguous()
    t_forward = time.perf_counter() - t2

    tmp = job["out"] + ".partial"
    save_file(tensors, tmp)
    os.replace(tmp, job["out"])
    result = {
        "ok": True, "error": None,
        "model_class": type(model).__name__,
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "tie_word_embeddings": bool(getattr(model.config, "tie_word_embeddings", False)),
        "seconds": {"load": round(t_load, 2), "dequantize": round(t_dequant, 2),
                    "forward": round(t_forward, 2)},
        "modules": modules,
        "not_quantized": not_quantized,
    }
    del model, qmods, tensors
    gc.collect()
    return result


def versions() -> dict[str, str]:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "not installed"
    return out


def main(jobs_path: str, results_path: str) -> int:
    spec = json.loads(open(jobs_path).read())
    tokens = torch.tensor(spec["tokens"], dtype=torch.long)
    results: dict = {"versions": versions(), "jobs": {}}
    for job in spec["jobs"]:
        print(f"peer job {job['name']}: {job['loader']} {job['model']}", file=sys.stderr,
              flush=True)
        try:
            results["jobs"][job["name"]] = run_job(job, tokens)
        except Exception as exc:  # recorded for the caller, which decides what it means
            results["jobs"][job["name"]] = {"ok": False,
                                            "error": f"{type(exc).__name__}: {exc}"[:4000]}
            gc.collect()
    tmp = results_path + ".partial"
    with open(tmp, "w") as fh:
        json.dump(results, fh, indent=1)
    os.replace(tmp, results_path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
