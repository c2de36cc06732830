"""Suite ``phone``: ExecuTorch programs for phones, on this CPU: XNNPACK fp32 vs 8da8w vs
8da4w, and QNN's w8a16 and 16a4w programs on ExecuTorch's portable kernels.

Arms (baseline ``fp32``), one per scheme of ``cpu-quant export-phone``:

``fp32``    float32 weights and activations, delegated to XNNPACK
``8da8w``   int8 weights per channel (weighted scale search), int8 activations per token at run
            time
``8da4w``   int4 GPTQ codes in groups of 32 (the export's own calibrated GPTQ run, positive
            scales, activation smoothing folded into the weights first: ``cpu-quant gptq
            --smooth``, the export's default for 8da4w), int8 activations per token
``8da4w-nosmooth``  the same without the smoothing (``export-phone --no-smooth``)
``8da4w-head8``  8da4w with the head left out of the GPTQ run and stored at 8 bits per output
            channel (``export-phone --head-bits 8``): with the int8 embedding that every
            XNNPACK scheme stores, ExecuTorch's published Llama-3.2 recipe
``w8a16``   QNN: int8 weights per channel, calibrated uint16 activations; without the Qualcomm
            SDK the program runs on ExecuTorch's portable kernels on this host (not the HTP)
``16a4w``   QNN: int4 GPTQ codes per output channel, calibrated uint16 activations; portable
            kernels likewise

**Build (once per arm).** ``python -m benchmarks.phone_bench export --out DIR --scheme ARM`` exports
the source with ``cpu_quant.export.pipeline.export_phone`` (static KV cache, ``prefill`` and
``decode`` methods, verification of the ``.pte`` against the float source on 16 held-out
windows of 128 tokens included) into the arm's build directory. The harness records the build's
wall time and peak
RssAnon (``result["builds"]``); the export's own phase times (load, quantize and lower, write,
verify) are in every pass's extras. Export time is a single measurement per run, not a median.

**Pass.** ``python -m benchmarks.phone_bench measure --pte DIR/model.pte`` in a fresh process:
load the program with ExecuTorch's runtime (pybindings), warm up, prefill a fixed held-out
prompt through ``prefill`` and greedily decode through ``decode``, batch 1.

Metrics: ``decode_tok_s`` and ``prefill_tok_s`` (higher is better) and ``pte_bytes`` (the
program's size, lower is better; the same every pass, so its spread is 0 and its ratio is
the size against fp32's). Extras per pass: program load time, the export's phase times and
its verification summary (program vs float and vs its quantized eager graph, perplexity).

``--artifact ARM=DIR`` measures an export made elsewhere (``model.pte`` and
``export_report.json`` from ``cpu-quant export-phone --backend xnnpack`` or an earlier run's
build directory) instead of exporting: admitted only when its report names the arm's scheme,
the suite's ``max_seq_len`` and ``prefill_len``, and the source's weights (sha256).

Smoke mode (CI): a tiny random Llama (one decoder layer, hidden 64, the demo tokenizer)
whose tied embedding is scaled to unit variance, so that its next-token distributions are
peaked and the export's verification is not decided by near-ties (as in
``tests/test_export_phone.py``); max_seq_len 48, prefill chunks of 16, a 16-token prompt, 8
decoded tokens, one verification window. One layer because ExecuTorch's lowering passes cost
about half a minute per decoder layer and scheme on this machine, whatever the layer's size.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from ..harness import Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite
from ..render import harness_block
from .quantize import SuiteOptions, select

# the arms: export-phone's schemes, and 8da4w without smoothing
ARMS = ("fp32", "8da8w", "8da4w", "8da4w-nosmooth", "8da4w-head8", "w8a16", "16a4w")
BASELINE = "fp32"
# an arm is a scheme, with export settings of its own where its name says so
SCHEME = {arm: arm.split("-")[0] for arm in ARMS}
ARM_SETTINGS = {"8da4w-nosmooth": {"gptq_smooth": False},  # export-phone --no-smooth
                "8da4w-head8": {"head_bits": 8}}  # export-phone --head-bits 8
BACKEND = {arm: "qnn" if SCHEME[arm] in ("w8a16", "16a4w") else "xnnpack" for arm in ARMS}

REPO = Path(__file__).resolve().parents[2]
REAL = {"max_seq_len": 128, "prefill_len": 64, "prompt_tokens": 64, "gen_tokens": 32,
        "verify_windows": 16, "gptq_samples": 128, "gptq_seqlen": 512}
SMOKE = {"max_seq_len": 48, "prefill_len": 16, "prompt_tokens": 16, "gen_tokens": 8,
         "verify_windows": 1, "gptq_samples": 8, "gptq_seqlen": 64}
TIMEOUT = {"export": 2 * 3600, "measure": 1800}
TIMEOUT_SMOKE = {"export": 600, "measure": 300}
SMOKE_MODEL_VERSION = 1
SMOKE_LAYERS = 1  # ExecuTorch's lowering passes cost ~30 s per layer and scheme here
METRICS = [
    Metric("decode_tok_s", "tok/s", "higher"),
    Metric("prefill_tok_s", "tok/s", "higher"),
    Metric("pte_bytes", "B", "lower"),
]
VERIFICATION_KEYS = ("pte_vs_float", "pte_vs_quantized", "quantized_vs_float", "perplexity",
                     "perplexity_ratio", "passed")


def smoke_model(dst: Path) -> Path:
    """The memory suite's tiny random Llama (one layer), its tied embedding at unit variance."""
    import torch
    from safetensors.torch import load_file, save_file

    from .memory import synthetic_model

    marker = dst / "cpu_quant_phone_smoke.json"
    if marker.is_file():
        return dst
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    synthetic_model(staging, SMOKE_LAYERS, smoke=True)
    path = staging / "model.safetensors"
    tensors = load_file(str(path))
    emb = tensors["model.embed_tokens.weight"].float()
    tensors["model.embed_tokens.weight"] = (emb / emb.std()).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    (staging / marker.name).write_text(json.dumps(
        {"version": SMOKE_MODEL_VERSION, "embedding": "scaled to unit variance"}) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(staging, dst)
    return dst


def _bench_argv(step: str, src: Path, settings: dict) -> list[str]:
    return [sys.executable, "-m", "benchmarks.phone_bench", step, "--src", str(src),
            "--max-seq-len", str(settings["max_seq_len"]),
            "--prefill-len", str(settings["prefill_len"]),
            "--prompt-tokens", str(settings["prompt_tokens"]),
            "--gen-tokens", str(settings["gen_tokens"]),
            "--verify-windows", str(settings["verify_windows"]),
            "--gptq-samples", str(settings["gptq_samples"]),
            "--gptq-seqlen", str(settings["gptq_seqlen"])]


def check_export(export_dir: Path, arm: str, settings: dict) -> dict:
    """The export's report, after checking it is this arm's program at the suite's sizes."""
    report = json.loads((export_dir / "export_report.json").read_text())
    s = report["settings"]
    own = ARM_SETTINGS.get(arm, {})
    got = (report["backend"], report["scheme"], s["max_seq_len"], s["prefill_len"],
           {k: s.get(k) for k in own})
    want = (BACKEND[arm], SCHEME[arm], settings["max_seq_len"], settings["prefill_len"],
            own)
    if got != want:
        raise ValueError(f"{export_dir}: export (backend, scheme, max_seq_len, prefill_len, "
                         f"arm settings) = {got}, the arm wants {want}")
    if not (export_dir / "model.pte").is_file():
        raise ValueError(f"{export_dir} has no model.pte")
    return report


def check_source(export_dir: Path, src: Path) -> None:
    """A program made elsewhere must come from the very checkpoint the passes read (its shapes
    and tokenizer): the export report's sha256 of the source's weights must match."""
    from cpu_quant.export.report import sha256_file

    report = json.loads((export_dir / "export_report.json").read_text())
    ours = {f.name: sha256_file(f) for f in sorted(src.glob("*.safetensors"))}
    if report.get("provenance", {}).get("source_sha256") != ours:
        raise ValueError(f"{export_dir} was not exported from {src} (the weights' sha256 differ)")


def scheme_arm(scheme: str, src: Path, settings: dict, timeouts: dict,
               prebuilt: Path | None = None) -> Arm:
    def export_dir(ctx: PassContext) -> Path:
        return prebuilt if prebuilt is not None else ctx.build_dir / "export"

    def build_cmd(bdir: Path) -> Command:
        return Command([*_bench_argv("export", src, settings), "--out", str(bdir / "export"),
                        "--scheme", scheme], cwd=str(REPO), timeout=timeouts["export"])

    def command(ctx: PassContext) -> Command:
        pte = export_dir(ctx) / "model.pte"
        return Command([*_bench_argv("measure", src, settings), "--pte", str(pte),
                        "--record", str(ctx.workdir / "measure.json")],
                       cwd=str(REPO), timeout=timeouts["measure"])

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        report = check_export(export_dir(ctx), scheme, settings)
        rec = json.loads((ctx.workdir / "measure.json").read_text())
        for key in ("max_seq_len", "prefill_len", "prompt_tokens", "gen_tokens"):
            if rec[key] != settings[key]:
                raise HarnessError(f"{scheme}: the pass ran with {key}={rec[key]}, "
                                   f"not {settings[key]}")
        pte_bytes = (export_dir(ctx) / "model.pte").stat().st_size
        if pte_bytes != report["sizes"]["pte_bytes"]:
            raise HarnessError(f"{scheme}: model.pte is not the program the export reported")
        return {"decode_tok_s": rec["decode_tok_s"], "prefill_tok_s": rec["prefill_tok_s"],
                "pte_bytes": pte_bytes}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        report = json.loads((export_dir(ctx) / "export_report.json").read_text())
        rec = json.loads((ctx.workdir / "measure.json").read_text())
        return {"load_s": rec["load_s"], "runtime_threads": rec["threads"],
                "export_timings_s": report["timings_s"],
                "pte_ratio_vs_float32_params": report["sizes"]["ratio_vs_float32"],
                "verification": {k: report["verification"].get(k) for k in VERIFICATION_KEYS},
                "weights": report.get("weights"), "stored_weights": report.get("stored_weights")}

    return Arm(scheme, {"backend": BACKEND[scheme], "scheme": SCHEME[scheme],
                        **ARM_SETTINGS.get(scheme, {}),
                        "group_size": {"8da4w": 32, "16a4w": -1}.get(SCHEME[scheme]),
                        "source": str(src),
                        "prebuilt": str(prebuilt) if prebuilt else None},
               command, collect, build=None if prebuilt else build_cmd,
               artifacts=lambda ctx: {"model.pte": export_dir(ctx) / "model.pte"},
               extras=extras)


def make_suite(smoke: bool, workdir: Path, src: Path | None = None,
               arms: list[str] | None = None, prebuilt: dict[str, Path] | None = None,
               ) -> Suite:
    settings = dict(SMOKE if smoke else REAL)
    settings["prefill_len"] = min(settings["prefill_len"], settings["max_seq_len"])
    timeouts = TIMEOUT_SMOKE if smoke else TIMEOUT
    if src is None:
        if smoke:
            src = smoke_model(workdir / "inputs" / f"phone-smoke-llama-v{SMOKE_MODEL_VERSION}")
        else:
            from cpu_quant.models.demo import demo_model_path

            src = demo_model_path()
    given = {k: Path(v).resolve() for k, v in (prebuilt or {}).items()}
    unknown = sorted(set(given) - set(ARMS))
    if unknown:
        raise ValueError(f"--artifact names unknown arm(s): {', '.join(unknown)}; "
                         f"known: {', '.join(ARMS)}")
    chosen = select([scheme_arm(s, src, settings, timeouts, given.get(s)) for s in ARMS],
                    arms)
    for arm in chosen:
        if arm.name in given:  # before spending any pass on it
            check_export(given[arm.name], arm.name, settings)
            check_source(given[arm.name], src)
    return Suite(
        name="phone",
        description=("ExecuTorch programs on this CPU, XNNPACK (fp32, 8da8w, 8da4w) and QNN's "
                     "w8a16 and 16a4w on the portable kernels: .pte size, export time (one "
                     "build per arm) and prefill/decode tokens/s through the ExecuTorch "
                     "runtime, batch 1, "
                     + (f"SMOKE, {src.name}" if smoke else src.name)),
        metrics=METRICS,
        arms=chosen,
        settings={"source": str(src), **settings,
                  "runtime": "ExecuTorch Python runtime (pybindings), greedy, batch 1"},
        baseline=BASELINE if any(a.name == BASELINE for a in chosen) else None,
        inputs={"source_model": src},
        notes=["export time is a one-off build measurement per arm (result['builds'][arm]: "
               "process wall time and peak RssAnon; extras.export_timings_s: the export's own "
               "phases), not a median over passes",
               "pte_bytes is the same in every pass (one build); its ratio is the size against "
               "the fp32 program"],
    )


def build(opts: SuiteOptions) -> Suite:
    return make_suite(opts.smoke, opts.workdir, opts.source, opts.arms, opts.prebuilt)


def _verification(arm: str, doc: dict) -> dict:
    """The export's verification (the build's, the same in every pass's record)."""
    return next(r["extras"]["verification"] for r in doc["records"] if r["arm"] == arm and r.get("ok"))


def _vs_float(arm: str, doc: dict) -> str:
    v = _verification(arm, doc)["pte_vs_float"]
    return f"{v['snr_db']:.1f} dB / {v['top1_agreement']:.3f} / {v['mean_kl']:.4f}"


def _perplexity(arm: str, doc: dict) -> str:
    v = _verification(arm, doc)
    return f"{v['perplexity']['pte']:.2f} (×{v['perplexity_ratio']:.4f})"


def _vs_own_graph(arm: str, doc: dict) -> str:
    v = _verification(arm, doc)["pte_vs_quantized"]
    return f"{v['snr_db']:.1f} dB / {v['top1_agreement']:.3f}"


def _export(arm: str, doc: dict) -> str:
    b = doc["builds"][arm]
    return f"{b['wall_seconds']:.0f} s, {b['rss']['peak_rss_anon_bytes'] / 2**30:.1f} GiB"


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table, with each export's
    verification against the float model and its own quantized graph."""
    return harness_block(results, docs, "phone", "python -m benchmarks run phone", {
        "vs float: SNR / top-1 / mean KL": _vs_float, "perplexity (× float)": _perplexity,
        "vs own graph: SNR / top-1": _vs_own_graph, "export: time, peak RssAnon": _export})
