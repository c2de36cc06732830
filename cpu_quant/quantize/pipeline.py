"""The quantization pipeline: checkpoint in -> plan -> per-tensor results -> formats on disk.

``quantize_checkpoint(src, dst, settings, formats)`` streams the model one decoder layer at a
time (``streaming.LayerStream``). For each layer, :class:`LayerQuantizer` collects the Hessians
of its linears' inputs (over the activations the already-quantized layers before it produced;
``hessians.py``), quantizes every linear (GPTQ or RTN, ``schedule.py``) and runs the layer again
with its quantized weights to produce the next layer's inputs; every result goes to each
requested format's sink (``formats/``), and the run's resume point is saved (``resume.py``). The
head is quantized last, with the Hessian of the final normed hidden state. Output goes through
``io.artifact.StagedOutput``: nothing appears at ``dst`` until every format is written.

Memory: after every layer the allocator's free memory is handed back, and glibc's mmap
threshold is pinned for the run (``cpu_quant.core.memory``).

A distributed run (``distributed.py``) runs this same driver on every rank; its ``Team`` gives
each rank its share of the calibration batches, sums the Hessians across the ranks in the one
process's order, shares out the GPTQ rows, and lets rank 0 alone write.
"""

from __future__ import annotations

import functools
import gc
import json
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch import nn

from ..core import smoothing_factors
from ..core.errors import CpuQuantError, Interrupted
from ..core.experts import expert_count
from ..core.io.artifact import StagedOutput, check_destination, write_json_atomic
from ..core.io.checkpoint import (
    check_config_sizes,
    check_float_weights,
    load_tokenizer,
    model_context,
    open_checkpoint,
)
from ..core.memory import (
    MMAP_THRESHOLD,
    MMAP_THRESHOLD_LOW,
    env_mmap_threshold,
    pin_mmap_threshold,
    release_free_heap,
)
from ..core.naming import HEAD_NAME
from ..core.vision_language import family_of, refuse_vision_language
from ..data.images import image_files
from ..data.mix import Calibration, load_calibration
from ..formats import DEFAULT_FORMAT, ArtifactInfo, Format, combined_limits, get_format
from ..formats.base import Limits, SinkSet
from . import experts, smooth_fold
from .activations import ACTIVATIONS_DIR, Discard, DiskActivations, in_place, one_slab
from .clock import PhaseClock
from .distributed import NoSinks, RankLost, Team
from .experts import has_experts
from .gptq import GridSpec
from .hessians import HessianAccumulator, gram, w4a8_gram
from .image_calibration import calibration_note, image_windows
from .plan import (
    LinearPlan,
    check_group,
    check_own_grids,
    dynamic_overrides,
    embedding_plan,
    grid_format,
    head_group,
    kept_rules,
    linear_group,
    on_format_grid,
    plan_kept,
    plan_linear,
)
from .provenance import provenance
from .resume import (
    STATE_FILE,
    ResumePoint,
    RunState,
    load_state,
    remove_hidden_files,
    restore_hidden,
    run_fingerprint,
    saved_layers,
    write_resume_point,
)
from .schedule import QuantJob, quantize_linears
from .sequential import BatchStore, probe, run_true_sequential, signature
from .settings import QuantReport, QuantSettings, TensorReport
from .signals import StopRequest, kill_point
from .streaming import LayerStream, compute_dtype

CACHE_DIR = "layer-cache"  # sequential.BatchStore files within a layer (offloaded runs)


def calibration_batches(src: Path, settings: QuantSettings, calibration: Calibration,
                        ckpt=None) -> list[torch.Tensor]:
    """The calibration token windows of ``--calib`` (``data.mix.Calibration``), in batches of
    token ids; with ``--image-samples N`` (a vision-language model, ``ckpt`` its checkpoint)
    the first N windows begin with an image and are batches of input embeddings
    (``image_calibration``), spread evenly among the others."""
    tok = load_tokenizer(src)
    windows = calibration.windows(tok, settings.samples, settings.seqlen)
    n = settings.image_samples
    text = (list(torch.split(torch.tensor(windows[n:], dtype=torch.long), settings.batch_size))
            if len(windows) > n else [])
    if not n:
        return text
    embeds = image_windows(src, ckpt, windows[:n], settings.seqlen, settings.images,
                           compute_dtype())
    images = list(torch.split(torch.stack(embeds), settings.batch_size))
    order = sorted([((k + 0.5) / len(text), 0, k) for k in range(len(text))]
                   + [((j + 0.5) / len(images), 1, j) for j in range(len(images))])
    return [text[i] if kind == 0 else images[i] for _, kind, i in order]


