"""``export_phone``: checkpoint in, verified ExecuTorch program directory out.

Stages: read and check the checkpoint → build the float static graph (``model``) and score it
on the held-out text → decide the integer weights (``weights``: the calibrated GPTQ codes for
4-bit schemes, from ``--quantized`` or a GPTQ run made here; the weighted scale search for 8-bit
ones) → quantize for the backend (``xnnpack`` puts the weights into torchao's tensor type and
quantizes activations at run time; ``qnn`` calibrates its activation observers) → export the
``prefill`` (``prefill_len`` rows) and ``decode`` (1 row) methods, or ``decode`` alone when
``prefill_len`` is 1 → screen the quantized eager
graph against the float model (``verify.screen``) → lower → write into a staging directory →
read the XNNPACK program's weights back (``readback``) → run the written ``.pte`` through
ExecuTorch's runtime against float and against its eager graph (``verify``) → rename into
place. A program that fails any check raises ``VerificationFailed`` and leaves nothing behind.

Output directory:

* ``model.pte``: methods ``prefill`` and ``decode`` (I/O contract in ``model``'s docstring),
  or ``decode`` alone (``prefill_len`` 1: a prompt goes in a token at a time; half the lowering);
* ``qnn_prefill.pt2``, ``qnn_decode.pt2`` (backend ``qnn``; no prefill file when ``prefill_len``
  is 1): the calibrated quantized programs;
* the tokenizer files of the source checkpoint, so the directory is self-contained;
* ``export_report.json`` (``report``).
"""

from __future__ import annotations

import copy
import gc
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.errors import CpuQuantError, Interrupted, VerificationFailed
from ..core.io.artifact import StagedOutput, check_destination
from ..core.io.checkpoint import check_config_sizes, check_float_weights, load_tokenizer, open_checkpoint
from ..core.smoothing_factors import load_factors
from ..data.corpus import load_texts
from ..data.mix import Calibration, load_calibration
from . import qnn, readback, xnnpack
from . import weights as phone_weights
from .graph import GraphShape
from .model import (
    StaticCausalLM,
    check_max_seq_len,
    export_methods,
    load_static_lm,
    read_spec,
    use_mean4d_norms,
)
from .report import count_ops, float32_bytes, json_safe, provenance, sha256_file
from .runner import StaticKVRunner
from .smooth import smooth_static_lm
from .verify import PROMPTS, pte_step_functions, score_heldout, screen, verify

BACKENDS = ("qnn", "xnnpack")
DEFAULT_SCHEME = {"qnn": "w8a16", "xnnpack": "8da8w"}
FOUR_BIT_SCHEMES = ("8da4w", "16a4w")  # their 4-bit weights are the GPTQ codes
PHONE_GROUPS = (32, 64, 128)  # XNNPACK's blockwise int4 takes multiples of 32; GPTQ these
SMOOTHING_ALPHA = 0.5  # 8da8w's activation smoothing (quantize.smoothing)
# n-gram length for the calibration/held-out overlap check: long enough that common phrases
# do not collide, short enough to catch a held-out passage pasted into --calib.
OVERLAP_NGRAM = 24


# the settings that are command-line options, by their flag; the rest only the Python API sets
SETTING_NAMES = {"prefill_len": "--prefill-len", "calib_samples": "--calib-samples",
                 "max_seq_len": "--max-seq-len", "group_size": "--group",
                 "gptq_samples": "--samples", "gptq_seqlen": "--seqlen",
                 "gptq_smooth": "--smooth", "head_bits": "--head-bits"}
