"""Unit tests of the pure tensor math: grid, scale search, GPTQ, RTN."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpu_quant.core.errors import CpuQuantError
from cpu_quant.core.grid import GroupQuant, quantize_codes, round_scale
from cpu_quant.quantize.gptq import (
    GridSpec,
    _damped_cholesky,
    _upper_inverse_factor,
    quantize_gptq,
    quantize_rtn,
)
from cpu_quant.quantize.scale_search import (
    absmax_scales,
    minmax_scales_zeros,
    search_asymmetric_scales,
    search_symmetric_scales,
    weighted_error,
)


def _groups(seed: int, outliers: bool, rows: int = 64, g: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, g, generator=gen)
    if outliers:
        mask = torch.rand(rows, g, generator=gen) < 0.03
        w = torch.where(mask, w * 20, w)
        w[:, 0] += 5 * torch.randn(rows, generator=gen)
    importance = torch.rand(g, generator=gen) ** 4 * 10 + 1e-3
    return w, importance


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), outliers=st.booleans(), uniform=st.booleans(),
       scale=st.sampled_from([1e-4, 1e-2, 1.0, 30.0]))
@example(seed=88, outliers=True, uniform=False, scale=1.0)  # a near tie the closed form misordered
def test_symmetric_search_never_increases_weighted_error(seed, outliers, uniform, scale):
    w, imp = _groups(seed, outliers)
    w = w * scale
    d = None if uniform else imp
    base = weighted_error(w, absmax_scales(w), d)
    searched = weighted_error(w, search_symmetric_scales(w, d), d)
    assert torch.all(searched <= base * (1 + 1e-6) + 1e-30)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), outliers=st.booleans())
def test_asymmetric_search_never_increases_weighted_error(seed, outliers):
    w, imp = _groups(seed, outliers)
    s0, z0 = minmax_scales_zeros(w)
    s, z = search_asymmetric_scales(w, imp)
    assert torch.all(weighted_error(w, s, imp, z) <= weighted_error(w, s0, imp, z0) * (1 + 1e-6))


def test_search_gains_on_average_and_scales_are_bf16():
    w, imp = _groups(1, outliers=True, rows=512)
    s = search_symmetric_scales(w, imp)
    assert torch.equal(s, round_scale(s)), "scales must be exactly representable in bf16"
    gain = weighted_error(w, absmax_scales(w), imp).sum() / weighted_error(w, s, imp).sum()
    # measured ~1.4x on this data; a search that only ties the baseline is not doing its job
    assert gain > 1.15


def test_zero_group_gives_code_eight():
    w = torch.zeros(3, 32)
    s = search_symmetric_scales(w)
    assert torch.all(quantize_codes(w, s) == 8)


def test_gptq_with_diagonal_hessian_equals_weighted_rtn():
    # With no correlation between input channels GPTQ has nothing to compensate: its result
    # must be exactly the RTN result with the same importance-weighted scales.
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen)
    h = torch.diag(torch.rand(128, generator=gen) + 0.5)
    gq, stats = quantize_gptq(w, h, 32, GridSpec())
    rtn = quantize_rtn(w, 32, GridSpec(), torch.diag(h))
    assert stats.damp == 0.01 and not stats.damp_raised
    assert torch.equal(gq.scales, rtn.scales)
    assert torch.equal(gq.codes, rtn.codes)


def _correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, k // 4, generator=gen)
    mix = torch.randn(k // 4, k, generator=gen)
    return base @ mix + 0.1 * torch.randn(n, k, generator=gen)


def test_gptq_beats_rtn_on_output_error():
    gen = torch.Generator().manual_seed(1)
    k = 128
    x = _correlated_inputs(2048, k)
    w = torch.randn(96, k, generator=gen) * 0.05
    h = 2 * x.t() @ x / x.shape[0]
    out_err = lambda gq: float(((x @ (w - gq.dequantize()).t()) ** 2).mean())  # noqa: E731
    gptq, _ = quantize_gptq(w, h, 32, GridSpec())
    gptq_act, _ = quantize_gptq(w, h, 32, GridSpec(), act_order=True)
    rtn = quantize_rtn(w, 32, GridSpec(), torch.diag(h))
    # measured: GPTQ roughly halves the output error on strongly correlated inputs
    assert out_err(gptq) < 0.8 * out_err(rtn)
    assert out_err(gptq_act) < 0.8 * out_err(rtn)


def _textbook_gptq(w: torch.Tensor, h: torch.Tensor, g: int, act_order: bool,
                   damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ as the paper writes it, in float64: one column at a time, no blocks, no lazy
    updates, the inverse factor by inverse-then-Cholesky. Same grid, same scale search (static
    groups with act-order, else searched when the sweep reaches the group). (codes, scales)."""
    from cpu_quant.quantize.gptq import fit_group

    n, k = w.shape
    hh = h.double().clone()
    dead = torch.diag(hh) == 0
    hh[dead, dead] = 1.0
    importance = torch.diag(hh).float()
    ww = w.double().clone()
    ww[:, dead] = 0.0
    scales = torch.zeros(n, k // g, dtype=torch.float64)
    if act_order:
        s, _ = fit_group(ww.float().reshape(n, k // g, g), importance.reshape(1, k // g, g), GridSpec())
        scales[:] = s.squeeze(-1).double()
    perm = torch.argsort(importance, descending=True) if act_order else torch.arange(k)
    ww, hh = ww[:, perm], hh[perm][:, perm]
    hh += damp * torch.diag(hh).mean() * torch.eye(k, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.linalg.inv(hh)).t()  # upper: UᵀU = H⁻¹
    codes = torch.zeros(n, k, dtype=torch.int64)
    for j in range(k):
        col = int(perm[j])
        grp = col // g
        if not act_order and col % g == 0:
            s, _ = fit_group(ww[:, j:j + g].float().unsqueeze(1), importance[col:col + g].reshape(1, 1, g),
                             GridSpec())
            scales[:, grp] = s.reshape(n).double()
        sc = scales[:, grp]
        a = torch.where(sc == 0, torch.zeros_like(sc), torch.round(ww[:, j] / sc)).clamp(-8, 7)
        codes[:, col] = (a + 8).long()
        e = (ww[:, j] - a * sc) / u[j, j]
        ww[:, j:] -= torch.outer(e, u[j, j:])
    return codes, scales.float()


def test_gptq_matches_the_textbook_algorithm_in_float64():
    """The blocked, lazy, transposed float32 sweep against the paper's column loop in float64:
    nearly every code the same (the rest are rounding ties that float32 breaks the other way,
    and their consequences), and the same output error tr(ΔW H ΔWᵀ) to within 1%."""
    gen = torch.Generator().manual_seed(5)
    k, g = 256, 32
    x = _correlated_inputs(4096, k, seed=5) * (torch.rand(k, generator=gen) ** 3 * 10 + 0.1)
    w = torch.randn(80, k, generator=gen) * 0.05
    w[:4, :g] = 0.0  # all-zero groups: scale 0, code 8
    x[:, 7] = 0.0  # an input channel that never fires
    h = 2 * x.t() @ x / x.shape[0]
    for act_order in (True, False):
        gq, _ = quantize_gptq(w, h, g, GridSpec(), act_order=act_order, block_size=64)
        codes, scales = _textbook_gptq(w, h, g, act_order)
        same = (gq.codes.long() == codes).double().mean().item()
        assert same > 0.99, (act_order, same)
        assert torch.all(gq.codes[:4, :g] == 8)

        def out_err(deq):
            d = (w - deq).double()
            return torch.trace(d @ h.double() @ d.t()).item()

        ref = GroupQuant(codes.to(torch.uint8), scales, None, g).dequantize()
        assert abs(out_err(gq.dequantize()) / out_err(ref) - 1) < 0.01, act_order


def test_act_order_keeps_static_groups():
    gen = torch.Generator().manual_seed(2)
    x = _correlated_inputs(512, 64)
    w = torch.randn(32, 64, generator=gen)
    h = 2 * x.t() @ x / x.shape[0]
    gq, _ = quantize_gptq(w, h, 32, GridSpec(), act_order=True)
    # static groups: the scales are the ones searched on the original weights
    expected = search_symmetric_scales(w.reshape(32, 2, 32), torch.diag(h).reshape(1, 2, 32))
    assert torch.equal(gq.scales, expected.squeeze(-1))
    assert gq.codes.min() >= 0 and gq.codes.max() <= 15


def test_damping_is_raised_when_cholesky_fails():
    gen = torch.Generator().manual_seed(3)
    k = 64
    v = torch.randn(k, 1, generator=gen)
    h = torch.eye(k) - 1.02 * (v @ v.t()) / (v.t() @ v)  # one eigenvalue of -0.02
    w = torch.randn(32, k, generator=gen)
    gq, stats = quantize_gptq(w, h, 32, GridSpec())
    assert stats.damp_raised and stats.damp > 0.01
    assert torch.isfinite(gq.dequantize()).all()


def test_damped_inverse_factor_matches_float64_textbook_route():
    """U from one Cholesky of the reversed matrix and a triangular inverse equals the textbook
    chol -> cholesky_inverse -> upper chol, computed in float64; the damping is added to the
    input's own diagonal and taken off again, so the input is left untouched."""
    gen = torch.Generator().manual_seed(5)
    for k, rows in ((96, 400), (200, 150)):  # the second is rank-deficient: damping carries it
        x = torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 3.0, k)
        h = 2 * x.t() @ x / rows
        reversed_h = h.flip(0, 1)
        lower, used, raised = _damped_cholesky(reversed_h, 0.01)
        assert torch.equal(reversed_h, h.flip(0, 1)) and used == 0.01 and not raised
        u = _upper_inverse_factor(lower)
        hd = h.double() + 0.01 * torch.diag(h.double()).mean() * torch.eye(k, dtype=torch.float64)
        ref = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hd)), upper=True)
        assert torch.equal(u, u.triu()) and (torch.diag(u) > 0).all()
        assert ((u.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
        assert torch.allclose((u.double().t() @ u.double()) @ hd, torch.eye(k, dtype=torch.float64),
                              atol=1e-3)


def _few_token_hessian(k: int = 1024, tokens: int = 4, dead: int = 8) -> torch.Tensor:
    """A Hessian of a short calibration whose products were rounded: fewer tokens than
    columns, so of rank ``tokens`` at most, with ``dead`` input channels that never fire and a
    direction every token shares (as LLM activations have), each entry rounded to bf16 (as the
    bf16 GEMM of earlier versions of ``hessians.gram`` did; any lossy product can do it). The
    rounding leaves the matrix indefinite: its smallest eigenvalue is about -0.37x its mean
    diagonal (-0.87x at K = 4096; at K = 8192, the width of a 1B model's down projection,
    beyond the default damping's last step, -1x: the reported crash)."""
    gen = torch.Generator().manual_seed(11)
    shared = torch.randn(k, generator=gen)
    x = torch.randn(tokens, k, generator=gen) + 1e4 * torch.randn(tokens, 1, generator=gen) * shared
    x[:, :dead] = 0.0
    x = x.to(torch.bfloat16).double()
    return 2 * (x.t() @ x).to(torch.bfloat16).float() / tokens


def _prepare_as_before(h: torch.Tensor, act_order: bool, damp: float):
    """prepare_hessian as it was before the float64 and round-to-nearest fallbacks (float32,
    DAMP_STEPS only) and before it held fewer copies: a clone, the permuted copy, and a damped
    reversed copy per attempt."""
    from cpu_quant.quantize.factor import cholesky_lower, invert_lower
    from cpu_quant.quantize.gptq import DAMP_STEPS, HessianNotPositiveDefinite, HessianPrep

    h = h.to(torch.float32).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    importance = torch.diag(h).clone()
    perm = torch.argsort(importance, descending=True) if act_order else torch.arange(h.shape[0])
    h = h[perm][:, perm]
    mean_diag = torch.mean(torch.diag(h)).item()
    for step in DAMP_STEPS:  # a damped copy of the reversed matrix per attempt
        damped = h.flip(0, 1)
        damped.diagonal().add_(damp * step * mean_diag)
        lower = cholesky_lower(damped)
        if lower is not None:
            hinv = invert_lower(lower).flip(0, 1)
            return HessianPrep(dead, importance, perm, hinv, damp * step, step != 1.0)
    raise HessianNotPositiveDefinite("the float32 route did not factor")


def test_a_hessian_that_factors_in_float32_gives_the_same_result_as_before():
    """No change for inputs that worked: positive definite, rank-deficient with raised damping
    (the few-token Hessian at the default 1%), with and without act-order: codes and scales
    equal, bit for bit, to the float32-only route, and no fallback recorded."""
    gen = torch.Generator().manual_seed(12)
    x = _correlated_inputs(2048, 256, seed=12)
    cases = [(2 * x.t() @ x / x.shape[0], False), (_few_token_hessian(), True)]
    for h, raised in cases:
        w = torch.randn(48, h.shape[0], generator=gen)
        for act_order in (True, False):
            gq, stats = quantize_gptq(w, h, 32, GridSpec(), act_order=act_order)
            before, old = quantize_gptq(w, _prepare_as_before(h, act_order, 0.01), 32, GridSpec(),
                                        act_order=act_order)
            assert torch.equal(gq.codes, before.codes) and torch.equal(gq.scales, before.scales)
            assert (stats.damp, stats.damp_raised) == (old.damp, old.damp_raised)
            assert stats.damp_raised == raised and stats.fallback is None


def test_a_rank_deficient_hessian_falls_back_and_the_report_says_so(caplog):
    """The few-token Hessian with dead columns, at dampings whose float32 steps all fail (a
    smaller --damp stands in for a wider matrix: the steps end below the rounding noise).
    At 0.001 the float64 steps reach 1.0x the mean diagonal and GPTQ runs; at 0.0001 they end
    at 0.1x, nothing factors, and the module takes the weighted scale search without GPTQ.
    Either way no exception, finite results and valid codes, and what happened in the
    tensor's report; the round-to-nearest one with a one-line warning."""
    from cpu_quant.formats import get_format
    from cpu_quant.quantize import schedule
    from cpu_quant.quantize.gptq import HessianNotPositiveDefinite, prepare_hessian
    from cpu_quant.quantize.plan import plan_linear

    caplog.set_level(logging.WARNING, logger="cpu_quant.quantize")  # whatever an earlier -q set
    h = _few_token_hessian()
    k = h.shape[0]
    assert torch.linalg.eigvalsh(h.double())[0] < -0.3 * torch.diag(h).mean()
    with pytest.raises(HessianNotPositiveDefinite):
        _prepare_as_before(h, True, 0.001)  # what crashed the main job
    prep = prepare_hessian(h, act_order=True, damp=0.001)
    assert prep.fallback == "float64" and prep.damp == 1.0 and prep.damp_raised

    gen = torch.Generator().manual_seed(13)
    limits = get_format("gptq").limits
    jobs = [schedule.QuantJob(torch.randn(32, k, generator=gen).to(torch.bfloat16),
                              plan_linear(name, k, 32, 32, False, limits), h)
            for name in ("gate", "up")]  # two linears sharing the Hessian: one stacked sweep
    for damp, fallback, used in ((0.001, "float64", 1.0), (0.0001, "rtn", None)):
        caplog.clear()
        settings = schedule.QuantSettings(method="gptq", group_size=32, damp=damp)
        for (gq, rep), job in zip(schedule.quantize_linears(jobs, settings, GridSpec()), jobs,
                                  strict=True):
            assert gq.codes.min() >= 0 and gq.codes.max() <= 15
            assert torch.isfinite(gq.scales).all() and torch.isfinite(gq.dequantize()).all()
            assert (rep.gptq_fallback, rep.damp, rep.damp_raised) == (fallback, used, True)
            assert rep.weighted_snr_db > 20  # measured 22.7-22.8 dB
            if fallback == "rtn":  # exactly the weighted scale search's result
                rtn = quantize_rtn(job.weight, 32, GridSpec(), torch.diag(h))
                assert torch.equal(gq.codes, rtn.codes) and torch.equal(gq.scales, rtn.scales)
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        if fallback == "rtn":
            assert len(warnings) == 1 and warnings[0].startswith("warning: gate, up: Hessian is "
                                                                  "not positive definite")
        else:
            assert not warnings


def test_a_hessian_with_inf_is_refused_in_one_line():
    from cpu_quant.formats import get_format
    from cpu_quant.quantize import schedule
    from cpu_quant.quantize.plan import plan_linear

    h = torch.eye(64)
    h[3, 3] = float("inf")
    job = schedule.QuantJob(torch.randn(32, 64), plan_linear("down", 64, 32, 32, False,
                                                             get_format("gptq").limits), h)
    with pytest.raises(CpuQuantError, match="down: its calibration inputs are not finite"):
        schedule.quantize_linears([job], schedule.QuantSettings(group_size=32), GridSpec())


def test_groupquant_dequantize_formula():
    codes = torch.tensor([[0, 8, 15, 4]], dtype=torch.uint8)
    gq = GroupQuant(codes, torch.tensor([[0.5, -2.0]]), None, 2)
    assert gq.dequantize().tolist() == [[-4.0, 0.0, -14.0, 8.0]]
    gq_asym = GroupQuant(codes, torch.tensor([[0.5, -2.0]]), torch.tensor([[1.0, 0.25]]), 2)
    assert gq_asym.dequantize().tolist() == [[-3.0, 1.0, -13.75, 8.25]]


def test_parallel_row_blocks_equal_one_at_a_time(monkeypatch):
    """quantize_linears shares row blocks out to one worker per torch thread; every result
    (codes, scales, zeros, report) must equal the single-worker run bit for bit, in job order."""
    from cpu_quant.formats import get_format
    from cpu_quant.quantize import schedule as pipeline
    from cpu_quant.quantize.plan import plan_linear

    limits = get_format("gptq").limits
    monkeypatch.setattr(pipeline, "ROW_BLOCK", 48)  # the tall job spans 3 row blocks
    gen = torch.Generator().manual_seed(5)
    jobs = []
    for name, (n, k) in {"a": (40, 64), "tall": (130, 64), "b": (16, 128)}.items():
        x = torch.randn(256, k, generator=gen)
        jobs.append(pipeline.QuantJob(torch.randn(n, k, generator=gen).to(torch.bfloat16),
                                      plan_linear(name, k, n, 32, False, limits),
                                  2 * x.t() @ x / 256))
    runs = {}
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for grid in (GridSpec(), GridSpec(symmetric=False)):
                settings = pipeline.QuantSettings(method="gptq", group_size=32)
                runs[threads, grid.symmetric] = pipeline.quantize_linears(jobs, settings, grid)
    finally:
        torch.set_num_threads(previous)
    for sym in (True, False):
        one, two = runs[1, sym], runs[2, sym]
        assert [r.name for _, r in two] == ["a", "tall", "b"]
        for (g1, r1), (g2, r2) in zip(one, two, strict=True):
            assert torch.equal(g1.codes, g2.codes) and torch.equal(g1.scales, g2.scales)
            assert (g1.zeros is None) == sym and (sym or torch.equal(g1.zeros, g2.zeros))
            assert r1 == r2


def test_jobs_sharing_a_hessian_are_stacked_and_equal_alone(monkeypatch):
    """Linears that share a Hessian (q/k/v, gate/up) are quantized as one stacked matrix: one
    column sweep for all, and each result equal, bit for bit, to the linear quantized alone."""
    from cpu_quant.formats import get_format
    from cpu_quant.quantize import schedule as pipeline
    from cpu_quant.quantize.gptq import weighted_snr_db
    from cpu_quant.quantize.plan import plan_linear

    limits = get_format("gptq").limits
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(512, 64, generator=gen) * torch.rand(64, generator=gen) * 3
    shared = 2 * x.t() @ x / 512
    y = torch.randn(512, 64, generator=gen)
    own = 2 * y.t() @ y / 512
    shapes = {"q": (48, shared), "k": (16, shared), "v": (16, shared), "o": (40, own)}
    jobs = [pipeline.QuantJob(torch.randn(n, 64, generator=gen).to(torch.bfloat16),
                              plan_linear(name, 64, n, 32, False, limits), h)
            for name, (n, h) in shapes.items()]
    sweeps = []
    real = pipeline._quantize_rows
    monkeypatch.setattr(pipeline, "_quantize_rows",
                        lambda w, *a: (sweeps.append(w.shape[0]), real(w, *a))[1])
    for act_order in (True, False):
        sweeps.clear()
        settings = pipeline.QuantSettings(method="gptq", group_size=32, act_order=act_order)
        got = pipeline.quantize_linears(jobs, settings, GridSpec())
        assert sorted(sweeps) == [40, 80]  # q/k/v as one matrix, o alone
        for job, (gq, rep) in zip(jobs, got, strict=True):
            alone, _ = quantize_gptq(job.weight, job.hessian, 32, GridSpec(), act_order=act_order)
            assert torch.equal(gq.codes, alone.codes) and torch.equal(gq.scales, alone.scales)
            assert rep.name == job.plan.name and rep.shape == list(job.weight.shape)
            want = weighted_snr_db(job.weight, alone.dequantize(), torch.diag(job.hessian))
            assert abs(rep.weighted_snr_db - want) < 1e-3


def test_gram_equals_the_full_product_and_is_symmetric():
    """The Hessian's XᵀX from upper column blocks only: symmetric, and as close to the exact
    (float64) product as a float32 GEMM, for widths that a block does and does not divide."""
    from cpu_quant.quantize.hessians import GRAM_BLOCK, gram

    torch.manual_seed(0)
    for k in (64, GRAM_BLOCK, GRAM_BLOCK + 1, 576, 1536):
        x = torch.randn(300, k).to(torch.bfloat16).to(torch.float32)
        got = gram(x)
        exact = x.double().t() @ x.double()
        assert torch.equal(got, got.t()), k
        assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5, k
        # a wrong block placement would be far off, not a rounding error away
        assert torch.allclose(got, x.t() @ x, rtol=1e-4, atol=1e-3), k


def test_gram_is_the_exact_product_rounded_once():
    """bf16 activations whose products and sums float64 holds exactly (magnitudes within
    2^-4..2^4): gram is the exact XᵀX rounded once to float32, bit for bit, whatever the order
    of the rows within a slab; with several slabs and heavy-tailed channels, within float32's
    rounding of the float64 product."""
    from cpu_quant.quantize.hessians import GRAM_ROWS, SLAB_ELEMENTS, gram

    gen = torch.Generator().manual_seed(0)
    for k in (64, 577, 1536):
        rows = min(GRAM_ROWS, SLAB_ELEMENTS // k, 3000)
        mag = torch.ldexp(torch.ones(rows, k), torch.randint(-4, 4, (rows, k), generator=gen))
        x = (mag * (1 + torch.rand(rows, k, generator=gen)) * torch.sign(
            torch.randn(rows, k, generator=gen))).to(torch.bfloat16)
        exact = x.double().t() @ x.double()  # every product and partial sum is exact
        got = gram(x)
        assert torch.equal(got, exact.to(torch.float32)), k
        perm = torch.randperm(rows, generator=gen)
        assert torch.equal(gram(x[perm]), got), k
        spread = torch.rand(k, generator=gen).pow(3).mul(20).add(0.1)
        y = (torch.randn(4 * rows, k, generator=gen) * spread).to(torch.bfloat16)
        ref = y.double().t() @ y.double()
        err = gram(y).double() - ref
        assert (err.abs().max() / ref.abs().max()).item() < 1e-6, k
        assert (err.diagonal() / ref.diagonal()).abs().max().item() < 1e-6, k


# -- the phone's grids: positive scales, 8-bit per channel ------------------------------------

@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), outliers=st.booleans(), uniform=st.booleans())
def test_positive_search_gives_positive_scales_never_worse_than_absmax(seed, outliers, uniform):
    """--positive-scales: every scale >= 0 (XNNPACK/QNN store no negative block scale), codes
    exactly what those runtimes hold (a = q - 8 in [-8, 7] at that scale), and the weighted
    error never above the plain absmax scale's (which is positive itself)."""
    w, imp = _groups(seed, outliers)
    d = None if uniform else imp
    s = search_symmetric_scales(w, d, positive=True)
    assert bool((s >= 0).all()) and not bool(torch.signbit(s).any())
    assert torch.equal(s, round_scale(s))
    base = weighted_error(w, absmax_scales(w), d)
    assert torch.all(weighted_error(w, s, d) <= base * (1 + 1e-6) + 1e-30)


def test_positive_search_costs_little_against_the_signed_search():
    """The -8 level is still used by a group whose extreme is negative; only a positive extreme
    loses it. Measured here: the positive search keeps most of the signed search's gain over
    absmax (a search that lost it all would be no better than the baseline)."""
    w, imp = _groups(3, outliers=True, rows=512)
    base = weighted_error(w, absmax_scales(w), imp).sum()
    signed = weighted_error(w, search_symmetric_scales(w, imp), imp).sum()
    positive = weighted_error(w, search_symmetric_scales(w, imp, positive=True), imp).sum()
    assert signed <= positive <= base
    assert (base - positive) > 0.6 * (base - signed), (float(base), float(signed), float(positive))


def test_int8_levels_search_and_signed_codes():
    """INT8 levels: one scale per row over [-128, 127], never worse than absmax / 128, and
    quantize_signed(INT4) is exactly quantize_codes - 8."""
    from cpu_quant.quantize.scale_search import INT4, INT8, quantize_signed

    w, imp = _groups(5, outliers=True, rows=64, g=256)
    s = search_symmetric_scales(w, imp, positive=True, levels=INT8)
    assert s.shape == (64, 1) and bool((s > 0).all())
    a = quantize_signed(w, s, INT8)
    assert a.dtype == torch.int8 and int(a.min()) >= -128 and int(a.max()) <= 127

    def err(scale):
        e = w - quantize_signed(w, scale, INT8).float() * scale
        return (e * e * imp).sum()

    base = absmax_scales(w, INT8)
    assert err(s) <= err(base) * (1 + 1e-6)
    # rows of 256 with 3% outliers at 20x: 32.7 dB measured (4 bits on them: ~10 dB); a search
    # that picked a wrong scale range would lose tens of dB
    snr = 10 * torch.log10((w * w * imp).sum() / err(s))
    assert snr > 30, float(snr)
    s4 = search_symmetric_scales(w, imp)
    assert torch.equal(quantize_signed(w, s4, INT4).to(torch.int16) + 8,
                       quantize_codes(w, s4).to(torch.int16))


def test_w4a8_emulation_is_the_kernels_integer_arithmetic():
    """``int8_per_token`` then a float GEMM of the dequantized weights (what ``eval --w4a8``
    computes, in float32) equals the W4A8 kernel's published arithmetic, computed here in
    integers: activations to symmetric int8 per token (times 127 / amax in float32), weights as
    4-bit codes with the zero point 8 and one scale per group, int32 dot products per group,
    then the two scales."""
    from cpu_quant.quantize.hessians import int8_per_token

    gen = torch.Generator().manual_seed(3)
    m, k, n, g = 5, 256, 24, 64
    x = torch.randn(m, k, generator=gen) * torch.linspace(0.1, 8, k)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int64)
    w_scale = torch.rand(n, k // g, generator=gen, dtype=torch.float64) * 0.02 + 1e-3
    # the kernel's integers
    amax = x.abs().amax(-1, keepdim=True)
    x_scale = amax.double() / 127.0
    qx = torch.clamp(torch.round(x * (127.0 / amax)), -127, 127).to(torch.int64)
    assert qx.abs().max() == 127
    acc = torch.stack([(qx[:, a:a + g] @ (codes[:, a:a + g] - 8).T) for a in range(0, k, g)], -1)
    assert acc.abs().max() < 2**31  # an int32 accumulator holds every group's sum
    ref = (acc.double() * w_scale.unsqueeze(0)).sum(-1) * x_scale
    # the emulation
    w = (codes - 8).double() * w_scale.repeat_interleave(g, 1)
    got = int8_per_token(x).double() @ w.T
    assert (got - ref).abs().max() <= 1e-6 * ref.abs().max()  # float32 scales: the only rounding
    # a bf16 input (the calibration activations) comes back in bf16
    assert int8_per_token(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_w4a8_hessians_reach_the_product():
    """--w4a8-hessians: the accumulated Hessian is 2 XqᵀXq / n of the int8-per-token inputs,
    which differs from the bf16 inputs' Hessian."""
    from cpu_quant.quantize.hessians import HessianAccumulator, gram, int8_per_token, w4a8_gram

    gen = torch.Generator().manual_seed(4)
    lin = torch.nn.Linear(96, 8, bias=False).to(torch.bfloat16)
    x = (torch.randn(3, 40, 96, generator=gen) * torch.linspace(0.05, 6, 96)).to(torch.bfloat16)
    plain = HessianAccumulator({"lin": lin})
    quant = HessianAccumulator({"lin": lin}, product=w4a8_gram)
    with torch.no_grad():
        lin(x)
    flat = x.reshape(-1, 96)
    assert torch.equal(quant.hessian("lin"), 2.0 * gram(int8_per_token(flat)) / 120)
    assert torch.equal(plain.hessian("lin"), 2.0 * gram(flat) / 120)
    assert not torch.equal(quant.hessian("lin"), plain.hessian("lin"))
    plain.close()
    quant.close()


def test_the_head_takes_groups_of_32_under_calibrated_symmetric_gptq_only():
    from cpu_quant.formats import get_format
    from cpu_quant.quantize.plan import HEAD_GROUP, head_group
    from cpu_quant.quantize.settings import QuantSettings

    limits = get_format("gptq").limits
    assert head_group(QuantSettings(), 576, limits) == (HEAD_GROUP, "--group")
    # an explicit --head-group wins; elsewhere the head follows --group's rule
    assert head_group(QuantSettings(head_group=128), 576, limits) == (128, "--head-group")
    for other in (QuantSettings(group_size=32), QuantSettings(group_size=-1),
                  QuantSettings(method="rtn"),
                  QuantSettings(symmetric=False), QuantSettings(method="rtn", calib="none")):
        assert head_group(other, 576, limits) == (other.group_size, "--group")
    assert head_group(QuantSettings(), 48, limits) == (128, "--group")  # 32 does not divide 48


def test_the_down_projection_takes_groups_of_64_under_calibrated_symmetric_gptq_only():
    from cpu_quant.formats import get_format
    from cpu_quant.quantize.plan import DOWN_GROUP, linear_group, plan_linear
    from cpu_quant.quantize.settings import QuantSettings

    limits = get_format("gptq").limits
    down, up = "model.layers.3.mlp.down_proj", "model.layers.3.mlp.up_proj"
    assert linear_group(down, QuantSettings(), limits) == (DOWN_GROUP, "--group") == (64, "--group")
    assert linear_group(up, QuantSettings(), limits) == (128, "--group")
    # an explicit --down-group wins (128: the rule before); elsewhere --group's rule
    assert linear_group(down, QuantSettings(down_group=128), limits) == (128, "--down-group")
    for other in (QuantSettings(group_size=32), QuantSettings(group_size=64),
                  QuantSettings(group_size=-1), QuantSettings(method="rtn"),
                  QuantSettings(symmetric=False), QuantSettings(method="rtn", calib="none")):
        assert linear_group(down, other, limits) == (other.group_size, "--group")
    # in-features 64 does not divide: the usual fallback, and --strict-group names the flag
    assert plan_linear(down, 1504, 576, 64, False, limits).group_size == 32
    with pytest.raises(CpuQuantError, match="--down-group 64 does not divide"):
        plan_linear(down, 1504, 576, 64, True, limits, flag="--down-group")


def test_gram_is_the_same_bit_for_bit_whatever_its_blocks(monkeypatch):
    """A wide input (K = 2304: 9 blocks of 256 before the cap, 4 after) gives the same sums to
    the last bit in wide blocks as in narrow ones: each entry is one product over the same rows,
    only the number of GEMM calls changes."""
    from cpu_quant.quantize import hessians

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3000, 2304, generator=gen) * 2).to(torch.bfloat16)
    capped = hessians.gram(x)
    monkeypatch.setattr(hessians, "GRAM_MAX_BLOCKS", 10**6)
    narrow = hessians.gram(x)
    assert torch.equal(capped, narrow)
    assert torch.equal(capped, capped.t())