def batch_tokens(batch: torch.Tensor) -> int:
    """The tokens of a calibration batch: token ids [B, T], or input embeddings [B, T, D]."""
    return batch.shape[0] * batch.shape[1]


def check_source(ckpt, settings: QuantSettings) -> None:
    """Refuse, before any work, a source the run cannot quantize faithfully: integer or fp8
    weights (an already-quantized or foreign checkpoint would be cast to float without a
    word), a vision-language checkpoint of a family not supported
    (``core.vision_language``), a config whose sizes its tensors contradict (before a model is
    built from it) and a calibration window longer than the model's context."""
    check_float_weights(ckpt)
    why = refuse_vision_language(ckpt.config)
    if why:
        raise CpuQuantError(why)
    check_config_sizes(ckpt)
    context = model_context(ckpt.config)
    if not settings.data_free and context is not None and settings.seqlen > context:
        raise CpuQuantError(f"--seqlen {settings.seqlen} is beyond the model's context of "
                            f"{context} tokens (max_position_embeddings)")


def check_request(formats: list[Format], settings: QuantSettings) -> Limits:
    """Refuse, before any work, settings that contradict each other and what the requested
    formats cannot hold; their shared limits. Every check of a request that needs no source:
    the command line calls it before it resolves the source and hands the limits to
    :func:`quantize_checkpoint`, which then does not check again."""
    settings.validate()
    check_own_grids(formats)
    for fmt in formats:
        why = fmt.refuse_grid(settings.symmetric)
        if why:
            raise CpuQuantError(f"--format {fmt.name}: {why}; the asymmetric grid goes only to "
                                "formats that store zeros")
    limits = combined_limits(formats)
    check_group("--group", settings.group_size, limits)
    if settings.head_group is not None:
        check_group("--head-group", settings.head_group, limits)
    if settings.down_group is not None:
        check_group("--down-group", settings.down_group, limits)
    return limits