HEAD_BITS = (4, 8)  # the head of the 4-bit schemes: GPTQ's 4-bit codes, or 8 bits per channel


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
    quantized: str | None = None  # a `cpu-quant gptq --positive-scales` artifact (4-bit schemes)
    gptq_samples: int = 128  # the GPTQ run made here when `quantized` is None
    gptq_seqlen: int = 512
    # the GPTQ run folds activation smoothing into the weights first (gptq --smooth); None:
    # the scheme's default, on for 8da4w (int8 activations), off for 16a4w (16-bit ones)
    gptq_smooth: bool | None = None
    # the head of the 4-bit schemes: 4 (GPTQ codes, like every other linear) or 8 (left out of
    # the GPTQ run and stored at 8 bits per output channel by the weighted search: with
    # 8da4w's int8 activations, the 8da8w output layer of ExecuTorch's Llama-3.2 recipe)
    head_bits: int = 4
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
        if self.quantized is not None and scheme not in FOUR_BIT_SCHEMES:
            raise CpuQuantError(f"--quantized gives the 4-bit codes of {' and '.join(FOUR_BIT_SCHEMES)}; "
                                f"--scheme {scheme} does not take them")
        if self.gptq_smooth and not self.runs_gptq:
            raise CpuQuantError("--smooth applies to the GPTQ run of 8da4w and 16a4w "
                                "without --quantized (an artifact brings its own folds)")
        if self.head_bits not in HEAD_BITS:
            raise CpuQuantError(f"--head-bits must be 4 or 8, got {self.head_bits}")
        if self.head_bits != 4 and not self.runs_gptq:
            raise CpuQuantError(
                "--head-bits applies to the GPTQ run of 8da4w and 16a4w without --quantized "
                "(an artifact brings its own head: quantize it with --no-lm-head for an 8-bit "
                "one)" if self.quantized is not None else
                f"--head-bits applies to {' and '.join(FOUR_BIT_SCHEMES)}; --scheme "
                f"{self.resolved_scheme} stores the head like its other linears")
        if self.quantized is not None and not Path(self.quantized).is_dir():
            raise CpuQuantError(f"--quantized {self.quantized}: not a directory")
        if self.group_size not in PHONE_GROUPS:
            raise CpuQuantError(f"--group must be one of {', '.join(map(str, PHONE_GROUPS))}, "
                                f"got {self.group_size}")
        for name, least in (("prefill_len", 1), ("calib_len", 1), ("verify_len", 1),
                            ("verify_windows", 1), ("gen_tokens", 1), ("calib_samples", 0),
                            ("calib_decode_tokens", 0), ("gptq_samples", 1), ("gptq_seqlen", 2)):
            if getattr(self, name) < least:
                raise CpuQuantError(f"{SETTING_NAMES.get(name, 'PhoneExportSettings.' + name)} "
                                    f"must be >= {least}, got {getattr(self, name)}")

    @property
    def runs_gptq(self) -> bool:
        """Whether the export makes its own GPTQ run (a 4-bit scheme without --quantized)."""
        return self.resolved_scheme in FOUR_BIT_SCHEMES and self.quantized is None

    @property
    def smooths(self) -> bool:
        """Whether the export's GPTQ run folds activation smoothing (``gptq_smooth`` resolved)."""
        if self.gptq_smooth is not None:
            return self.gptq_smooth and self.runs_gptq
        return self.runs_gptq and self.resolved_scheme == "8da4w"

    def gptq_settings(self):
        """The GPTQ run that gives the 4-bit schemes their codes: the phone's grid (symmetric,
        positive scales), ``group_size``, the head quantized, calibrated on ``calib``."""
        from ..quantize.settings import QuantSettings

        # QNN's 16a4w stores one scale per output channel (its blockwise variant re-rounds the
        # block scales to 4-bit multiples of a channel scale, which would not keep ours)
        group = -1 if self.resolved_scheme == "16a4w" else self.group_size
        return QuantSettings(method="gptq", group_size=group, positive_scales=True,
                             calib=self.calib, samples=self.gptq_samples,
                             seqlen=self.gptq_seqlen, smooth=self.smooths,
                             quantize_head=self.head_bits == 4)

    def shape(self, model: StaticCausalLM) -> GraphShape:
        s = model.spec
        return GraphShape(s.n_layers, s.n_kv_heads, s.head_dim, s.vocab_size, self.max_seq_len,
                          min(self.prefill_len, self.max_seq_len))


@dataclass
class Quantized:
    """The quantized programs (not yet lowered). Their eager graphs (:func:`eager_graphs`)
    are made where they are run and dropped after: they hold every method's weights folded to
    float32, several times the program's size, which the lowering must not carry."""

    programs: dict  # method -> ExportedProgram
    calibration: dict
    extra_files: dict[str, str] = field(default_factory=dict)  # next to model.pte: name -> what


