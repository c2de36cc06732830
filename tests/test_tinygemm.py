"""cpu_int4 (tinygemm W4A16): layout, kernel, convert, vLLM, load_quantized and fidelity.

Fresh processes: ``tests/helpers/tinygemm_isa.py`` checks the layout on the ISA path chosen by
``ATEN_CPU_CAPABILITY`` (torch reads it once, at start-up); ``tests/helpers/vllm_generate.py``
runs real vLLM, shared with the GPTQ end-to-end test (one engine serves every vLLM check here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpu_quant.core.cpu import local_cpu
from cpu_quant.core.errors import CpuQuantError
from cpu_quant.formats.cpu_int4 import layout as tp
from cpu_quant.formats.kernels import serving_kernels

from .conftest import REPO, SMALL_CALIB, build_once, run_cli
from .helpers.tinygemm_isa import random_module as _random_module
from .helpers.vllm_paths import NEAR_TIE_NATS
from .test_gptq_end_to_end import NEW_TOKENS, PROMPTS, _vllm_greedy

ISA_HELPER = REPO / "tests" / "helpers" / "tinygemm_isa.py"
# The same token's log-prob through vLLM's two paths (kernel for decode, dequantize + bf16 GEMM
# for the re-scoring prefill): the kernel keeps float32 weights and the prefill path rounds them
# to bf16, and both round logits to bf16 (one ulp is 0.125 nats at |logit| in [16, 32)).
# Measured at most 0.14 nats on the demo artifact; the bound allows about two and a half ulps.
PATH_LOGPROB_NATS = 0.3


# -- the layout and the kernel (unit level) ------------------------------------------------------
def _available_isas() -> list[str]:
    caps = torch.backends.cpu.get_cpu_capability()
    order = ["default", "avx2", "avx512"]
    top = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}.get(caps, 0)
    return order[: top + 1]


@pytest.fixture(scope="module")
def isa_results() -> dict[str, subprocess.CompletedProcess]:
    """One fresh process per ISA path this CPU offers, started together (each spends most of
    its time importing torch)."""
    procs = {isa: subprocess.Popen([sys.executable, str(ISA_HELPER)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, cwd=REPO,
                                   env=dict(os.environ, ATEN_CPU_CAPABILITY=isa))
             for isa in _available_isas()}
    results = {}
    for isa, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        results[isa] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.parametrize("isa", ["avx512", "avx2", "default"])
def test_layout_round_trips_against_torch_packer(isa: str, isa_results):
    """Bit-exact on every ISA path this CPU offers: our packer, reader, in-place repack and
    kernel-layout dequantization against ``_convert_weight_to_int4pack_for_cpu``."""
    if isa not in isa_results:
        pytest.skip(f"this CPU does not offer the {isa} path")
    proc = isa_results[isa]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    expected = {"avx512": ("AVX512", 64, "split"), "avx2": ("AVX2", 32, "split"),
                "default": ("DEFAULT", 32, "paired")}[isa]
    assert (result["isa"], result["block_n"], result["full_block"]) == expected


def _error_bound(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, weight_rounding: bool
                 ) -> torch.Tensor:
    """What bf16 arithmetic may cost against a float32 reference ``x @ w.T``.

    The output is rounded to bf16 (half an ulp: 2^-9 relative); float32 accumulation over K
    adds at most K·2^-24·Σ|x||w|; a path that rounds the weights to bf16 first adds 2^-9·Σ|x||w|.
    Doubled for margin.
    """
    mag = x.abs().float() @ w.abs().t()
    per_term = x.shape[1] * 2.0**-24 + (2.0**-9 if weight_rounding else 0.0)
    return 2 * (2.0**-9 * ref.abs() + per_term * mag)


@pytest.mark.parametrize("gemm", ["bfloat16", "float32"])
def test_kernel_and_prefill_path_match_the_dequantized_reference(gemm: str, monkeypatch):
    """Both prefill GEMMs of the kernel table: ``bfloat16`` rounds the weights to bf16 first,
    ``float32`` multiplies the exact float32 weights."""
    from cpu_quant.formats.cpu_int4 import kernel as rt

    monkeypatch.setattr(rt, "PREFILL_GEMM", gemm)

    n, k, group = 576, 1536, 128
    codes, scale, zero = _random_module(n, k, group, seed=3)
    w = tp.dequantize_cpu_int4(tp.pack_codes(codes), scale, zero)
    packed = tp.torch_pack(codes)
    storage, sview, zview = tp.scale_zero_storage(n, k, group)
    sview.copy_(scale)
    zview.copy_(zero)
    gen = torch.Generator().manual_seed(4)
    before = dict(rt.PATH_CALLS)
    for rows in (1, 3, rt.KERNEL_MAX_ROWS + 37):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        ref = x.float() @ w.t()
        got = torch.ops.cpu_quant.int4pack_linear(x, packed, storage, group).float()
        kernel_path = rows <= rt.KERNEL_MAX_ROWS
        bound = _error_bound(x, w, ref, weight_rounding=not kernel_path and gemm == "bfloat16")
        assert bool(((got - ref).abs() <= bound).all()), \
            f"{rows} rows: max excess {float(((got - ref).abs() - bound).max()):.3g}"
        if kernel_path:  # the op's kernel path is exactly torch's kernel
            direct = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, storage)
            assert torch.equal(got, direct.float())
    assert rt.PATH_CALLS["kernel"] - before["kernel"] == 2
    assert rt.PATH_CALLS["dequantize"] - before["dequantize"] == 1


@pytest.mark.parametrize("arrangement", ["split", "paired"])
def test_fused_dequantize_reads_both_block_arrangements(arrangement: str):
    """The compiled prefill dequantizer's arithmetic (run eagerly here, on a layout of each
    arrangement torch's packers use) gives the bf16 rows the kernel-layout reader gives."""
    from cpu_quant.formats.cpu_int4 import kernel as rt

    layout = tp.KernelLayout("test", 64, arrangement)
    n, k, group = 192, 256, 64
    codes, scale, zero = _random_module(n, k, group, seed=8)
    packed = layout.pack(codes)
    storage, sview, zview = tp.scale_zero_storage(n, k, group)
    sview.copy_(scale)
    zview.copy_(zero)
    want = tp.dequantize_kernel_rows(packed, storage, group, 64, 192, layout)
    blocks = packed[64:192].view(2, k, 32)
    got = rt._blocks_to_rows(blocks, storage[:, 64:192], split=arrangement == "split")
    assert torch.equal(got, want)