class LayerQuantizer:
    """Quantizes the model layer by layer, handing every result to the sinks.

    It holds what every layer shares: the stream, the settings and grid, the formats' limits,
    the sinks, the run's state and the true-sequential structures found so far."""

    def __init__(self, stream: LayerStream, ckpt, settings: QuantSettings, limits: Limits,
                 sinks: SinkSet | NoSinks, state: RunState,
                 new_store: Callable[[str, list[int] | None], BatchStore],
                 team: Team | None = None) -> None:
        self.stream, self.ckpt, self.settings, self.limits = stream, ckpt, settings, limits
        self.grid = GridSpec(symmetric=settings.symmetric, scale_search=settings.scale_search,
                             positive_scales=settings.positive_scales)
        self.sinks, self.state, self.new_store = sinks, state, new_store
        self.team = team or Team()
        self.clock = PhaseClock(state.phase_seconds)  # clock.py: exclusive time per phase
        # the Hessians' product: of the activations as they are, or as the W4A8 kernel sees them
        self.product = self.clock.timed("hessians", w4a8_gram if settings.w4a8_hessians else gram)
        self.structures: dict = {}  # sequential.signature -> Structure or None
        self.add_module = self.clock.timed("write", sinks.add_module)
        self.add_tensor = self.clock.timed("write", sinks.add_tensor)

    def _quantize(self, linears: dict[str, nn.Linear], plans: dict[str, LinearPlan],
                  names: list[str], hessians: dict[str, torch.Tensor | None],
                  fallbacks: dict[str, str] | None = None) -> None:
        """Quantize ``names``, hand the results to the sinks, and put the dequantized weights
        into the modules for the passes after. ``fallbacks``: the linears a GPTQ run takes by
        round-to-nearest instead, and why (``experts.fallbacks``)."""
        names = [n for n in names if plans[n].quantize]
        fallbacks = fallbacks or {}
        jobs = [QuantJob(linears[n].weight.data, plans[n], hessians.get(n), fallbacks.get(n))
                for n in names]
        results = quantize_linears(jobs, self.settings, self.grid, self.team.rows)
        for name, (gq, trep) in zip(names, results, strict=True):
            self.state.tensors.append(asdict(trep))
            self.state.account(gq, self.add_module(name, gq))
            linears[name].weight.data = gq.dequantize().to(linears[name].weight.dtype)

    def _quantize_alone(self, weight: torch.Tensor, plan: LinearPlan,
                        hessian: torch.Tensor | None) -> None:
        """Quantize one tensor outside the layers (the head, an embedding on its format's
        grid) and hand it to the sinks under its module name."""
        with self.clock.phase("quantize"):
            [(gq, trep)] = quantize_linears([QuantJob(weight, plan, hessian)], self.settings,
                                            self.grid, self.team.rows)
        self.state.tensors.append(asdict(trep))
        self.state.account(gq, self.add_module(plan.name, gq))

    def layer(self, i: int, plans: dict[str, LinearPlan], hidden) -> Iterable[torch.Tensor] | None:
        """Quantize layer ``i``; its outputs (lazily; None without calibration).

        True-sequential (``sequential.py``) where the layer's structure allows it; otherwise two
        passes: Hessians from the original weights, every linear quantized, then the forward."""
        stream = self.stream
        linears = stream.linears(i)
        prefix = f"{stream.layers_prefix}.{i}."
        quantize = self.clock.timed("quantize", functools.partial(self._quantize, linears, plans))
        call = self.clock.timed("forward", stream.call_layer)
        layer = stream.layers[i]
        structure = None
        # a mixture-of-experts layer calls each expert on its routed tokens only, and its MLP's
        # output is not its last linear's: two passes (sequential.py's blocks do not apply)
        if hidden and not has_experts(layer):
            key = signature(layer)
            if key not in self.structures:  # rank 0's probe (of the first batch) decides
                first = next(iter(hidden))
                found = probe(layer, lambda: call(i, 0, first)) if self.team.writer else None
                self.structures[key] = self.team.from_writer(found)
            structure = self.structures[key]
        if structure is not None:
            self.state.true_sequential_layers += 1

            def quantize_group(rel: tuple[str, ...], hessian: torch.Tensor) -> None:
                quantize([prefix + n for n in rel], {prefix + n: hessian for n in rel})

            outputs = run_true_sequential(layer, structure, hidden,
                                          lambda b, h: call(i, b, h),
                                          quantize_group, self.new_store,
                                          self.product, self.team.new_sum)
        else:
            acc = HessianAccumulator({n: m for n, m in linears.items() if plans[n].quantize},
                                     self.team.new_sum, self.product)
            try:
                with self.clock.phase("forward"):
                    stream.observe_layer(i, hidden, acc.begin_batch, acc.end_batch)
            finally:
                acc.close()
            hessians = {n: acc.hessian(n) for n in acc.h}
            # per-expert token counts (and GPTQ's fallbacks) for the report; none for a dense
            # layer, every count 0 without calibration
            fallbacks, record = experts.fallbacks(
                linears, acc.count, gptq=self.settings.method == "gptq",
                min_tokens=self.settings.expert_min_tokens)
            self.state.experts.update(record)
            quantize(list(linears), {n: h for n, h in hessians.items() if h is not None},
                     fallbacks)
            outputs = (self.clock.timed_iter("forward", stream.forward_layer(i, hidden))
                       if hidden else None)
        # the report lists a layer's tensors in module order, whatever order they were quantized in
        order = {n: k for k, n in enumerate(linears)}
        done = len([n for n in linears if plans[n].quantize])
        tensors = self.state.tensors
        tensors[-done:] = sorted(tensors[-done:], key=lambda t: order[t["name"]]) if done else []
        quantized_params = {f"{n}.weight" for n, p in plans.items() if p.quantize}
        for pname in stream.layer_param_names(i):
            if pname not in quantized_params:
                self.add_tensor(pname, self.ckpt.tensor(pname).to(torch.bfloat16))
        return outputs

    def outer(self, hidden: list[torch.Tensor], head_plan: LinearPlan,
              embed_plan: LinearPlan) -> None:
        """Embedding (bf16, or on its format's grid) and norms (bf16), and the output head,
        quantized with the Hessian of the final normed hidden state."""
        stream, ckpt = self.stream, self.ckpt
        prefix = stream.layers_prefix + "."
        embed_weight = embed_plan.name + ".weight" if embed_plan.quantize else None
        for name in ckpt.names:
            if name.startswith(prefix) or name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
                continue
            if name == embed_weight:
                self._quantize_alone(ckpt.tensor(name, check_finite=True), embed_plan, None)
                continue
            self.add_tensor(name, ckpt.tensor(name).to(torch.bfloat16))
        if isinstance(ckpt, smoothing_factors.SmoothedCheckpoint) and head_plan.quantize:
            head_w = ckpt.head_tensor(stream.head_weight_name(), smoothing_factors.HEAD, check_finite=True)
        else:
            head_w = ckpt.tensor(stream.head_weight_name(), check_finite=True)
        hidden_size = head_w.shape[1]
        if head_plan.quantize:
            hess = None
            if hidden:
                norm = stream.final_norm()
                acc_h = self.team.new_sum(hidden_size)
                with torch.no_grad():
                    for h in hidden:
                        x = norm(h).reshape(-1, hidden_size)
                        acc_h.add(self.product(x), x.shape[0])
                hess = acc_h.hessian()
            kill_point("head")
            self._quantize_alone(head_w, head_plan, hess)
        elif "lm_head.weight" in ckpt.names:
            self.add_tensor("lm_head.weight", head_w.to(torch.bfloat16))


