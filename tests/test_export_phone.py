"""`cpu-quant export-phone`: static-KV graph, XNNPACK and QNN (w8a16) programs, verification.

Everything runs through the real ExecuTorch runtime (executorch 1.5.1). The pipeline tests use a
tiny random Llama (2 layers, hidden 64, the demo tokenizer) whose tied embedding is scaled to
unit variance, so next-token distributions are peaked and greedy decoding is not decided by
near-ties; sequence lengths are tiny (max-seq-len 48). The real demo model runs in one
``slow``-marked test, only with ``CPU_QUANT_PHONE_DEMO=1`` (its export alone is several
CPU-minutes). Bad input goes through the real CLI (``python -m cpu_quant.cli export-phone``);
the other command tests invoke the same click command in-process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("executorch")
pytest.importorskip("torchao")

from cpu_quant.errors import CpuQuantError  # noqa: E402
from cpu_quant.export import xnnpack  # noqa: E402
from cpu_quant.export.commands import export_phone  # noqa: E402
from cpu_quant.export.model import export_methods, load_static_lm  # noqa: E402
from cpu_quant.export.pipeline import PhoneExportSettings  # noqa: E402
from cpu_quant.export.pipeline import export_phone as run_export  # noqa: E402
from cpu_quant.export.runner import StaticKVRunner  # noqa: E402
from cpu_quant.export.verify import MIN_SNR_DB, pte_step_functions, snr_db  # noqa: E402

from .conftest import make_tiny_model, run_cli  # noqa: E402

SMALL = dict(max_seq_len=48, prefill_len=16, calib_len=48, calib_decode_tokens=4,
             verify_windows=2, verify_len=48, gen_tokens=8)
SMALL_CLI = ["--max-seq-len", "48", "--prefill-len", "16", "--quiet"]


def small_settings(**kw) -> PhoneExportSettings:
    return PhoneExportSettings(**{**SMALL, **kw})


@pytest.fixture(scope="session")
def peaked_llama(demo_src: Path, tmp_path_factory) -> Path:
    """Tiny random Llama with a unit-variance tied embedding (logit std ~8: peaked)."""
    from safetensors.torch import load_file, save_file

    dst = make_tiny_model("llama", tmp_path_factory.mktemp("phone") / "llama", demo_src)
    path = dst / "model.safetensors"
    tensors = load_file(str(path))
    emb = tensors["model.embed_tokens.weight"].float()
    tensors["model.embed_tokens.weight"] = (emb / emb.std()).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def xnnpack_8da8w(peaked_llama: Path, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("x") / "xnn-8da8w"
    report = run_export(peaked_llama, out, small_settings(backend="xnnpack", scheme="8da8w"),
                        progress=False)
    return out, report


@pytest.fixture(scope="session")
def qnn_w8a16(peaked_llama: Path, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("q") / "qnn-w8a16"
    report = run_export(peaked_llama, out, small_settings(backend="qnn", calib_samples=4),
                        progress=False)
    return out, report


# -- the static graph against transformers ---------------------------------------------------

@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_static_graph_matches_transformers(arch: str, demo_src: Path, tmp_path: Path) -> None:
    """Prefill in chunks and single-token decode reproduce HF's logits (float32)."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(arch, tmp_path / arch, demo_src, vocab=512)
    model = load_static_lm(src, 32)
    s = model.spec
    from cpu_quant.export.runner import GraphShape

    shape = GraphShape(s.n_layers, s.n_kv_heads, s.head_dim, s.vocab_size, 32, 8)
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        runner = StaticKVRunner(shape, model, model)
        prefill = runner.score(ids)  # chunks of 8, the last one padded
        runner.reset()
        runner.prefill(ids[:5])
        decode = torch.stack([runner.decode(t) for t in ids[5:]])
    assert snr_db(prefill, ref) > 80, "prefill differs from transformers"
    assert snr_db(decode, ref[5:]) > 80, "decode differs from transformers"