FUSED_THREADS = (1, 2, 3)  # one, this machine's two cores, and more threads than cores


def test_fused_prefill_equals_the_eager_prefill_bit_for_bit(monkeypatch):
    """The default bf16 prefill dequantizes through a compiled one-pass function; its output
    equals the eager path's bit for bit at every thread count (each path run at the same one):
    several chunks (more than one fused tile), and a last chunk with a partial block, which
    takes the eager path."""
    from cpu_quant.formats.cpu_int4 import kernel as rt
    from cpu_quant.quantize.schedule import torch_threads

    monkeypatch.setattr(rt, "PREFILL_GEMM", "bfloat16")
    layout = tp.kernel_layout()
    k, group = 1024, 128
    gen = torch.Generator().manual_seed(9)
    for n in (5 * 1024, 1024 + layout.block_n + 16):
        codes, scale, zero = _random_module(n, k, group, seed=n)
        packed = tp.torch_pack(codes)
        storage, sview, zview = tp.scale_zero_storage(n, k, group)
        sview.copy_(scale)
        zview.copy_(zero)
        x = torch.randn(rt.KERNEL_MAX_ROWS + 5, k, generator=gen).to(torch.bfloat16)
        for threads in FUSED_THREADS:
            with torch_threads(threads):
                monkeypatch.setattr(rt, "FUSED_DEQUANTIZE", True)
                fused = torch.ops.cpu_quant.int4pack_linear(x, packed, storage, group)
                assert rt._fused.get(layout.full_block) is not None, \
                    "the fused dequantizer did not compile"
                monkeypatch.setattr(rt, "FUSED_DEQUANTIZE", False)
                eager = torch.ops.cpu_quant.int4pack_linear(x, packed, storage, group)
            assert torch.equal(fused, eager), f"{n} rows, {threads} threads"


def test_both_dequantizers_give_the_same_bf16_tile_at_any_thread_count(monkeypatch):
    """What the op's bit-identity rests on, independently of any GEMM: the compiled
    dequantizer's bf16 tile equals the eager one's, and neither changes with the thread count
    (elementwise arithmetic, no reduction)."""
    from cpu_quant.formats.cpu_int4 import kernel as rt
    from cpu_quant.quantize.schedule import torch_threads

    monkeypatch.setattr(rt, "FUSED_DEQUANTIZE", True)
    layout = tp.kernel_layout()
    n, k, group = 4 * layout.block_n * 8, 1024, 64
    codes, scale, zero = _random_module(n, k, group, seed=5)
    packed = tp.torch_pack(codes)
    storage, sview, zview = tp.scale_zero_storage(n, k, group)
    sview.copy_(scale)
    zview.copy_(zero)
    tiles = []
    for threads in FUSED_THREADS:
        with torch_threads(threads):
            fused = rt._fused_rows(layout, packed, storage, 0, n)
            assert fused is not None, "the fused dequantizer did not compile"
            tiles += [fused.clone(),
                      rt._eager_bf16_rows(packed, storage, group, 0, n, layout).clone()]
    assert all(torch.equal(tiles[0], t) for t in tiles[1:])
    assert torch.equal(tiles[0], tp.dequantize_kernel_rows(packed, storage, group, 0, n, layout))