def plan_model(stream: LayerStream, settings: QuantSettings, limits: Limits,
               formats: list[Format] | None = None
               ) -> tuple[list[dict[str, LinearPlan]], LinearPlan, LinearPlan]:
    """Every linear's plan (per layer), the head's and the embedding's, from the shapes
    alone: a group the formats refuse (``--strict-group``) is refused before any work, not
    after the layers; a format with grids of its own gives each tensor its grid."""
    own = grid_format(formats or [])
    cfg, calibrated = stream.ckpt.config, not settings.data_free

    def plan(name: str, m) -> LinearPlan:
        group, flag = linear_group(name, settings, limits)
        return on_format_grid(plan_linear(name, m.in_features, m.out_features, group,
                                          settings.strict_group, limits, flag=flag),
                              own, cfg, calibrated)

    layers = [{name: plan(name, m) for name, m in stream.linears(i).items()}
              for i in range(stream.n_layers)]
    vocab, hidden_size = stream.ckpt.shape(stream.head_weight_name())
    group, flag = head_group(settings, hidden_size, limits)
    head = on_format_grid(plan_linear(HEAD_NAME, hidden_size, vocab, group, settings.strict_group,
                                      limits, quantize=settings.quantize_head, flag=flag),
                          own, cfg, calibrated)
    embedding = embedding_plan(stream.embedding_weight_name().removesuffix(".weight"),
                               hidden_size, vocab, own, cfg, calibrated)
    if own is not None and head.quantize and own.ties_head(cfg):
        embedding = LinearPlan(embedding.name, hidden_size, vocab, False, -1,
                               "the quantized head is the embedding too (one tied tensor)")
    return layers, head, embedding


def _quantization_extra(settings: QuantSettings, version: str) -> dict:
    return {"damp_percent": settings.damp, "quantizer": ["cpu-quant", version],
            "cpu_quant": {"method": settings.method, "scale_search": settings.scale_search,
                          "positive_scales": settings.positive_scales,
                          "act_order_static_groups": settings.act_order and settings.method == "gptq"}}


@contextmanager
def _stop_reason(stopped: Callable[[str], str]) -> Iterator[None]:
    """A lost rank's message completed with where the run stopped and what it kept."""
    try:
        yield
    except RankLost as exc:
        raise RankLost(stopped(exc.cause)) from None


def quantize_checkpoint(src: str | Path, dst: str | Path, settings: QuantSettings,
                        formats: list[Format] | None = None, *, overwrite: bool = False,
                        resume: bool = False, progress: bool = True,
                        on_layer: Callable[[int, int], None] | None = None,
                        team: Team | None = None,
                        on_commit: Callable[[dict[str, str]], None] | None = None,
                        checked: Limits | None = None) -> QuantReport:
    """Quantize ``src`` into ``dst`` in every one of ``formats`` (default: GPTQ); ``team``:
    this process's rank in a distributed run (``distributed.joined``), by default alone.
    ``on_commit`` gets the outputs (format -> path) the moment DST is in place: from then on
    an interrupt leaves a complete artifact, and its caller must say so. ``checked``: what
    :func:`check_request` returned for these formats and settings, when the caller has
    checked them already (otherwise the run does)."""
    return QuantizationRun(Path(src), dst, settings, formats or [get_format(DEFAULT_FORMAT)],
                           overwrite=overwrite, resume=resume, progress=progress,
                           on_layer=on_layer, team=team or Team(), on_commit=on_commit,
                           checked=checked).run()


