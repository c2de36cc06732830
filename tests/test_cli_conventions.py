"""The CLI conventions of the ecosystem: `--json` on every command (one JSON document on stdout,
nothing else there), `--threads`, `-q`/`-v`, Hub ids from the local cache, an output name
without repetition, and the model card and report.html written into every artifact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cpu_quant.cli.conventions import default_output_name
from cpu_quant.core.errors import CpuQuantError
from cpu_quant.hub import checkpoint_name, resolve_checkpoint
from cpu_quant.model_card import write_model_card


@pytest.mark.parametrize("src, kind, method, expected", [
    ("SmolLM2-135M-Instruct-bf16", "gptq", "gptq", "SmolLM2-135M-Instruct-gptq-w4g128"),
    ("SmolLM2-135M-Instruct-bf16", "gptq", "rtn", "SmolLM2-135M-Instruct-gptq-rtn-w4g128"),
    ("Qwen2.5-0.5B-fp16", "cpu_int4", "gptq", "Qwen2.5-0.5B-cpu_int4-gptq-w4g128"),
    ("Llama-3.2-1B", "gptq", "gptq", "Llama-3.2-1B-gptq-w4g128"),
    ("hub/models--org--Tiny-bf16/snapshots/0123abc", "gptq", "gptq", "Tiny-gptq-w4g128"),
])
def test_default_output_name_does_not_repeat(src, kind, method, expected):
    assert default_output_name(Path(src), kind, method, 128) == expected


def fake_hub_cache(cache: Path, repo_id: str, files_from: Path, rev: str = "0123456789abcdef") -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/...}."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in files_from.iterdir():
        shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def test_hub_id_resolves_from_the_local_cache_only(tiny_llama, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = fake_hub_cache(cache, "org/tiny-bf16", tiny_llama)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_checkpoint("org/tiny-bf16") == snap
    assert checkpoint_name(snap) == "tiny-bf16"
    with pytest.raises(CpuQuantError, match=r"hf download org/not-cached"):
        resolve_checkpoint("org/not-cached")
    assert resolve_checkpoint(str(tiny_llama)) == tiny_llama  # a local path as it is


def _stdout_json(stdout: str) -> dict:
    return json.loads(stdout)  # the whole of stdout, nothing before or after the document


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_gptq_from_a_hub_id_json_threads_card_and_report(tiny_llama, tmp_path):
    """One real `cpu-quant gptq` process: SRC a cached Hub id, --json, --threads 1 (reaching the
    quantizer: its provenance reads torch.get_num_threads()), default DST name, model card with
    the source's licence and the measured fidelity, report.html beside the artifact."""
    src_files = tmp_path / "src"
    shutil.copytree(tiny_llama, src_files)
    (src_files / "README.md").write_text("---\nlicense: mit\nbase_model: org/tiny\n---\n# tiny\n")
    cache = tmp_path / "hub"
    fake_hub_cache(cache, "org/tiny-bf16", src_files)
    work = tmp_path / "cwd"
    work.mkdir()
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-m", "cpu_quant.cli", "gptq", "org/tiny-bf16",
                           "--method", "rtn", "--calib", "none", "--group", "32", "--json",
                           "--threads", "1"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = _stdout_json(proc.stdout)
    dst = work / "tiny-gptq-rtn-w4g32"
    assert doc["output"] == str(dst) and dst.is_dir()
    assert doc["provenance"]["threads"] == 1
    assert doc["fidelity"]["weights"]["kl_stderr"] >= 0
    assert "layers" in proc.stderr  # the progress bar went to stderr
    report = json.loads((dst / "quantization_report.json").read_text())
    assert report["fidelity"]["weights"]["kl_histogram"]["counts"]
    assert set(report["phases"]) == {"quantize", "eval"}
    assert report["phases"]["quantize"]["peak_rss_anon_mib"] > 0
    card = (dst / "README.md").read_text()
    assert card.startswith("---\nlicense: mit\n")
    assert "carried from the source's README.md front matter" in card
    assert "cpu-quant gptq org/tiny-bf16" in card and "vllm serve" in card
    assert f"{report['bits_per_weight']:.3f} bits per quantized weight" in card
    assert "KL(bf16 ‖ quant), mean" in card and "±" in card
    assert (dst / "report.html").is_file()


def _invoke(*args: str):
    from cpu_quant.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_every_command_prints_parseable_json(tiny_llama, tmp_path, monkeypatch):
    tg = tmp_path / "tg"
    res = _invoke("tinygemm", str(tiny_llama), str(tg), "--method", "rtn", "--calib", "none",
                  "--group", "32", "--sym", "--no-eval", "--json", "-q")
    assert res.exit_code == 0, res.stderr
    assert _stdout_json(res.stdout)["outputs"] == {"cpu_int4": str(tg)}
    assert "layers" not in res.stderr  # -q: no progress bar
    conv = tmp_path / "conv"
    res = _invoke("convert", str(tg), str(conv), "--to", "gptq", "--json")
    assert res.exit_code == 0, res.stderr
    assert _stdout_json(res.stdout)["target_format"] == "gptq"
    assert "Repacked bit-exactly" in (conv / "README.md").read_text()
    assert (conv / "report.html").is_file()
    for args in (["verify", str(conv)], ["inspect", str(conv)], ["probe"], ["report", str(conv)]):
        res = _invoke(*args, "--json")
        assert res.exit_code == 0, (args, res.stderr)
        assert isinstance(_stdout_json(res.stdout), dict), args

    import cpu_quant.cli.export_phone as export_commands

    fake = json.loads((Path(__file__).parent / "fixtures" / "export_phone_report.json").read_text())
    monkeypatch.setattr(export_commands, "run_export_phone", lambda *a, **k: fake)
    res = _invoke("export-phone", str(tiny_llama), str(tmp_path / "pte"), "--json")
    assert res.exit_code == 0, res.stderr
    assert _stdout_json(res.stdout)["backend"] == fake["backend"]


