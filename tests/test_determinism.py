"""The same bits at any thread count: the Hessian product, the Cholesky factor and its inverse
(``quantize/hessians.py``, ``quantize/factor.py``), and ``cpu-quant gptq``'s artifact.

Thread counts are compared in fresh processes (torch's thread pool is sized once per process);
the ISA limits that this machine can apply (oneDNN, ATen and oneMKL held to AVX2) are compared
the same way. The ``determinism`` benchmark suite runs the demo model through every such arm.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cpu_quant.models.tiny import TinyShape, make_tiny_model
from cpu_quant.quantize.factor import BLOCK, cholesky_lower, invert_lower

from .conftest import run_cli

AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def _spd(k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(k, k + 64, generator=gen, dtype=torch.float64) * torch.rand(
        k + 64, generator=gen, dtype=torch.float64)
    h = a @ a.t() / k
    h.diagonal().add_(0.01 * h.diagonal().mean())
    return h.to(dtype)


@pytest.mark.parametrize("k", [1, 100, BLOCK, BLOCK + 1, 3 * BLOCK + 17])
def test_cholesky_and_inverse_match_float64(k: int) -> None:
    """Blocked Cholesky and blocked triangular inverse, at widths on and off the block size:
    within float32's accuracy of the float64 LAPACK results, lower triangular."""
    h = _spd(k, seed=k)
    lower = cholesky_lower(h)
    ref = torch.linalg.cholesky(h.double())
    assert lower is not None and torch.equal(lower, lower.tril())
    assert ((lower.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    inv = invert_lower(lower)
    ref_inv = torch.linalg.inv(ref)
    assert torch.equal(inv, inv.tril())
    assert ((inv.double() - ref_inv).abs().max() / ref_inv.abs().max()).item() < 1e-4
    # float64 in, float64 out (the damping's float64 steps)
    wide = cholesky_lower(h.double())
    assert wide.dtype == torch.float64 and (wide - ref).abs().max().item() < 1e-10


def test_cholesky_says_when_a_matrix_is_not_positive_definite() -> None:
    """An indefinite matrix, whose failure shows in a later block than the first: None."""
    h = _spd(2 * BLOCK + 5, seed=3)
    h[BLOCK + 7, BLOCK + 7] = -1.0
    assert cholesky_lower(h) is None
    assert cholesky_lower(-torch.eye(3)) is None


def test_one_thread_restores_the_callers_thread_count() -> None:
    from cpu_quant.quantize.factor import one_thread

    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


_DIGESTS = """
import hashlib, json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from cpu_quant.quantize.hessians import gram
from cpu_quant.quantize.gptq import prepare_hessian
gen = torch.Generator().manual_seed(5)
out = {}
for k in (300, 1100):
    x = (torch.randn(3000, k, generator=gen) * torch.rand(k, generator=gen).pow(3).mul(30)
         ).to(torch.bfloat16)
    h = 2 * gram(x) / x.shape[0]
    prep = prepare_hessian(h, act_order=True, damp=0.01)
    for name, t in (("gram", h), ("hinv", prep.hinv)):
        out[f"{name}{k}"] = hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
print(json.dumps(out))
"""


def _digests(threads: int, env: dict | None = None) -> dict:
    import os

    proc = subprocess.run([sys.executable, "-c", _DIGESTS, str(threads)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, **(env or {})))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.e2e
def test_hessian_and_its_factor_have_the_same_bits_at_any_thread_count_and_isa_limit() -> None:
    """gram and the damped inverse factor of two Hessians (one narrower than a block, one of
    several blocks), at 1, 2 and 3 threads and with oneDNN, ATen and oneMKL held to AVX2."""
    one = _digests(1)
    assert _digests(2) == one
    assert _digests(3) == one
    assert _digests(1, AVX2) == one


def _tensors(directory) -> dict[str, str]:
    from benchmarks.bit_identity import tensor_digests

    return tensor_digests(directory)


# wide enough that LAPACK's threaded Cholesky of its Hessians (320 and 640 columns) gives other
# bits at two threads than at one: what the blocked factor must not do
WIDE = TinyShape(hidden=320, intermediate=640, layers=2, heads=4, kv_heads=2)


@pytest.mark.e2e
def test_gptq_writes_the_same_artifact_at_one_and_two_threads(demo_src, tmp_path) -> None:
    """The whole command on a small random Llama (defaults: smoothing, head, act-order), at
    ``--threads 1`` and ``--threads 2``: the same tensors, bit for bit."""
    src = make_tiny_model("llama", tmp_path / "src", demo_src, shape=WIDE)
    outs = []
    for threads in (1, 2):
        dst = tmp_path / f"t{threads}"
        run_cli("gptq", str(src), str(dst), "--samples", "8", "--seqlen", "64",
                "--batch-size", "4", "--no-eval", "--threads", str(threads), "-q")
        outs.append(_tensors(dst))
    assert outs[0] and outs[0] == outs[1]