@dataclass
class Built:
    """A lowered program with the quantized programs it must agree with."""

    manager: object  # ExecutorchProgramManager
    programs: dict  # method -> the quantized ExportedProgram the lowering took
    calibration: dict
    extra_files: dict[str, str]  # written next to model.pte: name -> what it is
    # QNN's: "htp", or "not-done" without the SDK; its programs are saved as qnn_<method>.pt2
    qnn_lowering: str | None = None


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
    on every call (checked bitwise on 8da8w), and it makes the reference ~20x faster.

    Memory: each program is folded from a copy of its graph that shares the program's tensors
    (the folding makes new ones, it changes none), and a folded weight equal to one an earlier
    method folded is that one (:func:`_hold_once`): the methods are one model's weights, so
    every method's folded float32 weights are held once (at 1B, 5 GB per method otherwise)."""
    from executorch.exir.passes.constant_prop_pass import constant_prop_pass

    held: dict[tuple, list[torch.Tensor]] = {}
    graphs = {}
    for name, ep in programs.items():
        own = {id(t): t for t in (*ep.state_dict.values(), *ep.constants.values())
               if isinstance(t, torch.Tensor)}
        graphs[name] = constant_prop_pass(copy.deepcopy(ep, own)).module()
        _hold_once(graphs[name], held)
    return graphs


SHARED_MIN_ELEMENTS = 1 << 12  # folded constants smaller than this are not looked up


