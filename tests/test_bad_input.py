"""Input that looks unusual but is good: accepted. (Bad input, one case per fault and command,
is the hostile-input corpus: tests/hostile/generate.py, tests/test_hostile_corpus.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from .conftest import run_cli


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_jsonl_calibration_and_directory(tmp_path, tiny_llama):
    from cpu_quant.data.corpus import builtin_split

    text = builtin_split("calibration")[0][:20000]
    d = tmp_path / "calib"
    d.mkdir()
    (d / "a.jsonl").write_text("\n".join(json.dumps({"text": p}) for p in text.split("\n\n")))
    (d / "b.txt").write_text(text)
    dst = tmp_path / "out"
    run_cli("gptq", str(tiny_llama), str(dst), "--calib", str(d), "--samples", "4", "--seqlen", "64",
            "--no-eval")
    report = json.loads((dst / "quantization_report.json").read_text())
    assert report["calibration_tokens"] == 4 * 64


def test_hub_snapshot_links_into_blobs_are_accepted(tmp_path, tiny_llama):
    from cpu_quant.core.io.checkpoint import open_checkpoint

    repo = tmp_path / "models--x--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in tiny_llama.iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    assert "model.embed_tokens.weight" in open_checkpoint(snap).names


@pytest.mark.parametrize("name", ["LlamaTokenizer", "LlamaTokenizerFast", "GPT2TokenizerFast",
                                  "Qwen2TokenizerFast", "GemmaTokenizerFast",
                                  "PreTrainedTokenizerFast", "TokenizersBackend"])
def test_standard_tokenizer_classes_are_accepted(name, tmp_path):
    """tokenizer_class names real checkpoints carry (slow names, their fast twins, the
    generic ones) pass the unknown-class check."""
    from cpu_quant.core.io.checkpoint import check_tokenizer_class

    check_tokenizer_class(name, tmp_path / "tokenizer_config.json")


def test_zero_size_tensors_and_shards_in_any_order_open(tmp_path, tiny_llama):
    """The exact-tiling check of a safetensors file accepts what the format allows: a tensor
    of no elements (its offsets an empty range) and shards whose tensors are split in any
    way, with or without an index."""
    import torch
    from safetensors.torch import load_file, save_file

    from cpu_quant.core.io.checkpoint import open_checkpoint

    src = Path(shutil.copytree(tiny_llama, tmp_path / "m"))
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    for fname, part in parts.items():
        save_file({n: tensors[n] for n in part} | ({"empty": torch.zeros(0, 4)}
                                                  if fname.startswith("model-00001") else {}),
                  src / fname, metadata={"format": "pt"})
    ckpt = open_checkpoint(src)
    assert ckpt.shape("empty") == (0, 4) and len(ckpt.names) == len(names) + 1
    index = {n: f for f, part in parts.items() for n in part}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    assert sorted(open_checkpoint(src).names) == names