# -- XNNPACK --------------------------------------------------------------------------------

def test_xnnpack_8da8w_generates_like_its_eager_graph(xnnpack_8da8w) -> None:
    out, report = xnnpack_8da8w
    v = report["verification"]
    assert v["passed"]
    assert v["pte_vs_quantized"]["snr_db"] >= MIN_SNR_DB
    for g in v["greedy"]:
        assert len(g["pte_tokens"]) == SMALL["gen_tokens"]
        assert g["pte_tokens"] == g["quantized_tokens"], g["prompt"]
    ops = report["ops"]["decode"]
    assert ops["delegated"].get("XnnpackBackend"), "nothing was delegated to XNNPACK"
    assert report["sizes"]["ratio_vs_float32"] < 0.4  # int8 weights, int8 embedding
    on_disk = json.loads((out / "export_report.json").read_text())
    assert on_disk["scheme"] == "8da8w" and on_disk["provenance"]["executorch"].startswith("1.5")


def test_export_report_on_disk(xnnpack_8da8w, qnn_w8a16) -> None:
    """export_report.json: sizes, scheme, delegated vs portable op counts, calibration,
    metrics and provenance, and every file of OUT accounted for with its real hash."""
    from cpu_quant.export.report import sha256_file

    for out, _ in (xnnpack_8da8w, qnn_w8a16):
        report = json.loads((out / "export_report.json").read_text())
        files = {p.name for p in out.iterdir()} - {"export_report.json"}
        assert set(report["produced"]) == files and "tokenizer.json" in files
        for name, info in report["produced"].items():
            assert info["bytes"] == (out / name).stat().st_size
            assert info["sha256"] == sha256_file(out / name)
        assert report["sizes"]["pte_bytes"] == (out / "model.pte").stat().st_size
        assert 0 < report["sizes"]["ratio_vs_float32"] < 1
        for method in ("prefill", "decode"):
            ops = report["ops"][method]
            assert ops["portable_total"] == sum(ops["portable"].values())
            assert ops["delegated_total"] == sum(sum(c.values()) for c in ops["delegated"].values())
        v = report["verification"]
        for key in ("pte_vs_quantized", "pte_vs_float", "quantized_vs_float"):
            assert set(v[key]) == {"snr_db", "top1_agreement", "mean_kl"}
        assert v["passed"] and v["tolerance"]["min_snr_db"] > 0
        assert {"pte", "quantized", "float"} == set(v["perplexity"])
        prov = report["provenance"]
        assert prov["torchao"] == "0.18.0" and prov["torch"].startswith("2.13")
        assert len(prov["source_sha256"]["model.safetensors"]) == 64
    xnn = json.loads((xnnpack_8da8w[0] / "export_report.json").read_text())
    assert xnn["calibration"]["samples"] == 0 and xnn["ops"]["decode"]["delegate_calls"] >= 1
    assert "qnn_lowering" not in xnn


def test_pte_generates_text_through_the_runtime(xnnpack_8da8w, peaked_llama: Path) -> None:
    """Independently of the pipeline: load model.pte, prefill a prompt, decode greedily."""
    from transformers import AutoTokenizer

    out, report = xnnpack_8da8w
    shape = PhoneExportSettings(**{**SMALL}).shape(load_static_lm(peaked_llama, 48))
    runner = StaticKVRunner(shape, *pte_step_functions(out / "model.pte"))
    tok = AutoTokenizer.from_pretrained(out)
    g = report["verification"]["greedy"][0]
    tokens, logits = runner.generate(tok(g["prompt"], add_special_tokens=False)["input_ids"],
                                     SMALL["gen_tokens"])
    assert tokens == g["pte_tokens"]
    assert len(logits) == len(tokens) and runner.pos > len(tokens)
    assert isinstance(tok.decode(tokens), str)


# -- QNN w8a16 ------------------------------------------------------------------------------