class QuantizationRun:
    """One ``quantize_checkpoint`` call, as named phases: :meth:`prepare` (the checks, the source
    and the plan), :meth:`calibrate`, :meth:`smooth`, then in the staging directory
    :meth:`capture` (or the resume point's activations), :meth:`layers`, :meth:`head` and
    :meth:`write`. Resume and the ranks of a distributed run are each phase's concern (the
    ``team`` and the run's ``state``)."""

    def __init__(self, src: Path, dst: str | Path, settings: QuantSettings, formats: list[Format],
                 *, overwrite: bool, resume: bool, progress: bool,
                 on_layer: Callable[[int, int], None] | None, team: Team,
                 on_commit: Callable[[dict[str, str]], None] | None,
                 checked: Limits | None = None) -> None:
        self.src, self.dst, self.settings, self.formats = src, dst, settings, formats
        self.checked = checked
        self.overwrite, self.resume, self.progress = overwrite, resume, progress
        self.on_layer, self.team, self.on_commit = on_layer, team, on_commit
        self.where = {"phase": "the calibration pass", "saved": 0}
        self.resume_point = ResumePoint()
        self.smooth_note: str | None = None
        self.smoothing: dict | None = None

    def run(self) -> QuantReport:
        self.t_start = time.perf_counter()
        try:  # Ctrl-C or SIGTERM before the staging directory exists: nothing to keep
            self.prepare()
            self.calibrate()
            # the source's digest is its files' and config's: the same before the smoothing folds
            self.fingerprint = run_fingerprint(self.ckpt, self.settings, self.layout,
                                               self.batches)
            self.check_resume()
            self.smooth()
        except KeyboardInterrupt:
            kept = "; the interrupted run is kept for --resume" if self.resume else ""
            raise Interrupted("interrupted while reading the source and the calibration text; "
                              f"nothing was saved{kept}") from None
        self.start_report()
        self.staged = StagedOutput(self.dst, overwrite=self.overwrite, resume=self.resume,
                                   sources=[self.src], keep_on_interrupt=True)
        self.scratch = self.team.scratch(CACHE_DIR)
        self.out_staging = self.staged.staging
        with (self.team.enter(self.staged) as out, StopRequest(self.interrupted) as stop,
              self.resume_point, _stop_reason(self.stopped)):
            self.out, self.stop = out, stop
            self.capture()
            self.layers()
            self.head()
            self.write()
        self.ckpt.close()
        if self.team.writer:
            self.report.provenance["output"] = str(self.final)
            self.report.outputs = {name: str(self.final / d.relative_to(self.out.staging))
                                   for name, d in self.sinks.directories.items()}
        return self.report

    # -- before the staging directory -------------------------------------------------------
    def prepare(self) -> None:
        """Every check that can fail before work, the source opened and every linear planned."""
        settings = self.settings
        self.limits = self.checked or check_request(self.formats, settings)
        check_own_grids(self.formats, self.team.world_size)
        self.layout = ",".join(f.name for f in self.formats)
        check_destination(self.dst, [self.src], self.overwrite)  # fail before any work
        # see MMAP_THRESHOLD: the low pin only where the user traded time for memory
        self.threshold = MMAP_THRESHOLD_LOW if settings.offload_activations else MMAP_THRESHOLD
        self.mmap_pinned = pin_mmap_threshold(self.threshold)
        # a bad --calib file is refused before the model is read
        self.calibration = None if settings.data_free else load_calibration(settings.calib)
        if settings.image_samples:  # so is a --images directory without images
            image_files(settings.images)
        ckpt = open_checkpoint(self.src)
        for fmt in self.formats:
            why = fmt.refuse_source(ckpt.config) or fmt.refuse_source_files(self.src,
                                                                               ckpt.config)
            if why:
                ckpt.close()
                raise CpuQuantError(f"--format {fmt.name}: {why}")
        check_source(ckpt, settings)
        if self.team.world_size > 1 and expert_count(ckpt.config):
            # each rank's Hessian sums are made when an expert first sees a token, and the
            # ranks' batches route differently: their summing collectives would not pair up
            ckpt.close()
            raise CpuQuantError("a mixture-of-experts model is quantized by one process: run "
                                "without --nproc or torchrun")
        if settings.smooth is None:  # the default: fold where it applies, say why not
            smooth, self.smooth_note = smooth_fold.default_smoothing(ckpt.config, settings)
            self.settings = settings = replace(settings, smooth=smooth)
        if settings.smooth and (why := smooth_fold.refuse(ckpt.config)):
            ckpt.close()
            raise CpuQuantError(why)
        self.ckpt = ckpt
        self.stream = LayerStream(ckpt)
        self.layer_plans, self.head_plan, self.embed_plan = plan_model(
            self.stream, settings, self.limits, self.formats)
        # a format writing the quantized head as the embedding too: no fold into the head
        self.head_tied = any(f.ties_head(ckpt.config) for f in self.formats)
        family = family_of(ckpt.config)
        if settings.image_samples and family is None:
            ckpt.close()
            raise CpuQuantError("--image-samples applies to vision-language models only; "
                                f"{self.src} has no vision tower")
        self.kept = plan_kept(family, {n: ckpt.shape(n) for n in ckpt.names})
        self.vision_language = None if family is None else {
            "family": family.name, "calibration": calibration_note(settings),
            "kept": [asdict(k) for k in self.kept]}

    def calibrate(self) -> None:
        t_calib = time.perf_counter()
        self.batches = ([] if self.settings.data_free
                        else calibration_batches(self.src, self.settings, self.calibration,
                                                 self.ckpt))
        self.calib_seconds = time.perf_counter() - t_calib

    def check_resume(self) -> None:
        """A resume of another run, or of a state that is missing or damaged, is refused here,
        before the smoothing pass (minutes at 8B), with the line the resume itself would give;
        every rank raises rank 0's refusal."""
        if not self.resume:
            return
        why = None
        if self.team.writer:
            staged = StagedOutput(self.dst, resume=True)  # its paths only: nothing is touched
            try:
                if not staged.staging.is_dir():
                    raise CpuQuantError(f"nothing to resume: no interrupted run at {staged.staging}")
                load_state(staged, self.fingerprint, self.stream.n_layers)
            except CpuQuantError as e:
                why = str(e)
        why = self.team.from_writer(why)
        if why:
            raise CpuQuantError(why)

    def smooth(self) -> None:
        """Activation smoothing's statistics pass and choice of strengths; the source is read
        through the folds from here on."""
        if not self.settings.smooth:
            return
        t_smooth = time.perf_counter()
        head_plan = self.head_plan
        groups = {f"{p.name}.weight": p.effective_group
                  for plans in self.layer_plans for p in plans.values()}
        groups[smoothing_factors.HEAD] = head_plan.effective_group
        stats = self.batches[:smooth_fold.STATS_BATCHES]
        # the unfolded stream is not read again (a folded one replaces it below): drop it, and
        # the embedding it holds (0.5 GB at 1B, 1 GB at 8B), before the statistics pass loads
        # its own (it sits in reference cycles: collect it)
        self.stream = None
        gc.collect()
        folds, factors, choices = smooth_fold.plan_smoothing(
            LayerStream(self.ckpt), stats, groups.__getitem__,
            smoothing_factors.HEAD if head_plan.quantize and not self.head_tied else None,
            self.progress, self.team)
        self.ckpt = smoothing_factors.SmoothedCheckpoint(self.ckpt, folds, factors)
        self.stream = LayerStream(self.ckpt)
        # the statistics pass's model and the unfolded stream's sit in reference cycles: free
        # them, and the heap they left, before the quantization pass allocates its own
        gc.collect()
        release_free_heap()
        self.smoothing = smooth_fold.summary(choices, stats, time.perf_counter() - t_smooth)

    def start_report(self) -> None:
        """The report's first fields; the ranks agree on the run and take their batches."""
        report = QuantReport(settings=asdict(self.settings), layout=self.layout,
                             provenance=provenance(self.src))
        report.provenance["malloc_mmap_threshold"] = (self.threshold if self.mmap_pinned
                                                      else env_mmap_threshold())
        report.calibration_tokens = sum(batch_tokens(b) for b in self.batches)
        report.smoothing = self.smoothing
        self.report = report
        self.team.agree_on_run(self.fingerprint)
        self.team.check_batches(len(self.batches))
        self.shard = self.team.shard(len(self.batches))  # this rank's batches
        self.batches = self.batches[self.shard.start:self.shard.stop]

    # -- the stop messages ----------------------------------------------------------------------
    def stopped(self, why: str) -> str:
        """The stop message; the staging directory is kept when it holds a resume point."""
        self.resume_point.settle()  # what is on disk, once the write in flight has ended
        # another rank than 0 reads what rank 0 wrote (it may have died before writing)
        saved = self.where["saved"] if self.team.writer else saved_layers(self.out_staging)
        n = self.stream.n_layers
        if not saved and not self.resume:
            return f"{why} during {self.where['phase']}; no layer was finished, nothing was saved"
        self.staged.keep_on_exit = True
        layers = f"layers 1-{saved} of {n} are" if saved != 1 else f"layer 1 of {n} is"
        return (f"{why} during {self.where['phase']}; {layers} saved in {self.staged.staging}: "
                "run the same command with --resume to continue")

    def interrupted(self) -> str:
        return self.stopped(self.team.trouble() or self.team.cause or "interrupted")

    # -- in the staging directory ---------------------------------------------------------------
    def capture(self) -> None:
        """The run's state (a fresh one, or the resume point's) and the first layer's inputs:
        captured from the calibration batches, or the resume point's activations."""
        team, out, stream, batches = self.team, self.out, self.stream, self.batches
        if self.resume:
            state = team.from_writer(load_state(out, self.fingerprint, stream.n_layers)
                                     if team.writer else None)
        else:
            state = RunState(self.fingerprint)
        self.where["saved"] = state.completed_layers
        offload = self.settings.offload_activations
        t_capture = time.perf_counter()
        if not batches:
            hidden = []
        elif state.completed_layers:  # resumed: record the layers' call arguments only
            stream.capture(batches, into=Discard())
            hidden = restore_hidden(out, state.completed_layers, self.shard, offload,
                                    self.fingerprint)
        else:
            hidden = stream.capture(batches, into=DiskActivations(
                out.path(ACTIVATIONS_DIR), 0, offset=self.shard.start) if offload else [])
        if isinstance(hidden, list):  # in memory: one slab, each layer's outputs written over it
            hidden = one_slab(hidden)
        if not state.completed_layers:  # a resumed run's state holds the first run's phases
            state.phase_seconds["calibration"] = round(
                self.calib_seconds + time.perf_counter() - t_capture, 3)
            if self.smoothing is not None:
                state.phase_seconds["smoothing"] = round(self.smoothing["seconds"], 3)
        kill_point("calibration")
        self.state, self.hidden = state, hidden
        self.sinks = (SinkSet(self.formats, out.staging, stream.n_layers, state.sinks)
                      if team.writer else NoSinks())

        def new_store(name: str, rows: list[int] | None) -> BatchStore:
            return BatchStore(out.path(self.scratch) / name if offload else None, rows)

        self.quantizer = LayerQuantizer(stream, self.ckpt, self.settings, self.limits,
                                        self.sinks, state, new_store, team)

    def layers(self) -> None:
        """Every decoder layer not done yet: quantized, run again for the next layer's inputs,
        written, and the resume point saved."""
        from tqdm import tqdm

        stream, out, state, team = self.stream, self.out, self.state, self.team
        offload = self.settings.offload_activations
        hidden = self.hidden
        for i in tqdm(range(stream.n_layers), desc="layers", unit="layer",
                      disable=not self.progress):
            if i < state.completed_layers:
                continue
            t0 = time.perf_counter()
            self.where["phase"] = f"layer {i + 1} of {stream.n_layers}"
            kill_point("layer-start")
            stream.load_layer(i)
            outputs = self.quantizer.layer(i, self.layer_plans[i], hidden)
            kill_point("layer-computed")
            previous = hidden
            if outputs is not None:
                self.resume_point.wait()  # the resume point being written reads this slab
                hidden = hidden.rewrite(outputs) if offload else in_place(outputs, hidden)
            shutil.rmtree(out.path(self.scratch), ignore_errors=True)
            stream.unload_layer(i)
            with self.quantizer.clock.phase("write"):
                self.sinks.end_layer(i)
            release_free_heap()
            state.layer_seconds.append(round(time.perf_counter() - t0, 3))
            state.completed_layers = i + 1
            state.sinks = self.sinks.state()
            snapshot = asdict(state)
            save = functools.partial(self.where.__setitem__, "saved", i + 1)
            if hidden and not offload:
                self.resume_point.write(functools.partial(
                    write_resume_point, out,
                    {self.shard.start + b: h for b, h in enumerate(hidden)},
                    snapshot, team.resume_part(), team.all_written), then=save)
            else:
                if team.all_written():
                    out.write_json(STATE_FILE, snapshot)
                save()
            kill_point("layer-end")
            if offload and previous and team.writer:
                previous.drop()  # the state now points at the next generation (every rank's)
            del previous
            team.end_layer(str(i))
            if self.on_layer is not None:
                self.on_layer(i, stream.n_layers)
        self.hidden = hidden

    def head(self) -> None:
        """The outer tensors and the output head, then the report's totals."""
        t0 = time.perf_counter()
        self.where["phase"] = "the output head"
        self.quantizer.outer(self.hidden, self.head_plan, self.embed_plan)
        self.team.end_layer("head")
        with self.quantizer.clock.phase("write"):
            self.sinks.end_layer(self.stream.n_layers)
        report, state, settings = self.report, self.state, self.settings
        report.head_quantized = self.head_plan.quantize
        report.head_seconds = round(time.perf_counter() - t0, 3)
        all_plans = [p for plans in self.layer_plans for p in plans.values()] + [self.head_plan]
        self.dynamic = dynamic_overrides([p for p in all_plans if p.quantize or p.reason],
                                         settings.group_size) | kept_rules(self.kept)
        report.plan_notes = [f"{p.name}: {p.reason}" for p in all_plans if p.reason]
        report.plan_notes += [f"{k.prefix}*: kept bf16, copied unchanged ({k.why})"
                              for k in self.kept]
        if self.vision_language is not None:
            report.plan_notes.append(f"calibration {calibration_note(settings)}")
            report.vision_language = self.vision_language
        if self.smooth_note:
            report.plan_notes.append(self.smooth_note)
        report.tensors = [TensorReport(**t) for t in state.tensors]
        report.layer_seconds = state.layer_seconds
        report.bits_per_weight = round(state.bits_codes / max(state.n_weights, 1), 4)
        report.bits_per_weight_on_disk = round(state.bits_disk / max(state.n_weights, 1), 4)
        report.total_seconds = round(time.perf_counter() - self.t_start, 3)
        report.true_sequential_layers = state.true_sequential_layers
        report.experts = experts.summary(state.experts)
        report.phase_seconds = state.phase_seconds
        self.resume_point.wait()
        report.distributed = self.team.summary(time.perf_counter() - self.t_start)

    def write(self) -> None:
        """Rank 0 (the one process) finishes every format and renames the artifact into place."""
        if not self.team.writer:
            return
        settings, report = self.settings, self.report
        t_final = time.perf_counter()
        self.final = _write_artifact(self.out, self.stop, self.sinks, ArtifactInfo(
            self.src, self.ckpt.config, settings.group_size, self.head_plan.quantize,
            self.dynamic, settings.symmetric,
            _quantization_extra(settings, report.provenance["cpu_quant"]), asdict(report)),
            self.ckpt.factors if settings.smooth else None, self.on_commit)
        # after the artifact's own report was written: the CLI adds it there afterwards
        report.phase_seconds["final_write"] = round(time.perf_counter() - t_final, 3)


