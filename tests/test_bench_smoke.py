"""Smoke runs of the ``quantize``, ``fidelity``, ``memory``, ``runtime``, ``phone``, ``eval``,
``fidelity_archs``, ``scale``, ``bit_identity``, ``memory_trace`` and ``tinygemm`` (its kernel
part) benchmark suites, so the harness cannot rot.

One pass each, tiny settings (a 2-layer random Llama with the demo tokenizer, 4 × 64
calibration tokens, 2 × 64 evaluation tokens), through the real entry point
``python -m benchmarks run SUITE --smoke``. To stay within the time budget each run takes a
subset of its arms (quantize: cpu-quant GPTQ and GPTQModel; fidelity: data-free RTN, GPTQ and
GPTQModel, the last two evaluated from the quantize run's artifacts through ``--artifact``, and
GPTQModel with its head quantized, built from the untied copy);
the full arm lists run with ``python -m benchmarks run SUITE --smoke``. GPTQModel
may only be skipped when its venv is absent, and then the skip must be written in the result
file.

``runtime`` serves a 2-layer random Llama through real vLLM (bf16, and gptq through the kernel
the plugin's table names; the head's alternative layouts (``gptq_head128``, ``gptq_head_bf16``)
are left out as speed-only arms, and ``gptq_stock`` and ``cpu_int4`` with a written reason:
their engine paths are tested elsewhere);
``phone`` exports a one-layer random Llama with ExecuTorch and runs the programs through the
real ExecuTorch runtime, for ``fp32`` and ``8da4w`` (each XNNPACK export costs about a minute
here; ``8da8w`` goes through the same code as ``8da4w``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import provenance
from benchmarks.peers import gptqmodel_env

# real benchmark runs in smoke mode: the end-to-end tier
pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]


def _run_smoke(suite: str, tmp: Path, *extra: str, result: str | None = None) -> dict:
    """``result``: the result file's name where it is not the suite's (a suite of parts)."""
    out = tmp / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", suite, "--smoke", "--out", str(out),
         "--workdir", str(tmp / "work"), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    files = sorted(out.glob(f"{result or suite}-smoke-*.json"))
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert len(files) == 1, proc.stderr[-2000:]
    return json.loads(files[0].read_text())


def _check_common(result: dict, expected_arms: set[str]) -> None:
    assert result["smoke"] is True and result["passes"] == 1
    provenance.validate(result["provenance"])
    assert result["failed_passes"] == 0
    ran = {r["arm"] for r in result["records"] if r["ok"]}
    skipped = {s["arm"]: s["reason"] for s in result["skipped_arms"]}
    peer_arms = {a for a in expected_arms if a.startswith("gptqmodel")}
    if gptqmodel_env.ready_env() is None:
        assert peer_arms <= set(skipped), "GPTQModel was left out without saying so"
        assert all("venv" in skipped[a] for a in peer_arms)
        assert ran == expected_arms - peer_arms
    else:
        assert not skipped, "GPTQModel is installed: nothing may be skipped"
        assert ran == expected_arms
    # every ran arm's artifact is hashed into the provenance
    hashed = {label.split("/")[0] for label in result["provenance"]["artifacts"]}
    assert ran <= hashed


@pytest.fixture(scope="module")
def quantize_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bench-quantize")


@pytest.fixture(scope="module")
def quantize_result(quantize_dir) -> dict:
    return _run_smoke("quantize", quantize_dir, "--arms", "cpu-quant-gptq,gptqmodel")


@pytest.fixture(scope="module")
def fidelity_result(tmp_path_factory, quantize_dir, quantize_result) -> dict:
    # the quantize run's artifacts are the fidelity arms gptq and gptqmodel: evaluate them
    # (after the arm checks them) instead of building them again
    prebuilt = []
    for quantize_arm, fidelity_arm in (("cpu-quant-gptq", "gptq"), ("gptqmodel", "gptqmodel")):
        artifact = quantize_dir / "work" / "pass-0" / quantize_arm / "artifact"
        if artifact.is_dir():
            prebuilt += ["--artifact", f"{fidelity_arm}={artifact}"]
    return _run_smoke("fidelity", tmp_path_factory.mktemp("bench-fidelity"),
                      "--arms", "rtn,gptq,gptqmodel,gptqmodel+head", *prebuilt)


def test_quantize_suite_smoke(quantize_result):
    _check_common(quantize_result, {"cpu-quant-gptq", "gptqmodel"})
    for rec in quantize_result["records"]:
        if rec["ok"]:
            assert rec["metrics"]["wall_seconds"] > 0
            assert rec["metrics"]["peak_rss_anon_bytes"] > 50 * 2**20  # torch alone is more
            assert 4.0 < rec["extras"]["bits_per_weight"] < 4.5
    assert "insufficient passes" in json.dumps(quantize_result["comparisons"]) or \
        not quantize_result["comparisons"]


def test_fidelity_suite_smoke(fidelity_result):
    _check_common(fidelity_result, {"rtn", "gptq", "gptqmodel", "gptqmodel+head"})
    assert fidelity_result["arms"]["gptq"]["prebuilt"]  # taken from the quantize run
    peer = gptqmodel_env.ready_env() is not None
    assert set(fidelity_result["builds"]) == ({"rtn", "gptqmodel+head"} if peer else {"rtn"})
    if peer:  # the head arm quantized the untied copy, hashed with the inputs
        assert fidelity_result["arms"]["gptqmodel+head"]["quantized_model"].endswith(
            "inputs/untied_source")
        assert "untied_source" in fidelity_result["provenance"]["artifacts"]
    for rec in fidelity_result["records"]:
        if not rec["ok"]:
            continue
        m = rec["metrics"]
        assert m["kl_mean"] >= 0 and 0 <= m["top1_agreement"] <= 1
        assert 0 <= m["greedy_prefix_fraction"] <= 1
        # W4A8 (int8 activations, emulated): the same evaluation, more error
        assert m["kl_mean_w4a8"] >= 0 and 0 <= m["top1_agreement_w4a8"] <= 1
        assert m["kl_mean_w4a8"] != m["kl_mean"]
        snr = rec["extras"]["per_layer_weight_snr_db"]
        # the head arm's head is scored against the tied source's embedding
        head = {"lm_head"} if rec["arm"] == "gptqmodel+head" else set()
        assert set(snr) == {"0", "1"} | head and all(v > 5 for v in snr.values())
    # an arm whose command does not exist yet is named in the notes, not silently dropped
    from benchmarks.suites.fidelity import cli_commands

    if "tinygemm" not in cli_commands():
        assert any(n.startswith("tinygemm-asym: not measured") for n in fidelity_result["notes"])


def test_memory_suite_smoke(tmp_path_factory):
    result = _run_smoke("memory", tmp_path_factory.mktemp("bench-memory"),
                        "--arms", "depth-1x,depth-4x,calib-8-offload,depth-1x-mmap-4m")
    _check_common(result, {"depth-1x", "depth-4x", "calib-8-offload", "depth-1x-mmap-4m"})
    layers = {r["arm"]: r["extras"]["layers"] for r in result["records"]}
    assert layers == {"depth-1x": 2, "depth-4x": 8, "calib-8-offload": 2, "depth-1x-mmap-4m": 2}
    assert result["arms"]["calib-8-offload"]["flags"] == ["--offload-activations"]
    # the allocator arm's environment reached the quantizer (its collect() checks the report)
    assert result["arms"]["depth-1x-mmap-4m"]["env"] == {"MALLOC_MMAP_THRESHOLD_": str(4 << 20)}
    for rec in result["records"]:
        assert rec["metrics"]["peak_rss_anon_bytes"] > 50 * 2**20


def _check_metrics(result: dict, names: set[str]) -> None:
    for rec in result["records"]:
        assert rec["ok"], rec["error"]
        assert names <= set(rec["metrics"])
        for name in names:
            value = rec["metrics"][name]
            assert isinstance(value, float) and value > 0, (rec["arm"], name, value)


def test_runtime_suite_smoke(tmp_path_factory):
    from cpu_quant.core.cpu import read_machine
    from cpu_quant.formats.gptq.serving import vllm_gptq_unavailable

    result = _run_smoke("runtime", tmp_path_factory.mktemp("bench-runtime"))
    assert result["suite"] == "runtime" and result["baseline"] == "bf16"
    assert result["smoke"] is True and result["passes"] == 1
    provenance.validate(result["provenance"])
    assert result["failed_passes"] == 0
    ran = {r["arm"] for r in result["records"] if r["ok"]}
    skipped = {s["arm"]: s["reason"] for s in result["skipped_arms"]}
    # stock vLLM's GPTQ arm is left out of the smoke run, and says why
    assert "test_gptq_end_to_end" in skipped.pop("gptq_stock")
    # the head's alternative layouts weigh decode speed only: a real run's arms
    assert all("same kernels" in skipped.pop(a) for a in ("gptq_head128", "gptq_head_bf16"))
    assert "same kernel" in skipped.pop("gptq_w4a16")
    assert "test_tinygemm" in skipped.pop("cpu_int4")
    assert vllm_gptq_unavailable(read_machine()) is None  # this machine class serves GPTQ
    assert not skipped and ran == {"bf16", "gptq"}
    _check_metrics(result, {"decode_tok_s", "prefill_tok_s", "rss_anon_bytes", "start_seconds"})
    for rec in result["records"]:  # RssAnon attributed: the worker's weights and KV counted
        memory = rec["extras"]["memory"]
        assert memory["metrics"]["weights_bytes"] > 0 and memory["metrics"]["kv_cache_bytes"] > 0
        assert {p["role"] for p in memory["processes"]} >= {"front_end", "worker"}
    for rec in result["records"]:
        assert rec["metrics"]["rss_anon_bytes"] > 200 * 2**20  # an engine's process tree
    # every served checkpoint is hashed into the provenance
    hashed = result["provenance"]["artifacts"]
    assert ran <= set(hashed) and all(hashed[a]["sha256"] for a in ran)


def test_phone_suite_smoke(tmp_path_factory):
    result = _run_smoke("phone", tmp_path_factory.mktemp("bench-phone"), "--arms", "fp32,8da4w")
    assert result["suite"] == "phone" and result["baseline"] == "fp32"
    _check_common(result, {"fp32", "8da4w"})
    assert not result["skipped_arms"]
    packages = result["provenance"]["packages"]
    assert packages["executorch"] and packages["torchao"]
    _check_metrics(result, {"decode_tok_s", "prefill_tok_s", "pte_bytes"})
    # the export is each arm's one-off build, measured by the harness
    assert set(result["builds"]) == {"fp32", "8da4w"}
    for build in result["builds"].values():
        assert build["exit_status"] == 0 and build["wall_seconds"] > 0
        assert build["rss"]["peak_rss_anon_bytes"] > 50 * 2**20
    size = {r["arm"]: r["metrics"]["pte_bytes"] for r in result["records"]}
    assert size["8da4w"] < 0.5 * size["fp32"]
    for rec in result["records"]:
        ex = rec["extras"]
        assert ex["export_timings_s"]["total"] > 0
        assert ex["verification"]["pte_vs_quantized"]["top1_agreement"] >= 0.9
        digest = result["provenance"]["artifacts"][f"{rec['arm']}/pass-0/model.pte"]
        assert digest["bytes"] == rec["metrics"]["pte_bytes"]


def test_eval_suite_smoke(tmp_path_factory):
    result = _run_smoke("eval", tmp_path_factory.mktemp("bench-eval"))
    assert result["suite"] == "eval" and result["baseline"] == "eval-default"
    provenance.validate(result["provenance"])
    assert result["failed_passes"] == 0 and result["builds"]["eval-default"]["exit_status"] == 0
    (record,) = result["records"]
    assert record["ok"] and record["metrics"]["wall_seconds"] > 0
    assert record["metrics"]["cpu_seconds"] > 0


def test_fidelity_archs_suite_smoke(tmp_path_factory):
    from benchmarks.suites.fidelity_archs import SMOKE_ARCHS, SMOKE_ROWS, arm_name

    result = _run_smoke("fidelity_archs", tmp_path_factory.mktemp("bench-fidelity-archs"))
    arms = {arm_name(arch, row) for arch in SMOKE_ARCHS for row in SMOKE_ROWS}
    _check_common(result, arms)
    assert set(result["builds"]) == arms
    # each architecture is compared with its own default, never with another architecture
    assert result["baseline_of"] == {a: a.split(":")[0] + ":gptq+head" for a in arms}
    assert set(result["comparisons"]) == {arm_name(arch, "gptq+head-nosmooth")
                                          for arch in SMOKE_ARCHS}
    rec = {r["arm"]: r for r in result["records"]}
    for r in rec.values():
        m = r["metrics"]
        assert m["kl_mean"] > 0 and m["kl_mean_w4a8"] > 0 and 0 <= m["top1_agreement"] <= 1
        assert r["extras"]["kl_stderr"] > 0
    digest = {a: r["artifacts"]["artifact"]["sha256"] for a, r in rec.items()}
    # llama folds smoothing by default: --no-smooth reaches the pipeline and changes the weights
    assert rec["llama:gptq+head"]["extras"]["smooth"] is True
    assert rec["llama:gptq+head-nosmooth"]["extras"]["smooth"] is False
    assert digest["llama:gptq+head"] != digest["llama:gptq+head-nosmooth"]
    # gemma2 cannot fold it: both arms build the same artifact, and the report and notes say why
    for row in SMOKE_ROWS:
        ex = rec[arm_name("gemma2", row)]["extras"]
        assert ex["smooth"] is False
        assert any(n.startswith("activation smoothing not folded") for n in ex["plan_notes"]) \
            == (row == "gptq+head")
    assert digest["gemma2:gptq+head"] == digest["gemma2:gptq+head-nosmooth"]
    assert any(n.startswith("gemma2: smoothing does not apply") for n in result["notes"])


def test_scale_suite_smoke(tmp_path_factory):
    """The scale suite's quantize part on the tiny model: the floor arm measures every phase's
    floor and the memory bound, the quantization arm's report carries every phase's exclusive
    time, and the rendered table reads the result."""
    from benchmarks.suites.scale import PHASES, current_bound, render

    tmp = tmp_path_factory.mktemp("scale")
    result = _run_smoke("scale", tmp, "--arms", "Llama-3.2-1B:quantize", result="scale-quantize")
    assert result["suite"] == "scale-quantize"
    _check_common(result, {"floor-Llama-3.2-1B", "gptq-Llama-3.2-1B"})
    floor, run = (next(r for r in result["records"] if r["arm"] == a)
                  for a in ("floor-Llama-3.2-1B", "gptq-Llama-3.2-1B"))
    for phase in PHASES:
        assert floor["extras"]["phases"][phase]["flops"] > 0, phase  # a tiny model: seconds round to 0
        assert phase in run["extras"]["phase_seconds"], phase
    memory = floor["extras"]["memory"]
    assert memory["bound_bytes"] == sum(memory["terms"][t] for t in ("runtime_floor", "activations")) \
        + max(memory["terms"]["layer"], memory["terms"]["head"])
    assert current_bound("Llama-3.2-1B", floor) == memory["bound_bytes"]  # what the table shows
    assert set(run["extras"]["phase_seconds"]) >= {"calibration", "write", "final_write"}
    table = render(tmp / "results", tmp, smoke=True)
    assert "Llama-3.2-1B" in table and "×" in table


def test_bit_identity_suite_smoke(tmp_path_factory):
    """The byte-identity suite builds the arm from the reference revision (HEAD) and runs it
    from this checkout: the tensors of the two runs are compared one by one, and the same
    code gives the same bytes (a difference fails here: its metric is the count)."""
    import subprocess as sp

    result = _run_smoke("bit_identity", tmp_path_factory.mktemp("bench-bit-identity"),
                        "--arms", "gptq")
    head = sp.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert result["provenance"]["settings"]["reference_sha"] == head.strip()
    assert result["builds"]["gptq"]["exit_status"] == 0 and result["failed_passes"] == 0
    (rec,) = result["records"]
    assert rec["metrics"]["differing"] == 0
    ex = rec["extras"]
    assert ex["digests"] == ex["reference_digests"] > 0 and ex["digest"] == ex["reference_digest"]
    assert ex["command"][0] == "gptq" and "--no-eval" in ex["command"]


def test_memory_trace_suite_smoke(tmp_path_factory):
    """The diagnostic trace runs as a suite: the worker's traced peak (sampled every 20 ms, the
    harness's every 100 ms) and the innermost frames at it are in the record."""
    result = _run_smoke("memory_trace", tmp_path_factory.mktemp("bench-memory-trace"))
    (rec,) = result["records"]
    assert rec["ok"] and rec["arm"] == "depth-1x"
    assert rec["metrics"]["traced_peak_bytes"] > 0 and rec["metrics"]["peak_rss_anon_bytes"] > 0
    assert rec["extras"]["main_thread_at_peak"] and rec["extras"]["layers"] == 30


