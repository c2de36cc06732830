"""Write the foreign GPTQ test fixtures under tests/fixtures/foreign/ with the real foreign tools.

Run it in a SEPARATE virtual environment (never the project's), made like this::

    python3 -m venv /work/venv-gptqmodel
    /work/venv-gptqmodel/bin/pip install torch==2.13.0          # the CPU build
    /work/venv-gptqmodel/bin/pip install gptqmodel==7.6.0 optimum==2.3.0
    /work/venv-gptqmodel/bin/python scripts/make_foreign_fixtures.py

It builds one tiny random Llama (hidden 128, 2 layers, 4 heads / 2 KV heads, intermediate 256,
vocab 512, untied head) with a word-level tokenizer, saves it as bf16 safetensors, and
quantizes it three times on the CPU (4 bits, group 32, sym, no act-order, head left bf16):

* ``gptqmodel_v1``: GPTQModel ``quantize`` + ``save`` with ``format=gptq`` (v1 zeros);
* ``gptqmodel_v2``: the same with ``format=gptq_v2`` (v2 zeros);
* ``transformers_v2``: transformers ``from_pretrained(quantization_config=GPTQConfig(...))``
  (through optimum's ``GPTQQuantizer``, which keeps GPTQModel's internal v2 zeros) and
  ``save_pretrained``.

Only config.json, the safetensors files (and their index) and a ``SOURCE.txt`` naming the exact
versions are kept, so each fixture stays far below 1 MB. The tests read them with cpu-quant's
verifier and need none of these packages.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# GPTQModel 7.6.0 sizes its CPU pool as (cores + 1) // 2 = 1 on a 2-core machine, then asks for
# a 2-worker "model_loader:cpu" sub-pool and fails ("requests 2 workers but parent 'cpu' only
# has 1"); an explicit worker count avoids that.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import torch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "foreign"
KEEP_SUFFIXES = (".safetensors", ".json")
KEEP_JSON = ("config.json", "model.safetensors.index.json")
VOCAB = 512
SEED = 0


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("gptqmodel", "optimum", "transformers", "torch", "safetensors")}


def build_tiny_llama(dst: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dst, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")
    fast.save_pretrained(dst)


def calibration_texts(n: int = 32, length: int = 64) -> list[str]:
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(4, VOCAB, (n, length), generator=g)
    return [" ".join(f"w{int(i)}" for i in row) for row in ids]


def calibration_ids(n: int = 32, length: int = 64) -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(4, VOCAB, (n, length), generator=g)
    return [{"input_ids": row.tolist(), "attention_mask": [1] * length} for row in ids]


def quantize_gptqmodel(src: Path, dst: Path, fmt: str) -> None:
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization import FORMAT

    qcfg = QuantizeConfig(bits=4, group_size=32, sym=True, desc_act=False, lm_head=False,
                          format=FORMAT(fmt), device="cpu")
    model = GPTQModel.load(str(src), qcfg)
    model.quantize(calibration_ids(), batch_size=4)
    model.save(str(dst))


def quantize_transformers(src: Path, dst: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPTQConfig

    tok = AutoTokenizer.from_pretrained(src)
    gcfg = GPTQConfig(bits=4, group_size=32, sym=True, desc_act=False, dataset=calibration_texts(),
                      tokenizer=tok)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=gcfg, device_map="cpu",
                                                 dtype=torch.bfloat16)
    model.save_pretrained(dst, safe_serialization=True)


def keep_fixture_files(tmp_out: Path, final: Path, tool: str, fmt_note: str) -> None:
    if final.exists():
        shutil.rmtree(final)
    final.mkdir(parents=True)
    for f in sorted(tmp_out.iterdir()):
        if f.suffix == ".safetensors" or f.name in KEEP_JSON:
            shutil.copyfile(f, final / f.name)
    v = versions()
    (final / "SOURCE.txt").write_text(
        f"written by {tool} ({fmt_note}) with " + ", ".join(f"{k}=={x}" for k, x in v.items())
        + f", python {sys.version.split()[0]}, by scripts/make_foreign_fixtures.py\n")
    size = sum(f.stat().st_size for f in final.iterdir())
    print(f"{final.name}: {size / 1024:.0f} KiB, quantization_config ="
          f" {json.loads((final / 'config.json').read_text())['quantization_config']}")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "tiny-llama"
        build_tiny_llama(src)
        for fmt in ("gptq", "gptq_v2"):
            out = tmp / f"gptqmodel_{fmt}"
            quantize_gptqmodel(src, out, fmt)
            name = "gptqmodel_v1" if fmt == "gptq" else "gptqmodel_v2"
            keep_fixture_files(out, OUT / name, "GPTQModel", f"format={fmt}")
        out = tmp / "transformers"
        quantize_transformers(src, out)
        keep_fixture_files(out, OUT / "transformers_v2", "transformers + optimum GPTQQuantizer",
                           "GPTQConfig, default save")


if __name__ == "__main__":
    main()