@pytest.mark.parametrize("name,bad,good,reader,parsed", [
    ("CPU_QUANT_INT4_KERNEL_MAX_ROWS", "many", "0", "_kernel_max_rows", 0),
    ("CPU_QUANT_INT4_PREFILL_GEMM", "float16", "float32", "_prefill_gemm", "float32"),
    ("CPU_QUANT_INT4_FUSED_DEQUANTIZE", "yes", "0", "_fused_dequantize_enabled", False),
])
def test_runtime_switches_refuse_bad_values_in_one_line(name, bad, good, reader, parsed,
                                                        monkeypatch):
    from cpu_quant.formats.cpu_int4 import kernel as rt

    monkeypatch.setenv(name, bad)
    with pytest.raises(CpuQuantError) as exc:
        getattr(rt, reader)()
    assert name in str(exc.value) and "\n" not in str(exc.value)
    monkeypatch.setenv(name, good)
    assert getattr(rt, reader)() == parsed


def test_prefill_path_keeps_no_copy_of_the_weights(monkeypatch):
    """The dequantize path's only memory beyond its output is the tile buffers, reused by every
    chunk and call: their size does not grow with the weight (a 4x larger matrix leaves them
    as they were), and they are far smaller than the dequantized weight."""
    from cpu_quant.formats.cpu_int4 import kernel as rt

    def scratch_bytes() -> int:
        return sum(b.numel() * b.element_size() for b in vars(rt._scratch).values())

    k, group, rows = 1024, 128, rt.KERNEL_MAX_ROWS + 1
    sizes = {}
    for gemm in ("float32", "bfloat16"):
        monkeypatch.setattr(rt, "PREFILL_GEMM", gemm)
        for n in (2048, 8192):
            packed = tp.torch_pack(torch.randint(0, 16, (n, k), dtype=torch.int32))
            storage, sview, _ = tp.scale_zero_storage(n, k, group)
            sview.fill_(0.01)
            torch.ops.cpu_quant.int4pack_linear(torch.randn(rows, k).to(torch.bfloat16), packed,
                                                storage, group)
            sizes[(gemm, n)] = scratch_bytes()
    assert sizes[("float32", 2048)] == sizes[("float32", 8192)]
    assert sizes[("bfloat16", 2048)] == sizes[("bfloat16", 8192)]
    # the float32 tile, the bf16 tile and the output tile: a few MiB, against 32 MiB for the
    # larger weight dequantized to float32
    assert sizes[("bfloat16", 8192)] <= 4 * tp.CHUNK_WEIGHTS * 4 < 8192 * k * 4


def test_gptq_layers_repack_to_the_kernel_exactly():
    """The opt-in GPTQ-on-tinygemm kernel (formats/gptq/vllm_kernel.py): a symmetric GPTQ
    layer's qweight/scales become the bytes torch's own packer makes from the same codes, and
    the kernel tensor dequantizes to exactly what vLLM's GPTQ reading ((q - 8) * s) gives.
    Wider than one column chunk, so the chunk boundary is crossed."""
    from cpu_quant.formats.gptq.layout import dequantize_gptq, pack_gptq_qweight
    from cpu_quant.formats.gptq.vllm_kernel import COLUMN_CHUNK, gptq_to_kernel

    n, k, group = COLUMN_CHUNK + 64, 128, 64
    codes, scale, _ = _random_module(n, k, group, seed=5)
    qweight, scales = pack_gptq_qweight(codes), scale.t().contiguous()  # [K/8, N], [K/g, N]
    packed, storage = gptq_to_kernel(qweight, scales, group)
    assert torch.equal(packed, tp.torch_pack(codes))
    assert torch.equal(storage[..., 0], scales) and not storage[..., 1].any()
    eights = torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32)  # v1 zeros: 7 (+1)
    reference = dequantize_gptq(qweight, eights, scales, None)
    got = tp.dequantize_kernel_rows(packed, storage, group, 0, n)
    assert torch.equal(got, reference.to(torch.bfloat16))