def test_qnn_w8a16_writes_calibrated_program_and_portable_pte(qnn_w8a16) -> None:
    import torchao.quantization.pt2e.quantize_pt2e  # noqa: F401  registers the q/dq ops

    out, report = qnn_w8a16
    assert report["qnn_lowering"] == "not-done" and "QNN SDK" in report["qnn_next_step"]
    assert report["calibration"]["samples"] == 4
    assert {"model.pte", "qnn_prefill.pt2", "qnn_decode.pt2"} <= set(report["produced"])
    ops = report["ops"]["prefill"]
    assert ops["delegate_calls"] == 0 and ops["portable_total"] > 0
    assert any("quantize_per_tensor" in k for k in ops["portable"])
    program = torch.export.load(str(out / "qnn_decode.pt2"))
    q_nodes = [n for n in program.graph.nodes
               if "quantize_per_tensor" in str(n.target) and "dequantize" not in str(n.target)]
    # uint16 affine activations; the second operand of each bmm is int16 symmetric (+-32767)
    assert q_nodes and all(n.args[4] - n.args[3] >= 65534 for n in q_nodes), "not 16-bit"
    stored = [*program.state_dict.values(), *program.constants.values()]
    int8 = [t for t in stored if isinstance(t, torch.Tensor) and t.dtype == torch.int8]
    assert len(int8) >= 2 * 7 + 1, "weights are not int8"
    v = report["verification"]
    assert v["passed"] and v["pte_vs_quantized"]["snr_db"] >= MIN_SNR_DB
    assert v["decode_snr_db_vs_quantized"] >= MIN_SNR_DB


def test_saved_qnn_program_retraces_for_the_qnn_lowering(qnn_w8a16) -> None:
    """What can be checked of the SDK path without the SDK: the saved program reloads and
    re-exports with strict=True, as to_edge_transform_and_lower_to_qnn traces it."""
    from cpu_quant.export import qnn
    from cpu_quant.export.runner import GraphShape

    out, report = qnn_w8a16
    program = qnn.load_saved_programs(out)["decode"]
    shape = GraphShape(**report["graph"])
    retraced = torch.export.export(program.module(), shape.example_inputs(1), strict=True)
    count = sum("quantize_per_tensor" in str(n.target) for n in retraced.graph.nodes)
    assert count == sum("quantize_per_tensor" in str(n.target) for n in program.graph.nodes) > 0


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_calibration_improves_w8a16_against_float(peaked_llama: Path) -> None:
    """Library level (no lowering): observers fed real text beat observers fed the trace input."""
    from transformers import AutoTokenizer

    from cpu_quant.export import qnn
    from cpu_quant.export.pipeline import calibration_windows, eager_graphs, heldout_windows

    settings = small_settings(calib_samples=4)
    tok = AutoTokenizer.from_pretrained(peaked_llama)
    model = load_static_lm(peaked_llama, settings.max_seq_len)
    shape = settings.shape(model)
    heldout = heldout_windows(tok, settings)
    with torch.no_grad():
        ref = torch.cat([StaticKVRunner(shape, model, model).score(w) for w in heldout])

    def snr_vs_float(windows: list[list[int]]) -> float:
        prepared = qnn.prepare(model, shape)
        qnn.calibrate(prepared, shape, windows, settings.calib_decode_tokens)
        eager = eager_graphs(export_methods(qnn.convert(prepared), shape))
        runner = StaticKVRunner(shape, eager["prefill"], eager["decode"])
        with torch.no_grad():
            return snr_db(torch.cat([runner.score(w) for w in heldout]), ref)

    calibrated = snr_vs_float(calibration_windows(tok, settings))
    uncalibrated = snr_vs_float([])
    assert calibrated > uncalibrated + 3, (calibrated, uncalibrated)


# -- verification catches broken programs -----------------------------------------------------

