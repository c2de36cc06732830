"""`cpu-quant report DIR`: one self-contained report.html, checked in a real headless browser."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from cpu_quant.eval import stats
from cpu_quant.report.html import write_report_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def synthetic_report(layers: int = 4) -> dict:
    kinds = ["self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"]
    tensors = [{"name": f"model.layers.{i}.{k}", "shape": [64, 128],
                "group_size": 32 if k != "mlp.down_proj" else 64,
                "weighted_snr_db": 18.0 + i + j, "damp": 0.03 if (i, j) == (1, 0) else 0.01,
                "damp_raised": (i, j) == (1, 0)} for i in range(layers) for j, k in enumerate(kinds)]
    tensors.append({"name": "lm_head", "shape": [1000, 64], "group_size": 32, "weighted_snr_db": 21.5,
                    "damp": 0.01, "damp_raised": False})
    kl = torch.rand(2000, generator=torch.Generator().manual_seed(0)) ** 4
    fid = {"kl_mean": float(kl.mean()), "kl_stderr": float(kl.std() / 2000 ** 0.5),
           "kl_median": float(kl.median()), "kl_p90": 0.6, "kl_p99": 0.9, "kl_max": float(kl.max()),
           "ppl_reference": 12.0, "ppl_reference_stderr": 0.3, "ppl_quantized": 12.5,
           "ppl_quantized_stderr": 0.3, "ppl_delta": 0.5, "ppl_delta_stderr": 0.05,
           "top1_agreement": 0.9, "top1_stderr": 0.007, "greedy_prefix_fraction": 0.6,
           "greedy_exact": 3, "greedy_prompts": 12, "tokens": 2000, "kl_histogram": stats.kl_histogram(kl)}
    return {"settings": {"method": "gptq", "group_size": 64, "symmetric": True, "samples": 16},
            "layout": "gptq", "tensors": tensors, "layer_seconds": [1.0 + 0.1 * i for i in range(layers)],
            "head_seconds": 0.5, "total_seconds": 9.0, "calibration_tokens": 4096,
            "plan_notes": ["model.layers.0.self_attn.q_proj: group 32 (64 does not divide <script>)"],
            "bits_per_weight": 4.3, "bits_per_weight_on_disk": 4.4, "head_quantized": True,
            "phase_seconds": {"quantize": 3.0, "hessians": 1.0},
            "phases": {"quantize": {"seconds": 9.1, "peak_rss_anon_mib": 812.5},
                       "eval": {"seconds": 4.0, "peak_rss_anon_mib": 900.0}},
            "fidelity": {"weights": fid, "w4a8_emulated": {**fid, "kl_mean": fid["kl_mean"] * 1.2}},
            "provenance": {"git_sha": "0" * 40, "threads": 2, "time": "2026-12-02T00:00:00Z"},
            "command_line": "cpu-quant gptq SRC DST"}


@pytest.fixture
def report_dir(tmp_path) -> Path:
    d = tmp_path / "artifact"
    d.mkdir()
    (d / "quantization_report.json").write_text(json.dumps(synthetic_report()))
    return d


def test_report_html_is_self_contained(report_dir):
    html = write_report_html(report_dir).read_text()
    for section in ("Settings", "Bits per weight", "Weighted SNR", "Damping and group fallbacks",
                    "The head", "Fidelity", "Timings and memory", "Provenance"):
        assert f"<h2>{section}</h2>" in html
    assert "0.0" in html and "±" in html and "peak RssAnon MiB" in html
    assert html.count("<svg") >= 5  # SNR, KL bars, two KL histograms, seconds per layer
    # nothing is fetched at view time: no script, stylesheet, image, frame or link
    assert not re.search(r"<(script|link|img|iframe|object)\b", html)
    assert not re.search(r"\b(src|href)\s*=", html)
    assert re.findall(r"https?://[^\"' ]+", html) == ["http://www.w3.org/2000/svg"] * html.count("<svg")
    assert "&lt;script&gt;" in html  # report text is escaped


def _chromium(page: Path, shot: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           f"--screenshot={shot}", "--window-size=1100,3000",
                           "--enable-logging=stderr", "--v=0", page.as_uri()],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.e2e
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium)")
def test_report_html_renders_in_headless_chromium_without_console_errors(report_dir, tmp_path):
    from PIL import Image

    # the detector first: a page with a console error and an exception must be caught
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>console.error('x'); nosuch();</script></body></html>")
    proc = _chromium(bad, tmp_path / "bad.png")
    assert len(re.findall(r":CONSOLE[:(]", proc.stderr)) >= 2, proc.stderr[-2000:]

    page = write_report_html(report_dir)
    shot = tmp_path / "report.png"
    proc = _chromium(page, shot)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not re.findall(r".*:CONSOLE[:(].*", proc.stderr)
    img = Image.open(shot).convert("RGB")
    assert img.size == (1100, 3000)
    colors = img.getcolors(maxcolors=1 << 20) or []
    assert len(colors) > 50  # text and plots drew, not a blank page
    shutil.copy(shot, Path("/tmp") / "cpu-quant-report-screenshot.png")