def _write_artifact(out: StagedOutput, stop: StopRequest, sinks: SinkSet, info: ArtifactInfo,
                    factors: dict[str, torch.Tensor] | None = None,
                    on_commit: Callable[[dict[str, str]], None] | None = None) -> Path:
    """The computed artifact: the resume files removed, every format finished, the staging
    directory renamed into place."""
    stop.defer()  # the artifact is computed: writing it takes seconds, finish it
    kill_point("final-write")
    out.path(STATE_FILE).unlink(missing_ok=True)
    remove_hidden_files(out)
    shutil.rmtree(out.path(ACTIVATIONS_DIR), ignore_errors=True)
    if factors is not None:  # beside every format's weights (verify --source, export-phone)
        for directory in sinks.directories.values():
            smoothing_factors.save_factors(directory / smoothing_factors.FACTORS_FILE, factors)
    sinks.finish(info)
    kill_point("commit")
    final = out.commit()
    if on_commit is not None:  # still deferred: the caller learns of the commit before any stop
        on_commit({name: str(final / d.relative_to(out.staging))
                   for name, d in sinks.directories.items()})
    kill_point("committed")
    return final


def update_report(dst: Path, **fields) -> dict:
    path = Path(dst) / "quantization_report.json"
    data = json.loads(path.read_text())
    data.update(fields)
    write_json_atomic(path, data)
    return data