def test_model_card_for_a_file_artifact_is_written_atomically(tmp_path):
    gguf = tmp_path / "model-Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"license": "apache-2.0"}))
    path = write_model_card(gguf, {"settings": {"method": "rtn", "group_size": 32},
                                   "bits_per_weight": 4.5}, src, "gguf")
    assert path == tmp_path / "model-Q4_0.gguf.README.md"
    text = path.read_text()
    assert f"llama-cli -m {gguf}" in text and "license: apache-2.0" in text
    assert "Not measured" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-Q4_0.gguf",
                                                          "model-Q4_0.gguf.README.md", "src"]


def test_quiet_and_verbose_together_are_refused(tmp_path):
    res = _invoke("gptq", str(tmp_path / "src"), str(tmp_path / "dst"), "-q", "-v")
    assert res.exit_code == 2 and "-q and -v contradict" in res.stderr


def test_python_dash_m_is_the_same_command_line():
    """``python -m cpu_quant`` is ``cpu-quant``: same program name, same errors."""
    out = subprocess.run([sys.executable, "-m", "cpu_quant", "gptq", "--group", "7", "/nonexistent"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error:"), out.stderr
    helped = subprocess.run([sys.executable, "-m", "cpu_quant", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("Usage: cpu-quant"), helped.stdout


def test_a_down_group_the_formats_cannot_store_is_one_line_before_any_work(tiny_llama, tmp_path):
    dst = tmp_path / "dst"
    res = _invoke("gptq", str(tiny_llama), str(dst), "--down-group", "48", "--no-eval")
    assert res.exit_code != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--down-group 48 is not stored by" in lines[0], res.stderr
    assert not dst.exists()


def _default_build_report() -> dict:
    """The report of the default build (``cpu-quant gptq``) as the pipeline records it: the
    settings as given (head and down groups None: the plan's defaults), the groups each tensor
    got, and the smoothing record."""
    from dataclasses import asdict

    from cpu_quant.quantize.settings import QuantSettings

    tensors = [{"name": f"model.layers.0.{leaf}", "group_size": g, "shape": [576, 576],
                "weighted_snr_db": 20.0} for leaf, g in (("self_attn.q_proj", 128),
                                                          ("mlp.up_proj", 128),
                                                          ("mlp.down_proj", 64))]
    tensors.append({"name": "lm_head", "group_size": 32, "shape": [49152, 576],
                    "weighted_snr_db": 20.0})
    return {"settings": asdict(QuantSettings(smooth=None)), "tensors": tensors,
            "head_quantized": True, "calibration_tokens": 65536, "bits_per_weight": 4.2,
            "smoothing": {"alpha_counts": {"0.5": 20, "off": 10}}}


def test_model_card_states_every_setting_that_changed_the_weights(tmp_path):
    """The default build's card states its activation smoothing, its head in groups of 32 and
    its down projections in groups of 64 (settings it leaves at None: the plan's defaults),
    and every weight-affecting field of QuantSettings has a row."""
    from dataclasses import fields

    from cpu_quant.model_card import NOT_WEIGHTS, SETTING_ROWS, model_card_text
    from cpu_quant.quantize.settings import QuantSettings

    card = model_card_text(tmp_path / "out", _default_build_report(), tmp_path, "gptq")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in card.splitlines()
            if line.startswith("| ")}
    assert rows["activation smoothing"].startswith("| activation smoothing | folded")
    assert "0.5 in 20" in rows["activation smoothing"]
    assert rows["output head"] == "| output head | quantized, groups of 32 |"
    assert rows["MLP down projections"] == "| MLP down projections | groups of 64 |"
    assert rows["group size"] == "| group size | 128 |"
    names = {f.name for f in fields(QuantSettings)}
    assert set(SETTING_ROWS) | set(NOT_WEIGHTS) <= names, "a table names a field that is gone"
    for name in names - set(NOT_WEIGHTS):
        assert SETTING_ROWS.get(name, name) in rows, f"the card does not state {name}"


def test_model_card_states_a_setting_it_does_not_know(tmp_path):
    """A setting added to the run's record without a row of its own is stated as it is,
    never left out; one that cannot change a weight is not."""
    from cpu_quant.model_card import model_card_text

    report = _default_build_report()
    report["settings"]["rotate"] = "hadamard"
    report["smoothing"] = None
    card = model_card_text(tmp_path / "out", report, tmp_path, "gptq")
    assert '| rotate | "hadamard" |' in card
    assert "| activation smoothing | none |" in card
    assert "offload_activations" not in card