def test_gptq_tinygemm_takes_only_what_it_computes_exactly():
    from vllm.scalar_type import scalar_types

    from cpu_quant.formats.gptq.vllm_kernel import gptq_tinygemm_problem

    ok = dict(weight_type=scalar_types.uint4b8, zero_points=False, act_type=torch.bfloat16)
    assert gptq_tinygemm_problem(576, 960, 64, **ok) is None
    assert "uint4b8" in gptq_tinygemm_problem(576, 960, 64, **{**ok, "weight_type": scalar_types.uint4})
    assert "zero points" in gptq_tinygemm_problem(576, 960, 64, **{**ok, "zero_points": True})
    assert "bf16" in gptq_tinygemm_problem(576, 960, 64, **{**ok, "act_type": torch.float16})
    assert "does not divide" in gptq_tinygemm_problem(576, 960, 128, **ok)
    assert "multiple of 16" in gptq_tinygemm_problem(576, 968, 64, **ok)


def test_batch_size_branch_does_not_guard_a_compiled_graph():
    """Compiled with dynamic shapes, one graph serves 1 row and 100 rows; the same branch
    written outside the op recompiles (the control shows the check can fail)."""
    from torch._dynamo.testing import CompileCounter

    from cpu_quant.formats.cpu_int4 import kernel as rt

    n, k, group = 64, 128, 64
    codes, scale, zero = _random_module(n, k, group)
    packed = tp.torch_pack(codes)
    storage, sview, zview = tp.scale_zero_storage(n, k, group)
    sview.copy_(scale)
    zview.copy_(zero)
    layout = tp.kernel_layout()

    def through_op(x):
        return torch.ops.cpu_quant.int4pack_linear(x, packed, storage, group) * 2

    def branch_outside(x):
        if x.shape[0] <= rt.KERNEL_MAX_ROWS:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, storage) * 2
        return x @ tp.dequantize_kernel_rows(packed, storage, group, 0, n, layout).t() * 2

    torch._dynamo.reset()
    counts = {}
    for fn in (through_op, branch_outside):
        counter = CompileCounter()
        compiled = torch.compile(fn, backend=counter, dynamic=True, fullgraph=True)
        # sizes that equal no weight dim (dynamo specialises 1 and duck-sizes equal dims)
        for rows in (5, 7, 100, 130):
            compiled(torch.randn(rows, k).to(torch.bfloat16))
        counts[fn.__name__] = counter.frame_count
    torch._dynamo.reset()
    assert counts == {"through_op": 1, "branch_outside": 2}, counts