def test_weight_only_probe_really_runs_and_detects_the_bug() -> None:
    probe = xnnpack.probe_weight_only_int8()
    assert probe.snr_db == probe.snr_db  # a number, not NaN
    if not probe.correct:  # executorch 1.5.1
        assert probe.snr_db < 10
        with pytest.raises(CpuQuantError, match="per-channel scale"):
            xnnpack.check_scheme("8w")


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_verification_fails_the_command_on_a_broken_program(peaked_llama: Path, tmp_path: Path,
                                                            monkeypatch) -> None:
    """Pretend the probe passed: the full weight-only export must then fail verification,
    exit non-zero and leave nothing behind."""
    if xnnpack.probe_weight_only_int8().correct:
        pytest.skip("executorch's XNNPACK int8 weight-only path has become correct")
    monkeypatch.setattr(xnnpack, "probe_weight_only_int8",
                        lambda: xnnpack.ProbeResult(99.0, True))
    out = tmp_path / "broken"
    result = CliRunner().invoke(export_phone, [str(peaked_llama), str(out), "--backend", "xnnpack",
                                               "--scheme", "8w", *SMALL_CLI])
    assert result.exit_code == 3, result.output
    assert result.stderr.startswith("error: model.pte disagrees with its own quantized eager graph")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "staging or lock files were left behind"


def test_cli_refuses_weight_only_xnnpack(peaked_llama: Path, tmp_path: Path) -> None:
    if xnnpack.probe_weight_only_int8().correct:
        pytest.skip("executorch's XNNPACK int8 weight-only path has become correct")
    result = CliRunner().invoke(export_phone, [str(peaked_llama), str(tmp_path / "o"),
                                               "--backend", "xnnpack", "--scheme", "8w",
                                               *SMALL_CLI])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --scheme 8w") and "per-channel scale" in result.stderr
    assert "Traceback" not in result.output and not (tmp_path / "o").exists()


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_corrupted_scale_fails_the_command_and_leaves_nothing(peaked_llama: Path, tmp_path: Path,
                                                             monkeypatch) -> None:
    """Corrupt one weight scale in the program that gets lowered (the head's scale for " the",
    x16), keeping the quantized eager graph it is verified against intact: the CLI must exit 3
    and leave neither OUT nor its staging directory or lock behind."""
    from transformers import AutoTokenizer

    token = AutoTokenizer.from_pretrained(peaked_llama)(" the", add_special_tokens=False)
    token = token["input_ids"][0]
    real_lower = xnnpack.lower_to_xnnpack
    corrupted: list[int] = []

    def lower_with_a_corrupted_scale(programs: dict):
        for program in programs.values():
            scale = program.state_dict["lm_head.weight"].scale  # per output channel
            if scale.data_ptr() not in corrupted:  # the methods may share the tensor
                scale[token] *= 16
                corrupted.append(scale.data_ptr())
        return real_lower(programs)

    monkeypatch.setattr(xnnpack, "lower_to_xnnpack", lower_with_a_corrupted_scale)
    out = tmp_path / "corrupt"
    result = CliRunner().invoke(export_phone, [str(peaked_llama), str(out), "--backend", "xnnpack",
                                               "--scheme", "8da8w", *SMALL_CLI])
    assert corrupted, "the corruption was not applied"
    assert result.exit_code == 3, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: model.pte disagrees"), lines
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "staging or lock files were left behind"


# -- bad input: the real CLI (``python -m cpu_quant.cli``), one line, non-zero exit ------------

