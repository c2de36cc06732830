"""cpu_int4 (tinygemm W4A16): layout, kernel, convert, vLLM, load_quantized and fidelity.

Run as a script, this file is also the driver the tests start in fresh processes:
``python tests/test_tinygemm.py isa`` checks the layout on the ISA path chosen by
``ATEN_CPU_CAPABILITY`` (torch reads it once, at start-up), and
``python tests/test_tinygemm.py vllm MODEL PROMPTS_JSON NEW_TOKENS`` runs real vLLM (which
spawns processes, hence the ``__main__`` guard).
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

from cpu_quant.errors import CpuQuantError
from cpu_quant.quantize import tinygemm_pack as tp

THIS = Path(__file__).resolve()
REPO = THIS.parents[1]
SMALL_CALIB = ["--samples", "16", "--seqlen", "256"]
PROMPTS = [
    "The capital of France is",
    "Emma Woodhouse, handsome, clever, and rich,",
    "def fibonacci(n):",
    "It is a truth universally acknowledged that",
]
NEW_TOKENS = 24
# The logits are bf16: at |logit| in [16, 32) one ulp is 0.125 nats, and two runtimes (or the
# kernel path, which keeps float32 weights, and the prefill path, which rounds them to bf16)
# reduce in different orders and may round a logit differently. Two candidates within two
# ulps can therefore swap (measured: a decode-path exact tie that the prefill path broke by one
# ulp, 0.125). Outside such near-ties the tokens must be identical.
NEAR_TIE_NATS = 0.25
# The same token's log-prob through the two paths: measured at most 0.14 nats on the demo
# artifact; the bound allows about two and a half ulps.
PATH_LOGPROB_NATS = 0.3
# The shapes the ISA check packs: whole 64-row blocks, partial blocks of 16/32/48 rows, and the
# demo model's matrices (576 = 9 x 64, 192 = 3 x 64, 1536, the head's 49152 is 768 x 64).
ISA_SHAPES = [(16, 64), (48, 128), (64, 64), (80, 576), (112, 256), (144, 256), (192, 576),
              (576, 1536), (1536, 576)]


def _cpu_quant(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``cpu-quant`` with the cpu_int4 commands added to the group (idempotent once wired)."""
    code = ("from cpu_quant.cli import main; "
            "from cpu_quant.commands_tinygemm import convert, tinygemm; "
            "main.add_command(tinygemm); main.add_command(convert); main()")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=3600)
    if check and proc.returncode != 0:
        raise AssertionError(f"cpu-quant {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
    return proc


# -- the layout and the kernel (unit level) ------------------------------------------------------
def _random_module(n: int, k: int, group: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3).to(torch.bfloat16)
    scale[:, ::3] *= -1  # the grid allows negative scales
    zero = (torch.randn(n, k // group, generator=gen) * 0.01).to(torch.bfloat16)
    return codes, scale, zero


def _isa_check() -> dict:
    """Layout checks on this process's ISA path; raises on the first disagreement."""
    layout = tp.kernel_layout()
    for n, k in ISA_SHAPES:
        group = 64
        codes, scale, zero = _random_module(n, k, group, seed=n * k)
        theirs = tp.torch_pack(codes)
        assert torch.equal(layout.pack(codes), theirs), f"pack differs at {n}x{k}"
        assert torch.equal(layout.codes(theirs), codes), f"unpack differs at {n}x{k}"
        portable = tp.pack_codes(codes)
        assert torch.equal(tp.unpack_codes(portable), codes)
        rows = portable.clone()
        tp.repack_to_kernel_(rows)  # whole-matrix chunks
        assert torch.equal(rows, theirs), f"in-place repack differs at {n}x{k}"
        saved, tp.CHUNK_WEIGHTS = tp.CHUNK_WEIGHTS, 64 * k  # one block per chunk
        try:
            rows = portable.clone()
            tp.repack_to_kernel_(rows)
        finally:
            tp.CHUNK_WEIGHTS = saved
        assert torch.equal(rows, theirs), f"chunked repack differs at {n}x{k}"
        storage, sview, zview = tp.scale_zero_storage(n, k, group)
        sview.copy_(scale)
        zview.copy_(zero)
        ref = tp.dequantize_cpu_int4(portable, scale, zero)
        got = tp.dequantize_kernel_rows(theirs, storage, group, 0, n)
        assert torch.equal(got, ref.to(torch.bfloat16)), f"kernel-layout dequant differs at {n}x{k}"
    return {"isa": torch.backends.cpu.get_cpu_capability(), "block_n": layout.block_n,
            "full_block": layout.full_block}


def _available_isas() -> list[str]:
    caps = torch.backends.cpu.get_cpu_capability()
    order = ["default", "avx2", "avx512"]
    top = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}.get(caps, 0)
    return order[: top + 1]


@pytest.fixture(scope="module")
def isa_results() -> dict[str, subprocess.CompletedProcess]:
    """One fresh process per ISA path this CPU offers, started together (each spends most of
    its time importing torch)."""
    procs = {isa: subprocess.Popen([sys.executable, str(THIS), "isa"], stdout=subprocess.PIPE,
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


def test_kernel_and_prefill_path_match_the_dequantized_reference():
    from cpu_quant import tinygemm_runtime as rt

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
        bound = _error_bound(x, w, ref, weight_rounding=not kernel_path)
        assert bool(((got - ref).abs() <= bound).all()), \
            f"{rows} rows: max excess {float(((got - ref).abs() - bound).max()):.3g}"
        if kernel_path:  # the op's kernel path is exactly torch's kernel
            direct = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, storage)
            assert torch.equal(got, direct.float())
    assert rt.PATH_CALLS["kernel"] - before["kernel"] == 2
    assert rt.PATH_CALLS["dequantize"] - before["dequantize"] == 1


def test_batch_size_branch_does_not_guard_a_compiled_graph():
    """Compiled with dynamic shapes, one graph serves 1 row and 100 rows; the same branch
    written outside the op recompiles (the control shows the check can fail)."""
    from torch._dynamo.testing import CompileCounter

    from cpu_quant import tinygemm_runtime as rt

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
    from cpu_quant.tinygemm_runtime import Int4PackedLinear

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
    proc = _cpu_quant("tinygemm", str(demo_src), str(dst), "--group", "-1", "--no-eval",
                      check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --group -1")
    assert not dst.exists() and not list(tmp_path.iterdir())


# -- real artifacts (session fixtures) -----------------------------------------------------------
@pytest.fixture(scope="session")
def asym_artifact(demo_src: Path, artifacts_dir: Path) -> Path:
    """The default: calibrated GPTQ on the asymmetric grid, group 128, head quantized."""
    dst = artifacts_dir / "demo-cpu_int4"
    _cpu_quant("tinygemm", str(demo_src), str(dst), "--group", "128", *SMALL_CALIB, "--no-eval")
    return dst


@pytest.fixture(scope="session")
def sym_artifact(gptq_artifact: Path, artifacts_dir: Path) -> Path:
    """The shared GPTQ artifact (same calibration), repacked: the symmetric grid as cpu_int4."""
    dst = artifacts_dir / "demo-cpu_int4-from-gptq"
    _cpu_quant("convert", str(gptq_artifact), str(dst), "--to", "cpu_int4")
    return dst


def test_config_and_tensors_describe_a_cpu_int4_checkpoint(asym_artifact: Path):
    from cpu_quant.io.checkpoint import open_checkpoint
    from cpu_quant.quantize.plan import group_for_module

    ckpt = open_checkpoint(asym_artifact)
    q = ckpt.config["quantization_config"]
    assert q["quant_method"] == "cpu_int4" and q["format_version"] == 1 and q["bits"] == 4
    assert q["group_size"] == 128 and q["sym"] is False and q["lm_head"] is True
    assert q["embedding"] == "bf16" and ckpt.config["tie_word_embeddings"] is False
    # SmolLM2's hidden size 576 is not a multiple of 128: group 64 there, HF and vLLM names
    for mod, g in [("model.layers.3.self_attn.qkv_proj", 64), ("model.layers.3.mlp.up_proj", 64),
                   ("model.layers.3.mlp.down_proj", 128), ("lm_head", 64)]:
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
    from cpu_quant.eval.dequantized import READERS
    from cpu_quant.io.checkpoint import open_checkpoint

    src, dst = open_checkpoint(gptq_artifact), open_checkpoint(sym_artifact)
    q = dst.config["quantization_config"]
    assert q["quant_method"] == "cpu_int4" and q["sym"] is True
    assert q["dynamic"] == src.config["quantization_config"]["dynamic"]
    modules = [n[: -len(".qweight")] for n in src.names if n.endswith(".qweight")]
    assert len(modules) == 30 * 7 + 1
    read_gptq, read_int4 = READERS["gptq"][2], READERS["cpu_int4"][2]
    for m in modules:
        a = read_gptq(src, m, src.config["quantization_config"])
        b = read_int4(dst, m, q)
        assert torch.equal(a, b), m
        assert not bool(dst.tensor(f"{m}.weight_zero").any())
    gptq_suffixes = ("qweight", "qzeros", "scales", "g_idx")
    rest = [n for n in src.names if n.rpartition(".")[2] not in gptq_suffixes]
    for n in rest:
        assert torch.equal(src.tensor(n), dst.tensor(n)), n


def _link_tree(src: Path, dst: Path) -> None:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copyfile(f, dst / f.name)


def test_convert_refuses_a_non_symmetric_gptq_checkpoint(gptq_artifact: Path, tmp_path: Path):
    from safetensors.torch import save_file

    from cpu_quant.quantize.gptq_cpu_export import gptq_module_tensors
    from cpu_quant.quantize.grid import GroupQuant

    # (a) the config says sym: false
    cfg_asym = tmp_path / "config_asym"
    _link_tree(gptq_artifact, cfg_asym)
    config = json.loads((cfg_asym / "config.json").read_text())
    config["quantization_config"]["sym"] = False
    (cfg_asym / "config.json").unlink()
    (cfg_asym / "config.json").write_text(json.dumps(config))
    # (b) the config says symmetric but a zero point is not 8
    zeros_asym = tmp_path / "zeros_asym"
    zeros_asym.mkdir()
    codes = torch.randint(0, 16, (64, 128), dtype=torch.uint8)
    tensors = gptq_module_tensors(GroupQuant(codes, torch.rand(64, 1), None, 128))
    tensors["qzeros"][0, 0] = 0x77777776  # one stored zero of 6: a real zero of 7
    save_file({f"model.layers.0.mlp.down_proj.{k}": v for k, v in tensors.items()},
              str(zeros_asym / "model.safetensors"))
    config["quantization_config"].update(sym=True, group_size=128, dynamic={})
    (zeros_asym / "config.json").write_text(json.dumps(config))
    for bad, words in [(cfg_asym, "is not a symmetric GPTQ checkpoint"),
                       (zeros_asym, "qzeros are not all 8")]:
        out = tmp_path / f"out-{bad.name}"
        proc = _cpu_quant("convert", str(bad), str(out), "--to", "cpu_int4", check=False)
        assert proc.returncode != 0
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and words in last, proc.stderr[-2000:]
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}")]


@pytest.mark.slow
def test_asymmetric_grid_beats_symmetric_on_heldout_kl(asym_artifact, sym_artifact, demo_src):
    """Same pipeline, calibration and groups; only the grid differs. Numbers: docs/tinygemm.md."""
    from cpu_quant.eval.fidelity import EvalSettings, evaluate_artifact

    settings = EvalSettings(windows=8, seqlen=256, prompts=4, new_tokens=8)
    kl = {name: evaluate_artifact(path, demo_src, settings)["weights"].kl_mean
          for name, path in [("asym", asym_artifact), ("sym", sym_artifact)]}
    print(f"held-out KL: asymmetric {kl['asym']:.4f}, symmetric {kl['sym']:.4f} nats")
    assert kl["asym"] < kl["sym"], kl


# -- runtimes: vLLM, load_quantized, the torch reference -----------------------------------------
def _vllm_main(model: str, prompts_file: str, new_tokens: int) -> None:
    """Greedy decode (the kernel path), then re-score prompt + continuation as one prefill (the
    dequantize path) with prompt log-probs; report the paths' call counts."""
    # the engine runs in this process, so the op's path counters can be read here
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from cpu_quant import tinygemm_runtime as rt

    prompts = json.loads(Path(prompts_file).read_text())
    # no quantization argument: the method comes from config.json through the plugin
    llm = LLM(model=model, max_model_len=512, enforce_eager=True, dtype="bfloat16", seed=0,
              enable_prefix_caching=False)
    quant = llm.llm_engine.vllm_config.model_config.quantization
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    calls0 = dict(rt.PATH_CALLS)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy)
    calls1 = dict(rt.PATH_CALLS)
    full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    rescore = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    scored = llm.generate([TokensPrompt(prompt_token_ids=f) for f in full], rescore)
    calls2 = dict(rt.PATH_CALLS)
    result = {"quantization": quant, "decode_calls": {k: calls1[k] - calls0[k] for k in calls0},
              "prefill_calls": {k: calls2[k] - calls1[k] for k in calls1}, "sequences": []}
    for p, o, s in zip(prompts, outs, scored, strict=True):
        c = o.outputs[0]
        decode = []
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            vals = sorted((v.logprob for v in lp.values()), reverse=True)
            decode.append({"logprob": lp[tok].logprob,
                           "margin": vals[0] - vals[1] if len(vals) > 1 else None})
        prefill = []
        for pos in range(len(p), len(p) + len(c.token_ids)):
            lp = s.prompt_logprobs[pos]
            tok = s.prompt_token_ids[pos]
            prefill.append({"rank": lp[tok].rank, "logprob": lp[tok].logprob,
                            "best": max(v.logprob for v in lp.values())})
        result["sequences"].append({"tokens": list(c.token_ids), "decode": decode,
                                    "prefill": prefill})
    print("RESULT " + json.dumps(result), flush=True)


@pytest.fixture(scope="session")
def prompt_ids(demo_src: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(demo_src)
    return [tok(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="session")
def vllm_run(asym_artifact: Path, prompt_ids, tmp_path_factory) -> dict:
    prompts_file = tmp_path_factory.mktemp("vllm") / "prompts.json"
    prompts_file.write_text(json.dumps(prompt_ids))
    proc = subprocess.run([sys.executable, str(THIS), "vllm", str(asym_artifact),
                           str(prompts_file), str(NEW_TOKENS)],
                          capture_output=True, text=True, timeout=1800, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    result["log"] = proc.stdout + proc.stderr
    return result


def _assert_same_greedy(expected: list[int], got: list[int], margins: list, what: str) -> None:
    first = next((i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b), None)
    if first is not None:
        margin = margins[first]
        assert margin is not None and margin < NEAR_TIE_NATS, (
            f"{what} diverged at token {first} with a top-2 margin of {margin:.3f} nats: "
            f"{got} vs {expected}")


@pytest.mark.vllm
def test_vllm_serves_the_artifact_from_its_config_alone(vllm_run: dict, asym_artifact: Path,
                                                        prompt_ids):
    from cpu_quant.eval.dequantized import load_model
    from cpu_quant.eval.fidelity import _greedy

    assert vllm_run["quantization"] == "cpu_int4"
    assert "cpu_quant patch cpu_int4: applied" in vllm_run["log"]
    assert "cpu_int4: tinygemm kernel layout" in vllm_run["log"]
    reference = load_model(asym_artifact, torch.bfloat16)
    for prompt, seq in zip(prompt_ids, vllm_run["sequences"], strict=True):
        expected = _greedy(reference, torch.tensor([prompt]), NEW_TOKENS)[0].tolist()
        margins = [d["margin"] for d in seq["decode"]]
        _assert_same_greedy(expected, seq["tokens"], margins, "vLLM vs the dequantized weights")


@pytest.mark.vllm
def test_vllm_prefill_and_decode_paths_agree(vllm_run: dict):
    """Every greedily decoded token (tinygemm kernel, a few rows per step) is also the top token
    when the whole sequence is re-scored in one prefill (dequantize + bf16 GEMM)."""
    decode_calls, prefill_calls = vllm_run["decode_calls"], vllm_run["prefill_calls"]
    assert decode_calls["kernel"] > 0  # the knobs are connected: both paths really ran
    assert prefill_calls["dequantize"] > 0
    worst = 0.0
    for seq in vllm_run["sequences"]:
        for i, (d, p) in enumerate(zip(seq["decode"], seq["prefill"], strict=True)):
            if p["rank"] != 1:  # a swap is allowed only where one of the paths saw a near-tie
                gap = p["best"] - p["logprob"]
                assert min(gap, d["margin"]) < NEAR_TIE_NATS, (
                    f"token {i}: prefill ranks it {p['rank']} ({gap:.3f} nats below the top), "
                    f"decode chose it by {d['margin']:.3f}")
            worst = max(worst, abs(d["logprob"] - p["logprob"]))
    assert worst < PATH_LOGPROB_NATS, worst


@pytest.mark.vllm
def test_load_quantized_generates_what_vllm_generates(vllm_run: dict, asym_artifact: Path,
                                                      prompt_ids):
    from cpu_quant.eval.fidelity import _greedy
    from cpu_quant.tinygemm_runtime import Int4PackedLinear, load_quantized

    model = load_quantized(asym_artifact)
    assert isinstance(model.lm_head, Int4PackedLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4PackedLinear)
    for prompt, seq in zip(prompt_ids, vllm_run["sequences"], strict=True):
        got = _greedy(model, torch.tensor([prompt]), NEW_TOKENS)[0].tolist()
        margins = [d["margin"] for d in seq["decode"]]
        _assert_same_greedy(seq["tokens"], got, margins, "load_quantized vs vLLM")


if __name__ == "__main__":
    if sys.argv[1] == "isa":
        print("RESULT " + json.dumps(_isa_check()), flush=True)
    elif sys.argv[1] == "vllm":
        _vllm_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")
