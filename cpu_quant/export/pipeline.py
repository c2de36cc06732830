"""``export_phone``: checkpoint in, verified ExecuTorch program directory out.

Stages: read and check the checkpoint → build the float static graph (``model``) → quantize for
the backend (``qnn`` calibrates; ``xnnpack`` quantizes activations at run time) → export the
``prefill`` (``prefill_len`` rows) and ``decode`` (1 row) methods → lower → write into a staging
directory → run the written ``.pte`` through ExecuTorch's runtime (``verify``) → rename into
place. A program that fails verification raises ``VerificationFailed`` and leaves nothing behind.

Output directory:

* ``model.pte``: methods ``prefill`` and ``decode`` (I/O contract in ``model``'s docstring);
* ``qnn_prefill.pt2``, ``qnn_decode.pt2`` (backend ``qnn``): the calibrated quantized programs;
* the tokenizer files of the source checkpoint, so the directory is self-contained;
* ``export_report.json`` (``report``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import CpuQuantError, Interrupted, VerificationFailed
from ..io.artifact import StagedOutput, check_destination
from ..io.checkpoint import load_tokenizer
from . import qnn, xnnpack
from .model import (
    StaticCausalLM,
    check_max_seq_len,
    export_methods,
    load_static_lm,
    read_spec,
    use_mean4d_norms,
)
from .report import count_ops, float32_bytes, json_safe, provenance, sha256_file
from .runner import GraphShape
from .verify import PROMPTS, pte_step_functions, verify

BACKENDS = ("qnn", "xnnpack")
DEFAULT_SCHEME = {"qnn": "w8a16", "xnnpack": "8da8w"}
# n-gram length for the calibration/held-out overlap check: long enough that common phrases
# do not collide, short enough to catch a held-out passage pasted into --calib.
OVERLAP_NGRAM = 24


# the settings that are command-line options, by their flag; the rest only the Python API sets
SETTING_NAMES = {"prefill_len": "--prefill-len", "calib_samples": "--calib-samples",
                 "max_seq_len": "--max-seq-len", "group_size": "--group-size"}


@dataclass
class PhoneExportSettings:
    backend: str = "qnn"
    scheme: str | None = None  # None: the backend's default
    max_seq_len: int = 512
    prefill_len: int = 64  # capped at max_seq_len
    calib: str | None = None  # None: the built-in corpus' calibration split
    calib_samples: int = 16  # 0: no calibration (observers see only the trace input)
    calib_len: int = 128  # tokens per calibration window, capped at max_seq_len
    calib_decode_tokens: int = 8  # of each window, fed through the decode method
    group_size: int = 32  # 8da4w
    verify_windows: int = 4
    verify_len: int = 128  # capped at max_seq_len
    gen_tokens: int = 16
    soc: str = qnn.DEFAULT_SOC

    @property
    def resolved_scheme(self) -> str:
        return self.scheme or DEFAULT_SCHEME.get(self.backend, "")

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise CpuQuantError(f"unknown backend {self.backend!r} (choose from {', '.join(BACKENDS)})")
        scheme = self.resolved_scheme
        if self.backend == "qnn" and scheme not in qnn.QNN_SCHEMES:
            raise CpuQuantError(f"--backend qnn supports --scheme {', '.join(qnn.QNN_SCHEMES)}, "
                                f"not {scheme!r}")
        if self.backend == "xnnpack" and scheme != "fp32":
            xnnpack.check_scheme(scheme)
        if self.backend == "xnnpack" and self.calib is not None:
            raise CpuQuantError("--calib applies to --backend qnn only: the XNNPACK schemes "
                                "quantize activations at run time and calibrate nothing")
        for name, least in (("prefill_len", 1), ("calib_len", 1), ("verify_len", 1),
                            ("verify_windows", 1), ("gen_tokens", 1), ("calib_samples", 0),
                            ("calib_decode_tokens", 0)):
            if getattr(self, name) < least:
                raise CpuQuantError(f"{SETTING_NAMES.get(name, 'PhoneExportSettings.' + name)} "
                                    f"must be >= {least}, got {getattr(self, name)}")

    def shape(self, model: StaticCausalLM) -> GraphShape:
        s = model.spec
        return GraphShape(s.n_layers, s.n_kv_heads, s.head_dim, s.vocab_size, self.max_seq_len,
                          min(self.prefill_len, self.max_seq_len))


@dataclass
class Built:
    """A lowered program with the eager graphs it must agree with."""

    manager: object  # ExecutorchProgramManager
    quantized: dict[str, torch.nn.Module]  # method -> quantized eager graph
    calibration: dict
    extra_files: dict[str, str]  # written next to model.pte: name -> what it is
    qnn_lowering: str | None = None
    qnn_programs: dict | None = None  # method -> ExportedProgram, saved as qnn_<method>.pt2


def _ngrams(ids: list[int]) -> set[int]:
    n = OVERLAP_NGRAM
    return {hash(tuple(ids[i:i + n])) for i in range(0, max(0, len(ids) - n + 1))}


def check_no_overlap(calib_windows: list[list[int]], heldout_windows: list[list[int]]) -> None:
    """Calibrating on the text we evaluate on would flatter every number: refuse it."""
    calib = set().union(*(_ngrams(w) for w in calib_windows)) if calib_windows else set()
    for w in heldout_windows:
        if _ngrams(w) & calib:
            raise CpuQuantError("the calibration text overlaps the held-out text used for "
                                "verification; calibrate on different text")


def eager_graphs(programs: dict) -> dict[str, torch.nn.Module]:
    """The exported quantized programs as runnable torch modules, with constant subgraphs (the
    weights' dequantize ops) folded once. Exact: the folded constants are what the ops compute
    on every call (checked bitwise on 8da8w), and it makes the reference ~20x faster."""
    from executorch.exir.passes.constant_prop_pass import constant_prop_pass

    return {name: constant_prop_pass(copy.deepcopy(ep)).module() for name, ep in programs.items()}


def build_xnnpack(model: StaticCausalLM, shape: GraphShape, settings: PhoneExportSettings) -> Built:
    scheme = settings.resolved_scheme
    use_mean4d_norms(model)
    if scheme != "fp32":
        xnnpack.quantize_for_xnnpack(model, scheme, settings.group_size)
    programs = export_methods({name: model for name in shape.methods()}, shape)
    eager = eager_graphs(programs)
    manager = xnnpack.lower_to_xnnpack(programs)
    calibration = {"source": None, "samples": 0, "prefill_tokens": 0, "decode_tokens": 0,
                   "note": "XNNPACK schemes quantize activations per token at run time"}
    return Built(manager, eager, calibration, {})


def build_qnn(model: StaticCausalLM, shape: GraphShape, settings: PhoneExportSettings,
              calib_windows: list[list[int]], progress: bool) -> Built:
    from tqdm import tqdm

    prepared = qnn.prepare(model, shape)
    bar = tqdm(total=len(calib_windows), desc="calibrating", unit="sample", disable=not progress)
    stats = qnn.calibrate(prepared, shape, calib_windows, settings.calib_decode_tokens,
                          progress=bar.update)
    bar.close()
    converted = qnn.convert(prepared)
    programs = export_methods(converted, shape)
    eager = eager_graphs(programs)
    calibration = {"source": settings.calib or "austen (built-in calibration split)",
                   **asdict(stats)}
    if not calib_windows:
        calibration["source"] = None
        calibration["note"] = "uncalibrated: activation ranges come from the trace input only"
    state = "calibrated" if calib_windows else "UNCALIBRATED"
    extra = {f"qnn_{name}.pt2": f"{state} quantized program (torch.export) for QNN lowering"
             for name in programs}
    if qnn.qnn_sdk_root() is not None:
        manager = qnn.lower_to_qnn(programs, shape, settings.soc)
        lowering = "htp"
    else:
        manager = qnn.lower_to_portable(programs)
        lowering = "not-done"
    return Built(manager, eager, calibration, extra, lowering, programs)


def heldout_windows(tok, settings: PhoneExportSettings) -> list[list[int]]:
    from ..data.corpus import builtin_split, token_windows

    length = min(settings.verify_len, settings.max_seq_len)
    return token_windows(tok, builtin_split("heldout"), settings.verify_windows, length)


def calibration_windows(tok, settings: PhoneExportSettings) -> list[list[int]]:
    from ..data.corpus import load_texts, token_windows

    texts = load_texts(settings.calib, "calibration")  # a missing --calib is an error even at 0
    if settings.calib_samples == 0:
        return []
    length = min(settings.calib_len, settings.max_seq_len)
    try:
        return token_windows(tok, texts, settings.calib_samples, length)
    except CpuQuantError as exc:  # phrased in the quantize commands' flags; restate in ours
        if "too short" not in str(exc):
            raise
        raise CpuQuantError(f"the calibration text is too short for one window of {length} "
                            f"tokens (calibration windows are min(128, --max-seq-len) tokens)"
                            ) from None


def _prompts(tok, settings: PhoneExportSettings) -> tuple[list[str], list[list[int]]]:
    texts, ids = [], []
    for text in PROMPTS:
        tokens = tok(text, add_special_tokens=False)["input_ids"]
        if len(tokens) + settings.gen_tokens <= settings.max_seq_len:
            texts.append(text)
            ids.append(tokens)
    if not ids:
        raise CpuQuantError(f"--max-seq-len {settings.max_seq_len} leaves no room to generate "
                            f"{settings.gen_tokens} tokens after the verification prompts")
    return texts, ids


QNN_NEXT_STEP = (
    "On a machine with Qualcomm's QNN SDK (QNN_SDK_ROOT set, executorch 1.5.1): run the same "
    "command there, or lower these saved programs with "
    "python -c 'from cpu_quant.export.qnn import finish_qnn_lowering as f; f(\"{out}\", "
    "\"{soc}\")', which writes {out}/model_htp.pte (docs/phone.md)."
)


def export_phone(src: str | Path, out: str | Path, settings: PhoneExportSettings, *,
                 overwrite: bool = False, progress: bool = True) -> dict:
    """Export, verify and write; returns the report. Raises CpuQuantError / VerificationFailed."""
    src = Path(src)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    settings.validate()
    check_destination(out, [src], overwrite)
    spec = read_spec(src)
    check_max_seq_len(spec, settings.max_seq_len)
    tok = load_tokenizer(src)
    calib_windows = calibration_windows(tok, settings) if settings.backend == "qnn" else []
    heldout = heldout_windows(tok, settings)
    check_no_overlap(calib_windows, heldout)
    prompt_texts, prompts = _prompts(tok, settings)

    # Refuse an existing OUT and take the lock before minutes of work; everything is written
    # into the staging directory, which is renamed to OUT only after verification passed.
    with StagedOutput(out, overwrite=overwrite, sources=[src]) as staged:
        try:
            report = _build_verify_write(src, staged, settings, tok, calib_windows, heldout,
                                         prompt_texts, prompts, timings, t0, progress)
        except KeyboardInterrupt:
            # export-phone has no --resume: as a CpuQuantError, the staging directory goes too
            raise Interrupted("interrupted: nothing was written") from None
        staged.commit()
    return report


def _build_verify_write(src: Path, staged: StagedOutput, settings: PhoneExportSettings, tok,
                        calib_windows: list[list[int]], heldout: list[list[int]],
                        prompt_texts: list[str], prompts: list[list[int]],
                        timings: dict[str, float], t0: float, progress: bool) -> dict:
    from tqdm import tqdm

    model = load_static_lm(src, settings.max_seq_len)
    shape = settings.shape(model)
    if settings.backend == "xnnpack":
        xnnpack.check_group_size(model, settings.resolved_scheme, settings.group_size)
    reference = copy.deepcopy(model)
    fp32_bytes = float32_bytes(model)
    timings["load"] = time.perf_counter() - t0

    t = time.perf_counter()
    if settings.backend == "qnn":
        built = build_qnn(model, shape, settings, calib_windows, progress)
    else:
        built = build_xnnpack(model, shape, settings)
    timings["quantize_and_lower"] = time.perf_counter() - t

    t = time.perf_counter()
    pte = staged.path("model.pte")
    with open(pte, "wb") as fh:
        built.manager.write_to_file(fh)
    if built.qnn_programs is not None:
        qnn.save_programs(built.qnn_programs, staged.staging)
    tokenizer_files = staged.copy_tokenizer_files(src)
    timings["write"] = time.perf_counter() - t

    t = time.perf_counter()
    arms = {"pte": pte_step_functions(pte),
            "quantized": (built.quantized["prefill"], built.quantized["decode"]),
            "float": (reference, reference)}
    bar = tqdm(total=len(heldout) + len(prompts), desc="verifying", disable=not progress)
    result = verify(shape, arms, heldout, prompts, prompt_texts, settings.gen_tokens,
                    tok.decode, tok.eos_token_id, progress=bar.update)
    bar.close()
    timings["verify"] = time.perf_counter() - t
    if not result.passed:
        raise VerificationFailed(
            "model.pte disagrees with its own quantized eager graph on held-out text ("
            + "; ".join(result.failures) + "); nothing was written")

    produced = {"model.pte": {"bytes": pte.stat().st_size, "sha256": sha256_file(pte),
                              "what": _pte_description(settings, built)}}
    described = {**built.extra_files,
                 **{name: "tokenizer file, copied from the source" for name in tokenizer_files}}
    for name, what in described.items():
        path = staged.path(name)
        produced[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path),
                          "what": what}
    timings["total"] = time.perf_counter() - t0
    report = {
        "backend": settings.backend,
        "scheme": settings.resolved_scheme,
        "settings": asdict(settings),
        "graph": asdict(shape),
        "produced": produced,
        "sizes": {"pte_bytes": produced["model.pte"]["bytes"], "float32_bytes": fp32_bytes,
                  "ratio_vs_float32": round(produced["model.pte"]["bytes"] / fp32_bytes, 4)},
        "ops": count_ops(built.manager),
        "calibration": built.calibration,
        "verification": result.to_dict(),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "provenance": provenance(src),
    }
    if settings.backend == "qnn":
        report["qnn_lowering"] = built.qnn_lowering
        if built.qnn_lowering != "htp":
            report["qnn_next_step"] = QNN_NEXT_STEP.format(out=staged.dst, soc=settings.soc)
    staged.write_json("export_report.json", json_safe(report))
    return report


def _pte_description(settings: PhoneExportSettings, built: Built) -> str:
    if settings.backend == "xnnpack":
        return f"XNNPACK-delegated program, {settings.resolved_scheme}"
    if built.qnn_lowering == "htp":
        return f"QNN HTP-delegated program ({settings.soc}), w8a16"
    calibrated = "calibrated" if built.calibration["samples"] else "UNCALIBRATED"
    return (f"w8a16 {calibrated} program on ExecuTorch's portable CPU kernels (NOT lowered to "
            "the HTP: QNN_SDK_ROOT is unset)")