def _hold_once(module: torch.nn.Module, held: dict[tuple, list[torch.Tensor]]) -> None:
    """Each folded constant of ``module`` (a tensor attribute of the graph) equal, bit for bit,
    to one in ``held`` is replaced by that one, in the graph's attributes and its fake values
    (the only holders of a folded constant once the folding's program copy is gone); the others
    are added to ``held``. Looked up by shape, dtype, strides and about 64 of its values,
    then compared whole."""
    for node in module.graph.nodes:
        if node.op != "get_attr":
            continue
        path, _, attr = node.target.rpartition(".")
        owner = module.get_submodule(path) if path else module
        tensor = owner.__dict__.get(attr)  # folded constants are plain attributes
        if not isinstance(tensor, torch.Tensor) or tensor.numel() < SHARED_MIN_ELEMENTS:
            continue
        rows = tensor[::max(1, tensor.shape[0] // 8)]  # a view; its copy below is 8 rows at most
        probe = rows.reshape(-1)
        key = (tuple(tensor.shape), tensor.dtype, tensor.stride(),
               tuple(probe[::max(1, probe.numel() // 64)].tolist()))
        same = held.setdefault(key, [])
        match = next((h for h in same if h is tensor or torch.equal(h, tensor)), None)
        if match is None:
            same.append(tensor)
        elif match is not tensor:
            setattr(owner, attr, match)
            fake = node.meta.get("val")  # the graph's fake value holds the real one it stands for
            if getattr(fake, "constant", None) is tensor:
                fake.constant = match


def quantize_xnnpack(model: StaticCausalLM, shape: GraphShape, settings: PhoneExportSettings,
                     weights: phone_weights.PhoneWeights | None, calibration: dict) -> Quantized:
    use_mean4d_norms(model)
    if weights is not None:
        xnnpack.quantize_for_xnnpack(model, weights, settings.resolved_scheme)
    programs = export_methods({name: model for name in shape.methods()}, shape)
    return Quantized(programs, calibration)


def lower_xnnpack(q: Quantized) -> Built:
    return Built(xnnpack.lower_to_xnnpack(q.programs), q.programs, q.calibration, q.extra_files)


def quantize_qnn(model: StaticCausalLM, shape: GraphShape, settings: PhoneExportSettings,
                 calib_windows: list[list[int]], weights: phone_weights.PhoneWeights | None,
                 progress: bool) -> Quantized:
    from tqdm import tqdm

    if weights is not None:  # the activation observers then see what the program computes
        modules = dict(model.named_modules())
        for name, lw in weights.linears.items():
            modules[name].weight.data = lw.dequantize()
    prepared = qnn.prepare(model, shape, settings.resolved_scheme)
    bar = tqdm(total=len(calib_windows), desc="calibrating", unit="sample", disable=not progress)
    stats = qnn.calibrate(prepared, shape, calib_windows, settings.calib_decode_tokens,
                          progress=bar.update)
    bar.close()
    converted = qnn.convert(prepared)
    if weights is not None:
        for graph in converted.values():
            qnn.put_weights(graph, weights)
    programs = export_methods(converted, shape)
    calibration = {"source": settings.calib or "austen (built-in calibration split)",
                   **asdict(stats)}
    if not calib_windows:
        calibration["source"] = None
        calibration["note"] = "uncalibrated: activation ranges come from the trace input only"
    state = "calibrated" if calib_windows else "UNCALIBRATED"
    extra = {f"qnn_{name}.pt2": f"{state} quantized program (torch.export) for QNN lowering"
             for name in programs}
    return Quantized(programs, calibration, extra)


def lower_qnn(q: Quantized, shape: GraphShape, settings: PhoneExportSettings) -> Built:
    if qnn.qnn_sdk_root() is not None:
        manager = qnn.lower_to_qnn(q.programs, shape, settings.soc)
        lowering = "htp"
    else:
        manager = qnn.lower_to_portable(q.programs)
        lowering = "not-done"
    return Built(manager, q.programs, q.calibration, q.extra_files, lowering)


def heldout_windows(tok, settings: PhoneExportSettings) -> list[list[int]]:
    from ..data.corpus import builtin_split, token_windows

    length = min(settings.verify_len, settings.max_seq_len)
    return token_windows(tok, builtin_split("heldout"), settings.verify_windows, length, cache=True)


def calibration_windows(tok, settings: PhoneExportSettings, texts: list[str]
                        ) -> list[list[int]]:
    """``settings.calib_samples`` windows of the calibration ``texts``: they calibrate QNN's
    activation observers and measure the importance of the 8-bit weights' input channels."""
    if settings.calib_samples == 0:
        return []
    length = min(settings.calib_len, settings.max_seq_len)
    return _windows(Calibration("calibration", tuple(texts)), tok, settings.calib_samples,
                    length, f"min(128, --max-seq-len) = {length}")


def gptq_windows(tok, settings: PhoneExportSettings) -> list[list[int]]:
    """The windows the export's own GPTQ run calibrates on (as ``cpu-quant gptq`` picks them:
    without ``--calib``, its default, the calibration mix)."""
    if not settings.runs_gptq:
        return []
    return _windows(load_calibration(settings.calib), tok, settings.gptq_samples,
                    settings.gptq_seqlen, f"--seqlen {settings.gptq_seqlen}")


def _windows(calibration: Calibration, tok, samples: int, length: int, what: str
             ) -> list[list[int]]:
    try:
        return calibration.windows(tok, samples, length)
    except CpuQuantError as exc:  # phrased in the quantize commands' flags; restate in ours
        if "too short" not in str(exc):
            raise
        raise CpuQuantError(f"the calibration text is too short for one window of {length} "
                            f"tokens ({what})") from None


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
    ckpt = open_checkpoint(src)  # its headers and index, before minutes of work
    check_float_weights(ckpt)
    check_config_sizes(ckpt)  # before a graph of the config's sizes is built
    ckpt.close()
    # a bad --calib file, before the tokenizer loads (a missing one is an error even at 0)
    calib_texts = (load_texts(settings.calib, "calibration")
                   if settings.resolved_scheme != "fp32" or settings.runs_gptq else [])
    tok = load_tokenizer(src)
    calib_windows = (calibration_windows(tok, settings, calib_texts)
                     if settings.resolved_scheme != "fp32" else [])
    heldout = heldout_windows(tok, settings)
    check_no_overlap(calib_windows + gptq_windows(tok, settings), heldout)
    prompt_texts, prompts = _prompts(tok, settings)
    if settings.quantized is not None:
        phone_weights.check_same_source(settings.quantized, src)

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


def gptq_command(settings: PhoneExportSettings) -> list[str]:
    """The ``cpu-quant gptq`` command that writes the codes the 4-bit schemes take (at this
    process's thread count), for the report: the run below is that command's library call."""
    gptq = settings.gptq_settings()
    argv = ["cpu-quant", "gptq", "SRC", "OUT", "--group", str(gptq.group_size),
            "--samples", str(gptq.samples), "--seqlen", str(gptq.seqlen),
            "--threads", str(torch.get_num_threads()), "--no-eval"]
    if gptq.positive_scales:
        argv.append("--positive-scales")
    argv.append("--smooth" if gptq.smooth else "--no-smooth")  # not the command's default
    if not gptq.quantize_head:
        argv.append("--no-lm-head")
    if gptq.calib is not None:
        argv += ["--calib", str(gptq.calib)]
    return argv


def run_gptq(src: Path, target: Path, gptq, threads: int, progress: bool, result,
             parent: int) -> None:
    """The export's GPTQ run, in the process :func:`gptq_codes` spawns for it; sends None, or
    the error that stopped it, through the pipe end ``result``. It dies with ``parent``, the
    exporting process, however that ends (a killed export leaves no run computing on)."""
    from ..core.process import die_with
    from ..quantize.pipeline import quantize_checkpoint

    die_with(parent)
    torch.set_num_threads(threads)
    try:
        quantize_checkpoint(src, target, gptq, progress=progress)
    except (CpuQuantError, KeyboardInterrupt) as exc:
        result.send(exc if isinstance(exc, CpuQuantError) else Interrupted("interrupted"))
    else:
        result.send(None)


def gptq_codes(src: Path, settings: PhoneExportSettings, staged: StagedOutput, progress: bool
               ) -> tuple[dict, dict, dict | None]:
    """The 4-bit results (by static-graph name), where they came from, and the run's smoothing
    factors (None unless it folded smoothing, ``gptq --smooth``): ``--quantized``, or a GPTQ
    run made here into the staging directory, removed once read.

    The run is the quantizer's library call (``quantize_checkpoint`` with
    ``settings.gptq_settings()``, the call :func:`gptq_command` makes) in a fresh process,
    spawned, with this process's thread count: its codes are those of ``cpu-quant gptq`` with
    the same settings. In the exporting process they would not be, after an earlier lowering
    there (10 of a tiny Llama's 15 linears got other codes). Its peak memory, the source's
    layers and their Hessians, goes back to the system when it ends."""
    import shutil
    from multiprocessing import get_context

    if settings.quantized is not None:
        results, qcfg = phone_weights.read_group_quants(settings.quantized)
        return results, {"origin": "gptq", "quantized": str(Path(settings.quantized).resolve()),
                         "quantization_config": qcfg}, load_factors(settings.quantized)
    target = staged.path(".gptq")
    spawn = get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    proc = spawn.Process(target=run_gptq, args=(src, target, settings.gptq_settings(),
                                                torch.get_num_threads(), progress, send,
                                                os.getpid()))
    proc.start()
    send.close()
    try:
        error = receive.recv()
    except EOFError:  # it died without a word (killed, out of memory)
        proc.join()
        error = CpuQuantError(f"it ended with exit code {proc.exitcode} and no result")
    except KeyboardInterrupt:  # export-phone keeps nothing of a stopped run
        proc.terminate()
        raise
    finally:
        proc.join()
    if isinstance(error, Interrupted):
        raise KeyboardInterrupt
    if error is not None:
        raise CpuQuantError(f"the GPTQ run for the 4-bit codes failed: {error}")
    try:
        results, qcfg = phone_weights.read_group_quants(target)
        factors = load_factors(target)
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return results, {"origin": "gptq", "quantized": None,
                     "gptq_run": asdict(settings.gptq_settings()),
                     "command": gptq_command(settings), "quantization_config": qcfg}, factors


def decide_weights(src: Path, model: StaticCausalLM, shape: GraphShape,
                   settings: PhoneExportSettings, calib_windows: list[list[int]],
                   codes: tuple[dict, dict, dict | None] | None
                   ) -> phone_weights.PhoneWeights | None:
    """The integer weights of the XNNPACK schemes (``weights``); None for fp32 and for QNN's
    w8a16, whose weights QNN's quantizer rounds. ``codes``: :func:`gptq_codes`' result for the
    4-bit schemes."""
    scheme = settings.resolved_scheme
    if scheme in ("fp32", "w8a16"):
        return None

    def run_calibration() -> None:
        runner = StaticKVRunner(shape, model, model)
        for window in calib_windows:
            runner.score(window)

    results, source, factors = codes if codes is not None else (None, None, None)
    if factors is not None:  # codes of the folded weights: the graph takes the folded norms
        source["smoothing"] = {"folded_tensors": phone_weights.fold_smoothing(model, src, factors)}
    # --calib-samples 0: no statistics, so uniform importance and no smoothing. The 4-bit
    # schemes use them only for a linear the GPTQ result lacks (its 8-bit fallback).
    needs_stats = scheme not in FOUR_BIT_SCHEMES or any(
        name not in results for name in phone_weights.linear_modules(model))
    stats = (phone_weights.activation_stats(model, run_calibration)
             if calib_windows and needs_stats else {})
    if scheme == "8da8w" and stats:
        # its int8 activations gain from the range moved into the 8-bit weights
        stats = smooth_static_lm(model, stats, SMOOTHING_ALPHA)
    if scheme in ("8da8w", xnnpack.WEIGHT_ONLY_SCHEME):
        weights = phone_weights.weights_8bit(model, phone_weights.importance(stats))
        if scheme == "8da8w":
            weights.source["smoothing_alpha"] = SMOOTHING_ALPHA if stats else None
        return weights
    importance = phone_weights.importance(stats)
    reasons = ({"lm_head": "--head-bits 8: left out of the GPTQ run"}
               if settings.runs_gptq and settings.head_bits == 8 else {})
    weights = phone_weights.weights_from_gptq(model, results, importance, source, reasons)
    weights.source["needs_importance"] = needs_stats  # some linear takes 8-bit weights
    if scheme == "16a4w":
        grouped = [n for n, w in weights.linears.items() if w.bits == 4 and not w.per_channel]
        if grouped:
            raise CpuQuantError(f"16a4w stores one scale per output channel, but {grouped[0]} "
                                f"has groups of {weights.linears[grouped[0]].group} (quantize "
                                "with `cpu-quant gptq --group -1 --positive-scales`)")
    return weights


def _build_verify_write(src: Path, staged: StagedOutput, settings: PhoneExportSettings, tok,
                        calib_windows: list[list[int]], heldout: list[list[int]],
                        prompt_texts: list[str], prompts: list[list[int]],
                        timings: dict[str, float], t0: float, progress: bool) -> dict:
    from tqdm import tqdm

    scheme = settings.resolved_scheme
    t = time.perf_counter()
    codes = gptq_codes(src, settings, staged, progress) if scheme in FOUR_BIT_SCHEMES else None
    gptq_seconds = time.perf_counter() - t
    model = load_static_lm(src, settings.max_seq_len)
    shape = settings.shape(model)
    fp32_bytes = float32_bytes(model)
    timings["load"] = time.perf_counter() - t0 - gptq_seconds

    t = time.perf_counter()
    # everything the float model is compared on, before anything changes it (smoothing's folds,
    # the quantization in place): no second float copy is held through the lowering, whose
    # peak it would raise by the float model's size (6 GB for a 1B model)
    float_scores = score_heldout(shape, (model, model), heldout)
    float_runner = StaticKVRunner(shape, model, model)
    float_greedy = [float_runner.generate(p, settings.gen_tokens, tok.eos_token_id)[0]
                    for p in prompts]
    del float_runner
    weights = decide_weights(src, model, shape, settings, calib_windows, codes)
    del codes  # the weights hold what the program takes
    timings["weights"] = time.perf_counter() - t + gptq_seconds

    t = time.perf_counter()
    if settings.backend == "qnn":
        quantized = quantize_qnn(model, shape, settings, calib_windows, weights, progress)
    else:
        quantized = quantize_xnnpack(model, shape, settings, weights,
                                     _calibration_record(settings, calib_windows, weights))
    eager = eager_graphs(quantized.programs)
    quantized_scores = score_heldout(shape, shape.step_pair(eager), heldout)
    # the methods' weights folded to float32 (5 GB at 1B): not carried through the lowering,
    # whose own copies they would add to; made again for the verification. Graph modules are
    # held in reference cycles, which only a collection frees (a 1B export was killed in the
    # lowering with them still held)
    del eager
    gc.collect()
    failures = screen(scheme, quantized_scores, float_scores)
    if failures:
        raise VerificationFailed("the quantized model falls below the " + scheme + " floors "
                                 "against the float model (" + "; ".join(failures)
                                 + "), before lowering: a quantization fault; nothing was written")
    timings["quantize"] = time.perf_counter() - t

    t = time.perf_counter()
    built = lower_qnn(quantized, shape, settings) if settings.backend == "qnn" \
        else lower_xnnpack(quantized)
    timings["lower"] = time.perf_counter() - t

    t = time.perf_counter()
    pte = staged.path("model.pte")
    with open(pte, "wb") as fh:
        built.manager.write_to_file(fh)
    if built.qnn_lowering is not None:
        qnn.save_programs(built.programs, staged.staging)
    tokenizer_files = staged.copy_tokenizer_files(src)
    timings["write"] = time.perf_counter() - t

    t = time.perf_counter()
    stored = check_stored_weights(settings, pte, built, weights)
    arms = {"pte": pte_step_functions(pte, shape),
            "quantized": shape.step_pair(eager_graphs(built.programs))}
    bar = tqdm(total=len(heldout) + len(prompts), desc="verifying", disable=not progress)
    result = verify(scheme, shape, arms, heldout, prompts, prompt_texts, settings.gen_tokens,
                    tok.decode, tok.eos_token_id, progress=bar.update,
                    scored={"float": float_scores, "quantized": quantized_scores},
                    float_greedy=float_greedy)
    bar.close()
    timings["verify"] = time.perf_counter() - t
    if not result.passed:
        raise VerificationFailed(result.message())

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
        "scheme": scheme,
        "settings": {**asdict(settings), "gptq_smooth": settings.smooths},  # resolved
        "graph": asdict(shape),
        "produced": produced,
        "sizes": {"pte_bytes": produced["model.pte"]["bytes"], "float32_bytes": fp32_bytes,
                  "ratio_vs_float32": round(produced["model.pte"]["bytes"] / fp32_bytes, 4)},
        "ops": count_ops(built.manager),
        "weights": weights.summary() if weights is not None else None,
        "stored_weights": stored,
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


def _calibration_record(settings: PhoneExportSettings, calib_windows: list[list[int]],
                        weights: phone_weights.PhoneWeights | None) -> dict:
    if weights is None:
        return {"source": None, "samples": 0, "prefill_tokens": 0, "decode_tokens": 0,
                "note": "nothing calibrated: float weights"}
    source = settings.calib or "austen (built-in calibration split)"
    if not weights.source.get("needs_importance", True):
        return {"source": source, "samples": 0, "prefill_tokens": 0, "decode_tokens": 0,
                "note": "every linear holds the GPTQ run's codes, so no 8-bit scale search "
                        "and no activation statistics; XNNPACK quantizes activations per "
                        "token at run time"}
    return {"source": source,
            "samples": len(calib_windows), "prefill_tokens": sum(map(len, calib_windows)),
            "decode_tokens": 0,
            "note": "the windows measure the input-channel importance of the weights' scale "
                    "search (and calibrate the GPTQ run, if one was made); XNNPACK quantizes "
                    "activations per token at run time"}


def check_stored_weights(settings: PhoneExportSettings, pte: Path, built: Built,
                         weights: phone_weights.PhoneWeights | None) -> dict | None:
    """Read the XNNPACK program's integer weights back from ``pte`` and require every linear's
    decided codes and scales among them, bit for bit (``readback``)."""
    if settings.backend != "xnnpack" or weights is None:
        return None
    stored = readback.xnnpack_weights(pte)
    missing = readback.unmatched(weights, stored)
    if missing:
        raise VerificationFailed(f"model.pte does not hold the decided integer weights of "
                                 f"{len(missing)} linears (first: {missing[0]}); nothing was "
                                 "written")
    return {"linears": len(weights.linears), "stored_weights": len(stored),
            "equal": len(weights.linears)}


def _pte_description(settings: PhoneExportSettings, built: Built) -> str:
    scheme = settings.resolved_scheme
    if settings.backend == "xnnpack":
        return f"XNNPACK-delegated program, {scheme}"
    if built.qnn_lowering == "htp":
        return f"QNN HTP-delegated program ({settings.soc}), {scheme}"
    calibrated = "calibrated" if built.calibration["samples"] else "UNCALIBRATED"
    return (f"{scheme} {calibrated} program on ExecuTorch's portable CPU kernels (NOT lowered "
            "to the HTP: QNN_SDK_ROOT is unset)")