def test_tinygemm_kernel_part_smoke(tmp_path_factory):
    """The tinygemm suite's kernel part on the tiny model: one step's linears timed per path,
    the op's times as the metrics."""
    result = _run_smoke("tinygemm", tmp_path_factory.mktemp("bench-tinygemm"), "--arms",
                        "kernel", result="tinygemm-kernel")
    (rec,) = result["records"]
    assert rec["ok"] and rec["arm"] == "kernel-smoke"
    steps = rec["extras"]["linears_ms_per_step"]
    assert rec["metrics"]["decode_linears_ms"] == steps["int4_m1"] > 0
    assert steps["kernel_m1"] > 0 and steps["bf16_m512"] > 0


def test_gguf_judge_suite_smoke(tmp_path_factory):
    """llama.cpp judges our Q4_K_M file and its own imatrix Q4_K_M of the perturbed tiny model
    on both held-out domains: KL from llama-perplexity's own report, the pair compared, the
    file's bits per weight recorded, the table rendered."""
    from benchmarks.peers.llama_cpp_env import ready_tools
    from benchmarks.suites.gguf_judge import DOMAINS, render

    if ready_tools() is None:
        pytest.skip("llama.cpp tools not built (python -m benchmarks.peers.llama_cpp_env --tools)")
    tmp = tmp_path_factory.mktemp("bench-gguf-judge")
    arms = {"tiny:cpu-quant-q4_k_m", "tiny:llama.cpp-q4_k_m-imatrix"}
    result = _run_smoke("gguf_judge", tmp, "--arms", ",".join(sorted(arms)), result="gguf-judge")
    _check_common(result, arms)
    for rec in result["records"]:
        assert all(rec["metrics"][f"kl_{d}"] >= 0 for d in DOMAINS)
        assert rec["extras"]["bits_per_weight_linears"] > 4 and rec["extras"]["tensor_types"]
        assert 0 < rec["extras"]["same_top_italian"] <= 1
    table = render(tmp / "results", tmp, smoke=True)
    assert "Q4_K_M" in table and "×" in table
