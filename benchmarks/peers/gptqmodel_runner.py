"""Quantize a checkpoint with GPTQModel, from exactly the calibration token windows given.

Runs inside the GPTQModel peer venv (``gptqmodel_env.py``), so it imports nothing from
cpu_quant. Usage::

    <peer-venv>/bin/python gptqmodel_runner.py SPEC.json

``SPEC.json``::

    {"model": SRC, "out": DST, "windows": WINDOWS.json, "bits": 4, "group_size": 128,
     "sym": true, "desc_act": false, "lm_head": false, "dynamic": {...} | null,
     "batch_size": 8}

``WINDOWS.json`` is a JSON list of token-id lists (every window ``seqlen`` long), written by
the benchmark from ``cpu_quant.data.corpus.token_windows``. Each window is passed as
``{"input_ids": ..., "attention_mask": all ones}``: GPTQModel's calibration preparation keeps
such rows as they are (no re-tokenisation, no BOS added).

Everything not in the spec stays at GPTQModel's default (recorded in ``quantize_config.json``
of the output). The artifact is saved to ``DST.partial`` and renamed to ``DST`` when complete;
``DST/gptqmodel_run.json`` records the versions, the effective config and the phase times.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time


def main(spec_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    t0 = time.perf_counter()
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.version import __version__ as gptqmodel_version

    t_import = time.perf_counter() - t0
    windows = json.loads(open(spec["windows"]).read())
    calibration = [{"input_ids": w, "attention_mask": [1] * len(w)} for w in windows]

    qcfg = QuantizeConfig(bits=spec["bits"], group_size=spec["group_size"], sym=spec["sym"],
                          desc_act=spec["desc_act"], lm_head=spec["lm_head"],
                          dynamic=spec.get("dynamic") or None)
    t1 = time.perf_counter()
    model = GPTQModel.load(spec["model"], qcfg, device="cpu")
    t_load = time.perf_counter() - t1
    t2 = time.perf_counter()
    model.quantize(calibration, batch_size=int(spec.get("batch_size", 1)))
    t_quant = time.perf_counter() - t2

    out = spec["out"]
    staging = out + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    t3 = time.perf_counter()
    model.save(staging)
    t_save = time.perf_counter() - t3
    with open(os.path.join(staging, "config.json")) as fh:
        saved_qcfg = json.load(fh).get("quantization_config", {})
    run = {
        "gptqmodel": gptqmodel_version,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "samples": len(windows),
        "seqlen": len(windows[0]) if windows else 0,
        "spec": spec,
        "saved_quantization_config": saved_qcfg,
        "seconds": {"import": round(t_import, 3), "load": round(t_load, 3),
                    "quantize": round(t_quant, 3), "save": round(t_save, 3),
                    "total": round(time.perf_counter() - t0, 3)},
    }
    with open(os.path.join(staging, "gptqmodel_run.json"), "w") as fh:
        json.dump(run, fh, indent=2, sort_keys=True, default=str)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(staging, out)
    print(json.dumps(run["seconds"]))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: gptqmodel_runner.py SPEC.json", file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1]))