def test_a_short_stack_is_cut_per_thread_and_keeps_every_bit():
    """A stack with fewer row blocks than torch has threads is cut into one piece per thread,
    each starting at a multiple of 64 rows and none a sliver; the codes and scales of the
    whole run are those of one thread sweeping the whole matrix."""
    from cpu_quant.formats import get_format
    from cpu_quant.quantize import schedule
    from cpu_quant.quantize.plan import plan_linear
    from cpu_quant.quantize.settings import QuantSettings

    previous = torch.get_num_threads()
    try:
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for rows in (130, 960, 3072, 4096):
                pieces = schedule.LOCAL_ROWS.cut(0, rows)
                assert len(pieces) == min(threads, rows // 64)
                assert pieces[0].r0 == 0 and pieces[-1].r1 == rows
                assert all(a.r1 == b.r0 and b.r0 % 64 == 0 for a, b in itertools.pairwise(pieces))
                assert min(p.r1 - p.r0 for p in pieces) >= 32
            assert len(schedule.LOCAL_ROWS.cut(0, 100)) == 1  # fewer than 2 x 64 rows
            assert len(schedule.LOCAL_ROWS.cut(0, 3 * 4096)) == 3  # row blocks, as before
        gen = torch.Generator().manual_seed(21)
        x = _correlated_inputs(1024, 256, seed=21)
        h = 2 * x.t() @ x / x.shape[0]
        w = torch.randn(960, 256, generator=gen).to(torch.bfloat16)
        job = schedule.QuantJob(w, plan_linear("q_proj", 256, 960, 64, False,
                                               get_format("gptq").limits), h)
        got = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            (gq, _), = schedule.quantize_linears([job], QuantSettings(group_size=64), GridSpec())
            got[threads] = gq
        assert torch.equal(got[1].codes, got[2].codes) and torch.equal(got[1].scales, got[2].scales)
    finally:
        torch.set_num_threads(previous)