def test_shapes_the_kernel_cannot_take_are_refused():
    from cpu_quant.formats.cpu_int4.kernel import Int4PackedLinear

    assert tp.kernel_shape_problem(576, 576, 64) is None
    for n, k, g, words in [(40, 64, 32, "multiple of 16"), (64, 576, 128, "does not divide"),
                           (64, 64, 16, "not one the tinygemm kernel takes"),
                           (64, 576, 576, "not one the tinygemm kernel takes")]:
        assert words in tp.kernel_shape_problem(n, k, g)
        with pytest.raises(CpuQuantError, match="cannot be stored as cpu_int4"):
            tp.check_kernel_shape("m", n, k, g)
    with pytest.raises(CpuQuantError, match="cannot tile"):
        tp.repack_to_kernel_(torch.zeros(40, 32, dtype=torch.uint8))
    with pytest.raises(CpuQuantError):
        Int4PackedLinear(576, 40, 64, bias=False)
    layout = tp.kernel_layout()
    packed = tp.torch_pack(torch.zeros(3 * layout.block_n + 16, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not fall on the kernel"):
        layout.codes(packed, 0, layout.block_n // 2)  # half a block: never guessed


def test_tinygemm_refuses_a_group_the_kernel_cannot_take(tmp_path: Path, demo_src: Path):
    dst = tmp_path / "out"
    proc = run_cli("tinygemm", str(demo_src), str(dst), "--group", "-1", "--no-eval", check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --group -1")
    assert not dst.exists() and not list(tmp_path.iterdir())


# -- real artifacts (session fixtures) -----------------------------------------------------------
@pytest.fixture(scope="session")
def asym_artifact(demo_src: Path, artifacts_dir: Path) -> Path:
    """The default: calibrated GPTQ on the asymmetric grid, group 128, head quantized."""
    dst = artifacts_dir / "demo-cpu_int4"
    return build_once(dst, lambda: run_cli("tinygemm", str(demo_src), str(dst), "--group", "128",
                                           *SMALL_CALIB, "--no-eval"))


@pytest.fixture(scope="session")
def sym_artifact(gptq_artifact: Path, artifacts_dir: Path) -> Path:
    """The shared GPTQ artifact (same calibration), repacked: the symmetric grid as cpu_int4."""
    dst = artifacts_dir / "demo-cpu_int4-from-gptq"

    def build() -> None:
        proc = run_cli("convert", str(gptq_artifact), str(dst), "--to", "cpu_int4")
        assert "converted 211 modules" in proc.stdout, proc.stdout

    return build_once(dst, build)


def test_config_and_tensors_describe_a_cpu_int4_checkpoint(asym_artifact: Path):
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.core.naming import group_for_module

    ckpt = open_checkpoint(asym_artifact)
    q = ckpt.config["quantization_config"]
    assert q["quant_method"] == "cpu_int4" and q["format_version"] == 1 and q["bits"] == 4
    assert q["group_size"] == 128 and q["sym"] is False and q["lm_head"] is True
    assert q["embedding"] == "bf16" and ckpt.config["tie_word_embeddings"] is False
    # SmolLM2's hidden size 576 is not a multiple of 128: group 64 there, HF and vLLM names
    for mod, g in [("model.layers.3.self_attn.qkv_proj", 64), ("model.layers.3.mlp.up_proj", 64),
                   ("model.layers.3.mlp.gate_up_proj", 64), ("model.layers.3.mlp.down_proj", 128),
                   ("lm_head", 64)]:
        assert group_for_module(q["dynamic"], mod, 128) == g
    names = set(ckpt.names)
    assert "lm_head.weight" not in names and ckpt.dtype("model.embed_tokens.weight") == "BF16"
    for mod, n, k, g in [("model.layers.0.self_attn.k_proj", 192, 576, 64),
                         ("model.layers.29.mlp.down_proj", 576, 1536, 128),
                         ("lm_head", 49152, 576, 64)]:
        assert f"{mod}.weight" not in names
        assert ckpt.shape(f"{mod}.weight_packed") == (n, k // 2)
        assert ckpt.dtype(f"{mod}.weight_packed") == "U8"
        for t in ("weight_scale", "weight_zero"):
            assert ckpt.shape(f"{mod}.{t}") == (n, k // g) and ckpt.dtype(f"{mod}.{t}") == "BF16"
    assert bool((ckpt.tensor("model.layers.5.mlp.gate_proj.weight_zero") != 0).any())
    report = json.loads((asym_artifact / "quantization_report.json").read_text())
    assert report["layout"] == "cpu_int4" and report["head_quantized"] is True
    assert 4.2 < report["bits_per_weight"] < 4.6  # codes + bf16 scale + bf16 zero per group


def test_convert_repacks_symmetric_gptq_losslessly(gptq_artifact: Path, sym_artifact: Path):
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.formats import get_format

    src, dst = open_checkpoint(gptq_artifact), open_checkpoint(sym_artifact)
    q = dst.config["quantization_config"]
    assert q["quant_method"] == "cpu_int4" and q["sym"] is True
    assert q["converted_from"] == "gptq" and q["lm_head"] is True
    assert q["dynamic"] == src.config["quantization_config"]["dynamic"]
    modules = [n[: -len(".qweight")] for n in src.names if n.endswith(".qweight")]
    assert len(modules) == 30 * 7 + 1
    gptq, int4 = get_format("gptq"), get_format("cpu_int4")
    for m in modules:
        a = gptq.dequantize(gptq.read_tensors(src, m), src.config["quantization_config"])
        b = int4.dequantize(int4.read_tensors(dst, m), q)
        assert torch.equal(a, b), m
        assert not bool(dst.tensor(f"{m}.weight_zero").any())
    gptq_suffixes = ("qweight", "qzeros", "scales", "g_idx")
    rest = [n for n in src.names if n.rpartition(".")[2] not in gptq_suffixes]
    for n in rest:
        assert torch.equal(src.tensor(n), dst.tensor(n)), n
    assert set(dst.names) == set(rest) | {f"{m}.{t}" for m in modules for t in tp.TENSORS}


def _link_tree(src: Path, dst: Path) -> None:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copyfile(f, dst / f.name)


def _synthetic_gptq(dst: Path, config: dict, n: int, k: int, group: int) -> Path:
    """A whole one-layer Llama checkpoint (hidden size ``n``, intermediate size ``k``, one head,
    a 256-token vocabulary; ``config``'s quantization_config) whose one quantized module is
    ``model.layers.0.mlp.down_proj``, [n x k] in symmetric GPTQ of group ``group`` with random
    codes; the ``dynamic`` rules keep every other linear bf16, as a GPTQ run's plan would."""
    import transformers
    from safetensors.torch import save_file

    from cpu_quant.core.grid import GroupQuant
    from cpu_quant.formats.gptq.layout import gptq_module_tensors

    dst.mkdir()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=n, intermediate_size=k,
                                   num_hidden_layers=1, num_attention_heads=1,
                                   num_key_value_heads=1, head_dim=n, tie_word_embeddings=True,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    module = "model.layers.0.mlp.down_proj"
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()
               if name != f"{module}.weight" and name != "lm_head.weight"}
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    quant = gptq_module_tensors(GroupQuant(codes, torch.rand(n, k // group), None, group))
    tensors.update({f"{module}.{t}": v for t, v in quant.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    out = cfg.to_dict()
    out["architectures"] = ["LlamaForCausalLM"]
    out["torch_dtype"] = "bfloat16"
    qcfg = json.loads(json.dumps(config["quantization_config"]))
    qcfg.update(sym=True, group_size=group,
                dynamic={r"-:model\.layers\.0\.(self_attn\..*|mlp\.(gate|up)_proj)": {}})
    out["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(out))
    return dst


def _one_zero_of_7(ckpt: Path, sym: bool) -> Path:
    """The synthetic checkpoint with one stored zero of 6 (a real zero of 7, v1) and the config's
    ``sym`` set as given."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.qzeros"][0, 0] = 0x77777776
    save_file(tensors, str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["sym"] = sym
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


@pytest.mark.e2e
def test_convert_refuses_bad_input_with_one_line_and_no_output(demo_src: Path, tmp_path: Path):
    """A checkpoint whose zero points the target cannot hold, or whose shapes the kernel cannot
    take: one ``error:`` line, non-zero exit, nothing written."""
    from cpu_quant.formats.gptq.layout import gptq_quantization_config

    config = json.loads((demo_src / "config.json").read_text())
    config["quantization_config"] = gptq_quantization_config(128, False, {})
    # (a) an asymmetric GPTQ checkpoint (sym false, a real zero of 7) to GPTQ's symmetric layout
    asym = _one_zero_of_7(_synthetic_gptq(tmp_path / "asym", config, 64, 128, 128), sym=False)
    # (b) the config says symmetric but one stored zero is 6 (a real zero of 7)
    zeros_asym = _one_zero_of_7(_synthetic_gptq(tmp_path / "zeros_asym", config, 64, 128, 128),
                                sym=True)
    # (c) 40 out-features: the kernel's 16-row output blocks cannot tile it
    rows_40 = _synthetic_gptq(tmp_path / "rows_40", config, 40, 128, 128)
    # (d) one group per row (K = 576): not a group the kernel takes
    per_row = _synthetic_gptq(tmp_path / "per_row", config, 64, 576, 576)
    cases = [(asym, "gptq", "holds only the symmetric grid"),
             (zeros_asym, "cpu_int4", "qzeros are not all 8"),
             (rows_40, "cpu_int4", "not a multiple of 16"),
             (per_row, "cpu_int4", "not one the tinygemm kernel takes")]
    for bad, target, words in cases:
        out = tmp_path / f"out-{bad.name}"
        proc = run_cli("convert", str(bad), str(out), "--to", target, check=False)
        assert proc.returncode != 0
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], \
            proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")]


@pytest.mark.e2e
def test_convert_round_trips_and_keeps_an_asymmetric_grid(demo_src: Path, tmp_path: Path):
    """Any format to any other and back, bit for bit; an asymmetric GPTQ checkpoint keeps its
    zeros in cpu_int4, where (8 - z) * s is exact."""
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.formats import get_format
    from cpu_quant.formats.gptq.layout import gptq_quantization_config

    config = json.loads((demo_src / "config.json").read_text())
    config["quantization_config"] = gptq_quantization_config(128, False, {})
    src = _one_zero_of_7(_synthetic_gptq(tmp_path / "src", config, 64, 256, 128), sym=False)
    run_cli("convert", str(src), str(tmp_path / "int4"), "--to", "cpu_int4")
    run_cli("convert", str(tmp_path / "int4"), str(tmp_path / "int4-again"), "--to", "cpu_int4")
    gptq, int4 = get_format("gptq"), get_format("cpu_int4")
    m = "model.layers.0.mlp.down_proj"
    a, b = open_checkpoint(src), open_checkpoint(tmp_path / "int4-again")
    wa = gptq.dequantize(gptq.read_tensors(a, m), a.config["quantization_config"])
    wb = int4.dequantize(int4.read_tensors(b, m), b.config["quantization_config"])
    assert torch.equal(wa, wb)
    assert b.config["quantization_config"]["sym"] is False
    assert bool(b.tensor(f"{m}.weight_zero").any())


def _cli_eval(artifact: Path, reference: Path, out: Path) -> dict:
    # small (4 x 256 tokens): the two grids differ by far more than this sample's noise
    # (measured: asymmetric 0.079 vs symmetric 0.167 nats at 4 x 256; larger samples in the docs)
    run_cli("eval", str(artifact), "--reference", str(reference), "--windows", "4",
            "--seqlen", "256", "--prompts", "2", "--new-tokens", "4", "--output-json", str(out))
    return json.loads(out.read_text())["fidelity"]["weights"]


@pytest.mark.slow
def test_asymmetric_grid_beats_symmetric_on_heldout_kl(asym_artifact, sym_artifact, demo_src,
                                                       tmp_path: Path):
    """``cpu-quant eval`` on both (same pipeline, calibration, groups and head; only the grid
    differs). Full-size numbers: docs/tinygemm.md."""
    kl = {name: _cli_eval(path, demo_src, tmp_path / f"{name}.json")["kl_mean"]
          for name, path in [("asym", asym_artifact), ("sym", sym_artifact)]}
    print(f"held-out KL: asymmetric {kl['asym']:.4f}, symmetric {kl['sym']:.4f} nats")
    assert 0 < kl["asym"] < kl["sym"], kl


def test_load_quantized_is_exposed_lazily():
    code = ("import sys, cpu_quant; assert 'torch' not in sys.modules; "
            "assert callable(cpu_quant.load_quantized); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_load_quantized_takes_gptq_through_the_registry(tiny_llama: Path, tmp_path: Path):
    """One symmetric run written as GPTQ and as cpu_int4: ``load_quantized`` of the GPTQ
    directory (repacked on the way in by convert's exact repack) holds the very bytes of the
    cpu_int4 directory's modules and gives identical logits; both are within bf16 arithmetic of
    the float32 model of the dequantized weights."""
    from cpu_quant import load_quantized
    from cpu_quant.eval.dequantized import load_model
    from cpu_quant.formats import parse_formats
    from cpu_quant.formats.cpu_int4 import kernel as rt
    from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint

    dst = tmp_path / "q"
    settings = QuantSettings(method="rtn", calib="none", scale_search=False, group_size=64)
    quantize_checkpoint(tiny_llama, dst, settings, parse_formats("gptq,cpu_int4"), progress=False)
    from_gptq, from_int4 = load_quantized(dst / "gptq"), load_quantized(dst / "cpu_int4")
    quantized = [n for n, m in from_int4.named_modules() if isinstance(m, rt.Int4PackedLinear)]
    assert len(quantized) == 2 * 7 + 1  # every linear and the head
    for name in quantized:
        a, b = from_gptq.get_submodule(name), from_int4.get_submodule(name)
        assert isinstance(a, rt.Int4PackedLinear), name
        assert torch.equal(a.packed, b.packed) and torch.equal(a.scale_zeros, b.scale_zeros), name
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = from_gptq(input_ids=ids).logits.float()
        assert torch.equal(got, from_int4(input_ids=ids).logits.float())
        ref = load_model(dst / "gptq")(input_ids=ids).logits.float()
    # bf16 activations through two layers against float32: measured cosine > 0.9999 here
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)
    assert cos > 0.999, cos


@pytest.mark.parametrize("fixture", ["gptqmodel_v1", "transformers_v2"])
def test_load_quantized_refuses_what_it_cannot_hold_exactly(fixture: str):
    """Foreign GPTQ checkpoints with fp16 scales: bf16 (the kernel's scale dtype) would round
    them, so the load is refused with one message naming the module and suggesting convert."""
    from cpu_quant import load_quantized

    path = REPO / "tests" / "fixtures" / "foreign" / fixture
    with pytest.raises(CpuQuantError) as exc:
        load_quantized(path)
    message = str(exc.value)
    assert "\n" not in message and "cannot hold these weights exactly" in message
    assert f"cpu-quant convert {path} DST --to cpu_int4" in message


def test_load_quantized_refuses_a_format_it_does_not_read(tiny_llama: Path):
    from cpu_quant import load_quantized

    with pytest.raises(CpuQuantError, match="not a checkpoint load_quantized reads .*cpu_int4"):
        load_quantized(tiny_llama)  # bf16, no quantization_config


# -- runtimes: vLLM, load_quantized, the torch reference -----------------------------------------
@pytest.fixture(scope="session")
def prompt_ids(demo_src: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_src)
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="session")
def vllm_run(asym_artifact: Path, prompt_ids, tmp_path_factory) -> dict:
    """One real vLLM engine for every vLLM check: greedy decode, then each prompt + its
    continuation re-scored as one prefill. Every installed plugin is on (ours comes through its
    entry point); no quantization argument; the engine runs in the helper's process so that the
    op's path counters can be read there. Eager, as the GPTQ test: compiling costs over a minute
    here; the compiled graph is covered by the dynamo test above and by the benchmark, which
    serves this layout compiled."""
    results, log = _vllm_greedy(asym_artifact, prompt_ids, tmp_path_factory.mktemp("vllm"),
                                plugins=None, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                   # the re-scoring prefill (4 sequences) above
                                                   # the threshold on every CPU's row
                                                   "CPU_QUANT_INT4_KERNEL_MAX_ROWS": "16"},
                                extra_args=(json.dumps({"enable_prefix_caching": False}),
                                            "--rescore"))
    info = [ln for ln in log.splitlines() if ln.startswith("INFO {")]
    assert info, log[-3000:]
    return {"sequences": results, "log": log, **json.loads(info[-1][len("INFO "):])}


def _assert_same_greedy(expected: list[int], got: list[int], margins: list, what: str) -> None:
    first = next((i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b), None)
    if first is not None:
        margin = margins[first]
        assert margin is not None and margin < NEAR_TIE_NATS["w4a16"], (
            f"{what} diverged at token {first} with a top-2 margin of {margin:.3f} nats: "
            f"{got} vs {expected}")


@pytest.mark.vllm
def test_vllm_serves_the_artifact_from_its_config_alone(vllm_run: dict, asym_artifact: Path,
                                                        prompt_ids):
    from cpu_quant.eval.dequantized import load_model
    from cpu_quant.eval.fidelity import _greedy

    assert vllm_run["cpu_quant_imported_before_llm"] == []  # no import: the entry point did it
    assert vllm_run["quantization"] == "cpu_int4"
    assert "cpu_quant patch cpu_int4: applied" in vllm_run["log"]
    assert "cpu_int4: tinygemm kernel layout" in vllm_run["log"]
    reference = load_model(asym_artifact, torch.bfloat16)
    for prompt, seq in zip(prompt_ids, vllm_run["sequences"], strict=True):
        expected = _greedy(reference, torch.tensor([prompt]), NEW_TOKENS)[0].tolist()
        _assert_same_greedy(expected, seq["tokens"], seq["top2_margin"],
                            "vLLM vs the dequantized weights")


@pytest.mark.vllm
def test_vllm_prefill_and_decode_paths_agree(vllm_run: dict):
    """Every greedily decoded token (tinygemm kernel, a few rows per step) is also the top token
    when the whole sequence is re-scored in one prefill (dequantize + bf16 GEMM)."""
    calls = vllm_run["path_calls"]
    # the knobs are connected: decode steps ran the kernel, the re-scoring prefill (4 sequences,
    # well over the 16 rows the engine was given as its threshold) the dequantize path
    assert calls["generate"]["kernel"] > 0, calls
    assert calls["rescore"]["dequantize"] > 0, calls
    if serving_kernels(local_cpu()).prefill_gemm == "bfloat16":  # and the compiled dequantizer
        assert calls["rescore"]["fused_tiles"] > 0, calls
    worst = 0.0
    for seq in vllm_run["sequences"]:
        for i, (margin, lp, p) in enumerate(zip(seq["top2_margin"], seq["logprob"],
                                                seq["prefill"], strict=True)):
            if p["rank"] != 1:  # a swap is allowed only where one of the paths saw a near-tie
                gap = p["best"] - p["logprob"]
                assert min(gap, margin) < NEAR_TIE_NATS["w4a16"], (
                    f"token {i}: prefill ranks it {p['rank']} ({gap:.3f} nats below the top), "
                    f"decode chose it by {margin:.3f}")
            worst = max(worst, abs(lp - p["logprob"]))
    assert worst < PATH_LOGPROB_NATS, worst


@pytest.mark.vllm
def test_load_quantized_generates_what_vllm_generates(vllm_run: dict, asym_artifact: Path,
                                                      prompt_ids):
    import cpu_quant
    from cpu_quant.eval.fidelity import _greedy
    from cpu_quant.formats.cpu_int4 import kernel as rt

    model = cpu_quant.load_quantized(asym_artifact)
    assert isinstance(model.lm_head, rt.Int4PackedLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, rt.Int4PackedLinear)
    assert not isinstance(model.model.embed_tokens, rt.Int4PackedLinear)
    before = dict(rt.PATH_CALLS)
    for prompt, seq in zip(prompt_ids, vllm_run["sequences"], strict=True):
        got = _greedy(model, torch.tensor([prompt]), NEW_TOKENS)[0].tolist()
        _assert_same_greedy(seq["tokens"], got, seq["top2_margin"], "load_quantized vs vLLM")
    assert rt.PATH_CALLS["kernel"] > before["kernel"]  # the tinygemm kernel really ran