def _one_line_error(*args: str) -> str:
    proc = run_cli("export-phone", *args, check=False, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


def test_unsupported_architecture(demo_src: Path, tmp_path: Path) -> None:
    src = make_tiny_model("gemma2", tmp_path / "gemma2", demo_src, vocab=512)
    line = _one_line_error(str(src), str(tmp_path / "o"))
    assert "Gemma2ForCausalLM" in line and "LlamaForCausalLM" in line
    assert not (tmp_path / "o").exists()


def test_max_seq_len_beyond_context(peaked_llama: Path, tmp_path: Path) -> None:
    line = _one_line_error(str(peaked_llama), str(tmp_path / "o"), "--max-seq-len", "4096")
    assert "beyond the model's context of 1024" in line
    assert not (tmp_path / "o").exists()


def test_missing_calibration_file(peaked_llama: Path, tmp_path: Path) -> None:
    line = _one_line_error(str(peaked_llama), str(tmp_path / "o"), "--calib",
                           str(tmp_path / "nope.txt"), *SMALL_CLI)
    assert "does not exist" in line and "nope.txt" in line
    assert list(tmp_path.iterdir()) == []


def _cli_error(args: list[str]) -> str:
    """The click command in-process (same friendly_errors wrapper, no interpreter start-up)."""
    result = CliRunner().invoke(export_phone, args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_calibrating_on_the_heldout_text_is_refused(peaked_llama: Path, tmp_path: Path) -> None:
    from cpu_quant.data.corpus import builtin_split

    calib = tmp_path / "leak.txt"
    calib.write_text(builtin_split("heldout")[0][:20000])
    line = _cli_error([str(peaked_llama), str(tmp_path / "o"), "--calib", str(calib),
                       "--calib-samples", "64", *SMALL_CLI])
    assert "overlaps the held-out text" in line


def test_calib_with_xnnpack_is_refused(peaked_llama: Path, tmp_path: Path) -> None:
    calib = tmp_path / "c.txt"
    calib.write_text("Some text. " * 200)
    line = _cli_error([str(peaked_llama), str(tmp_path / "o"), "--backend", "xnnpack",
                       "--calib", str(calib), *SMALL_CLI])
    assert "--backend qnn only" in line


def test_existing_output_is_refused_before_any_work(xnnpack_8da8w, peaked_llama: Path) -> None:
    out, _ = xnnpack_8da8w
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    line = _cli_error([str(peaked_llama), str(out), "--backend", "xnnpack", *SMALL_CLI])
    assert "already exists" in line and "--overwrite" in line
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


# -- the real demo model ----------------------------------------------------------------------

DEMO_ENV = "CPU_QUANT_PHONE_DEMO"


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(DEMO_ENV),
                    reason=f"set {DEMO_ENV}=1: one real XNNPACK export of the demo model takes "
                           "~10 CPU-minutes (lowering 30 layers x 2 methods), beyond this "
                           "file's time budget")
def test_demo_model_xnnpack_8da8w(demo_src: Path, tmp_path: Path) -> None:
    """The real SmolLM2-135M: 8da8w export, verified, and greedy generation through the runtime
    equal to the quantized eager graph's for 8 tokens (at 16, one of the three prompts was
    measured to diverge at token 11; docs/phone.md, Verification)."""
    from transformers import AutoTokenizer

    out = tmp_path / "demo-8da8w"
    report = run_export(demo_src, out, small_settings(backend="xnnpack", scheme="8da8w",
                                                      max_seq_len=64, verify_len=64),
                        progress=False)
    v = report["verification"]
    assert v["passed"]
    assert all(g["pte_tokens"] == g["quantized_tokens"] for g in v["greedy"])
    assert v["pte_vs_float"]["top1_agreement"] > 0.8
    assert report["ops"]["decode"]["delegated"].get("XnnpackBackend")
    assert report["sizes"]["ratio_vs_float32"] < 0.3
    # independently of the pipeline: the written program, through the runtime
    from cpu_quant.export.runner import GraphShape

    tok = AutoTokenizer.from_pretrained(out)
    runner = StaticKVRunner(GraphShape(**report["graph"]), *pte_step_functions(out / "model.pte"))
    tokens, _ = runner.generate(tok("The capital of France is", add_special_tokens=False)
                                ["input_ids"], 4)
    assert "Paris" in tok.decode(tokens)
