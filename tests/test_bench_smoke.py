"""Smoke runs of the ``quantize``, ``fidelity`` and ``memory`` benchmark suites, so the harness
cannot rot.

One pass each, tiny settings (a 2-layer random Llama with the demo tokenizer, 4 × 64
calibration tokens, 2 × 64 evaluation tokens), through the real entry point
``python -m benchmarks run SUITE --smoke``. To stay within the time budget each run takes a
subset of its arms (quantize: cpu-quant GPTQ and GPTQModel; fidelity: data-free RTN, GPTQ and
GPTQModel, the last two evaluated from the quantize run's artifacts through ``--artifact``);
the full arm lists run with ``python -m benchmarks run SUITE --smoke``. GPTQModel
may only be skipped when its venv is absent, and then the skip must be written in the result
file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import provenance
from benchmarks.peers import gptqmodel_env

REPO = Path(__file__).resolve().parents[1]


def _run_smoke(suite: str, tmp: Path, *extra: str) -> dict:
    out = tmp / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", suite, "--smoke", "--out", str(out),
         "--workdir", str(tmp / "work"), *extra],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    files = sorted(out.glob(f"{suite}-smoke-*.json"))
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
                      "--arms", "rtn,gptq,gptqmodel", *prebuilt)


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
    _check_common(fidelity_result, {"rtn", "gptq", "gptqmodel"})
    assert fidelity_result["arms"]["gptq"]["prebuilt"]  # taken from the quantize run
    assert set(fidelity_result["builds"]) == {"rtn"}
    for rec in fidelity_result["records"]:
        if not rec["ok"]:
            continue
        m = rec["metrics"]
        assert m["kl_mean"] >= 0 and 0 <= m["top1_agreement"] <= 1
        assert 0 <= m["greedy_prefix_fraction"] <= 1
        snr = rec["extras"]["per_layer_weight_snr_db"]
        assert set(snr) == {"0", "1"} and all(v > 5 for v in snr.values())
    # an arm whose command does not exist yet is named in the notes, not silently dropped
    from benchmarks.suites.fidelity import cli_commands

    if "tinygemm" not in cli_commands():
        assert any(n.startswith("tinygemm-asym: not measured") for n in fidelity_result["notes"])


def test_memory_suite_smoke(tmp_path_factory):
    result = _run_smoke("memory", tmp_path_factory.mktemp("bench-memory"),
                        "--arms", "depth-1x,depth-4x,calib-8-offload")
    _check_common(result, {"depth-1x", "depth-4x", "calib-8-offload"})
    layers = {r["arm"]: r["extras"]["layers"] for r in result["records"]}
    assert layers == {"depth-1x": 2, "depth-4x": 8, "calib-8-offload": 2}
    assert result["arms"]["calib-8-offload"]["flags"] == ["--offload-activations"]
    for rec in result["records"]:
        assert rec["metrics"]["peak_rss_anon_bytes"] > 50 * 2**20
