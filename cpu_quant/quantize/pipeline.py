"""The quantization pipeline: checkpoint in -> plan -> per-tensor results -> layout on disk.

``quantize_checkpoint(src, dst, settings, layout)`` streams the model one decoder layer at a
time (``streaming.LayerStream``). For each layer it accumulates the Hessian ``H = 2 XᵀX / n``
of every linear's input in float32 with forward hooks (over the activations produced by the
already-quantized layers before it), quantizes every linear (GPTQ or RTN, ``gptq.py``), runs
the layer again with its quantized weights to produce the next layer's inputs, and writes the
layer's tensors as one shard. The head is quantized last, with the Hessian of the final
normed hidden state. Output goes through ``io.artifact.StagedOutput``: nothing appears at
``dst`` until the whole artifact is written.

Memory: after every layer the allocator's free memory is handed back (``release_free_heap``).
glibc's mmap threshold is also pinned for the rest of the process (unless
``MALLOC_MMAP_THRESHOLD_`` is set), against the heap fragmentation that made the peak grow with
the number of layers: at ``MMAP_THRESHOLD`` (16 MiB: no measurable cost, most of the growth
gone), or at ``MMAP_THRESHOLD_LOW`` (4 MiB: flat with depth and a lower peak, for more time)
with ``offload_activations``, the option that trades time for memory (docs/reliability.md#memory).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import CpuQuantError, Interrupted
from ..io.artifact import StagedOutput, write_shard_index
from ..io.checkpoint import open_checkpoint
from ..runtime_patches.release_memory import allocator_releasers, pin_mmap_threshold
from .activations import ACTIVATIONS_DIR, Discard, DiskActivations
from .gptq import (
    GridSpec,
    HessianPrep,
    prepare_hessian,
    quantize_gptq,
    quantize_rtn,
    snr_db,
    weighted_error_terms,
)
from .grid import GroupQuant
from .plan import HEAD_NAME, LinearPlan, dynamic_overrides, plan_linear
from .sequential import BatchStore, probe, run_true_sequential, signature
from .streaming import LayerDone, LayerStream, compute_dtype

METHODS = ("gptq", "rtn")


@dataclass
class QuantSettings:
    method: str = "gptq"
    group_size: int = 128
    scale_search: bool = True
    act_order: bool = True  # static groups: the saved layout is the same either way
    damp: float = 0.01
    quantize_head: bool = True
    head_group: int | None = None  # None: same rule as every other module
    strict_group: bool = False
    calib: str | None = None  # None = built-in corpus; "none" = data-free (RTN only)
    samples: int = 128
    seqlen: int = 512
    batch_size: int = 8
    # calibration activations on disk between layers (same artifact, less memory, more I/O)
    offload_activations: bool = False

    def validate(self) -> None:
        if self.method not in METHODS:
            raise CpuQuantError(f"--method must be one of {', '.join(METHODS)}")
        if self.method == "gptq" and self.calib == "none":
            raise CpuQuantError("GPTQ needs calibration data; use --method rtn for data-free")
        if not 0 < self.damp <= 1:
            raise CpuQuantError("--damp must be in (0, 1]")

    @property
    def data_free(self) -> bool:
        return self.calib == "none"


@dataclass
class TensorReport:
    name: str
    shape: list[int]
    group_size: int
    weighted_snr_db: float
    damp: float | None = None
    damp_raised: bool = False


@dataclass
class QuantReport:
    settings: dict
    layout: str
    tensors: list[TensorReport] = field(default_factory=list)
    layer_seconds: list[float] = field(default_factory=list)
    head_seconds: float = 0.0
    total_seconds: float = 0.0
    calibration_tokens: int = 0
    plan_notes: list[str] = field(default_factory=list)
    bits_per_weight: float = 0.0
    bits_per_weight_on_disk: float = 0.0
    head_quantized: bool = False
    true_sequential_layers: int = 0  # the others: two passes (sequential.py)
    # summed over the layers: "quantize" (GPTQ/RTN and the scale search), "hessians" (XᵀX,
    # true-sequential layers); the rest of layer_seconds is the layer's forward passes and I/O
    phase_seconds: dict[str, float] = field(default_factory=dict)
    fidelity: dict | None = None
    provenance: dict = field(default_factory=dict)


@contextmanager
def bf16_products():
    """float32 matmuls computed by oneDNN from bf16 operands with float32 accumulation.

    The calibration activations are bf16 values already (the model runs in bf16), so rounding
    the operands to bf16 loses nothing; every product is exact and only the summation order
    differs from a float32 GEMM. Measured on XᵀX of 4096 x 1536: max error against float64
    1.3e-6 of the largest entry (float32 GEMM: 3.9e-7), at 0.46x its CPU time. The Hessians
    are the largest compute of a layer, so this is the one place it is used."""
    mm = torch.backends.mkldnn.matmul
    previous = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = previous


GRAM_BLOCK = 256  # column-block width of :func:`gram`
GRAM_ROWS = 2048  # rows per bf16 product of :func:`gram`, summed in float32


def gram(x: torch.Tensor) -> torch.Tensor:
    """XᵀX (float32) of x [rows, K], computing only the blocks on and above the diagonal.

    XᵀX is symmetric, and a GEMM does not know it: products of column blocks ``i <= j`` are
    computed and the lower blocks are their transposes, so about ``(n+1)/2n`` of the GEMM's
    work for ``n`` blocks (measured for 4096 x 1536 on 2 cores: 0.73x the time of ``x.t() @
    x``).

    A bf16 ``x`` (the calibration activations of a bf16 model) is multiplied in bf16: every
    product is exact and oneDNN accumulates in float32, but the GEMM rounds its output to bf16
    (torch 2.13 has no bf16-in, float32-out GEMM on the CPU). So the rows go in slabs of
    GRAM_ROWS, each slab's product is rounded once, and the slabs are summed in float32. The
    roundings are unbiased and independent, so over a layer's 65,536 calibration tokens the
    Hessian is within about 1e-3 of its largest entry (each diagonal entry within about 1e-3
    of itself; the test allows 1.5e-3 and 2e-3), far below the calibration sample's own noise;
    on an AMD EPYC with AVX-512 bf16 (2 cores) it takes 0.62x (K = 576) and 0.56x (K = 1536)
    the time of the float32 product. Any other dtype is
    multiplied in float32, as accurately as a float32 GEMM; the summation order, and so the
    last bits, depend only on the shapes."""
    k = x.shape[1]
    n = -(-k // GRAM_BLOCK)
    width = -(-k // n)
    if x.dtype == torch.bfloat16:
        slabs = torch.split(x, GRAM_ROWS)
    else:
        slabs = (x.to(torch.float32),)
    sums: dict[tuple[int, int], torch.Tensor] = {}  # (i, j) -> block, contiguous float32
    with bf16_products():
        for slab in slabs:
            cols = [slab[:, a:a + width] for a in range(0, k, width)]
            for i, xi in enumerate(cols):
                for j in range(i, len(cols)):
                    block = xi.t() @ cols[j]
                    if (i, j) in sums:
                        sums[i, j].add_(block)
                    else:
                        sums[i, j] = block.to(torch.float32)
    out = torch.empty(k, k, dtype=torch.float32)
    for (i, j), block in sums.items():
        a, b = i * width, j * width
        out[a:a + block.shape[0], b:b + block.shape[1]] = block
        if j != i:  # the lower blocks mirror the upper ones
            out[b:b + block.shape[1], a:a + block.shape[0]] = block.t()
    return out


class HessianAccumulator:
    """Forward pre-hooks that sum XᵀX (float32) of every hooked linear's input.

    The pass that collects Hessians has no use for what the layer computes after the last
    hooked linear has seen its input (on Llama-like layers: down_proj's product and the
    residual add, a quarter of the MLP). Once the first batch has shown that every hooked
    linear runs exactly once per call of the layer, later batches stop there
    (:class:`LayerDone`); a layer that calls a linear twice always runs to the end.
    """

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.h: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self.names = list(modules)
        self._calls: dict[str, int] = {}
        self._stop_early = False
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self._handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in modules.items()]

    def begin_batch(self) -> None:
        self._calls = {}

    def end_batch(self) -> None:
        """After a batch that ran to the end: may later batches stop early?"""
        self._stop_early = bool(self.names) and all(self._calls.get(n) == 1 for n in self.names)

    def _hook(self, name: str) -> Callable:
        def hook(module, inputs):
            x = inputs[0]
            # q/k/v (and gate/up) see the same input tensor: compute its XᵀX once.
            if self._last is not None and self._last[0] is x:
                xtx = self._last[1]
            else:
                xtx = gram(x.reshape(-1, x.shape[-1]))
                self._last = (x, xtx)  # holding x keeps its identity unique
            rows = x.numel() // x.shape[-1]
            if name in self.h:
                self.h[name] += xtx
                self.count[name] += rows
            else:
                self.h[name] = xtx.clone()
                self.count[name] = rows
            self._calls[name] = self._calls.get(name, 0) + 1
            if self._stop_early and len(self._calls) == len(self.names):
                raise LayerDone
        return hook

    def hessian(self, name: str) -> torch.Tensor:
        return 2.0 * self.h[name] / max(self.count[name], 1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._last = None


@contextmanager
def torch_threads(n: int):
    """Run the block with ``n`` intra-op threads (see :func:`quantize_linears`)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


ROW_BLOCK = 4096  # output rows quantized at a time


@dataclass
class _Job:
    """One linear to quantize: its weight, plan and Hessian (None for data-free RTN)."""

    weight: torch.Tensor
    plan: LinearPlan
    hessian: torch.Tensor | None


def _quantize_rows(w: torch.Tensor, group_size: int, hessian: torch.Tensor | None,
                   settings: QuantSettings, grid: GridSpec, prep: HessianPrep | None):
    if prep is not None:
        return quantize_gptq(w, prep, group_size, grid, act_order=settings.act_order)
    importance = None if hessian is None else torch.diag(hessian)
    return quantize_rtn(w, group_size, grid, importance), None


def _rows(gq: GroupQuant, a: int, b: int) -> GroupQuant:
    return GroupQuant(gq.codes[a:b], gq.scales[a:b], None if gq.zeros is None else gq.zeros[a:b],
                      gq.group_size)


def _cat(parts: list[GroupQuant]) -> GroupQuant:
    if len(parts) == 1:
        return parts[0]
    return GroupQuant(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                      None if parts[0].zeros is None else torch.cat([p.zeros for p in parts]),
                      parts[0].group_size)


def quantize_linears(jobs: list[_Job], settings: QuantSettings, grid: GridSpec
                     ) -> list[tuple[GroupQuant, TensorReport]]:
    """Quantize every job; results in the jobs' order, bit-identical to one job at a time.

    GPTQ and the scale search treat every output row on its own, which this uses three ways:

    * jobs that share a Hessian (q/k/v, gate/up) and a group size are stacked into one matrix,
      so the column sweep runs once for them. The sweep is a long chain of small ops whose cost
      is mostly Python's dispatch (two threads hardly beat one there: measured 1.19 against
      1.24 s for a demo-model layer's linears), so fewer, taller ops are the way to save time;
    * a tall matrix (the output head: 49152 rows on the demo model) is cut into row blocks of
      ROW_BLOCK; its float32 working copies would otherwise set the run's peak memory;
    * the row blocks are shared out, largest first, to one worker thread per torch thread,
      every op on one thread: an intra-op pool slows these ops down (down_proj [576 x 1536]:
      0.45 s of CPU with one thread against 12 s with two, OpenMP barriers spinning). The big
      matmuls (forward passes, Hessians) keep every thread.
    """
    stacks: dict[tuple, list[int]] = {}
    for j, job in enumerate(jobs):
        key = (id(job.hessian), job.plan.group_size, job.weight.shape[1], job.weight.dtype)
        stacks.setdefault(key, []).append(j)
    stacked = [(members, jobs[members[0]], torch.cat([jobs[j].weight for j in members])
                if len(members) > 1 else jobs[members[0]].weight) for members in stacks.values()]
    units = [(s, r0) for s, (_, _, w) in enumerate(stacked) for r0 in range(0, w.shape[0], ROW_BLOCK)]

    def size(unit):
        s, r0 = unit
        rows, cols = stacked[s][2].shape
        return min(ROW_BLOCK, rows - r0) * cols

    # each distinct Hessian's Cholesky once, on every thread
    preps: dict[int, HessianPrep] = {}
    if settings.method == "gptq":
        for _, lead, _ in stacked:
            if lead.hessian is not None and id(lead.hessian) not in preps:
                preps[id(lead.hessian)] = prepare_hessian(lead.hessian, act_order=settings.act_order,
                                                          damp=settings.damp)

    def run(unit):
        s, r0 = unit
        _, lead, w = stacked[s]
        prep = None if lead.hessian is None else preps.get(id(lead.hessian))
        return unit, _quantize_rows(w[r0:r0 + ROW_BLOCK], lead.plan.group_size, lead.hessian,
                                    settings, grid, prep)

    order = sorted(units, key=size, reverse=True)
    workers = max(1, min(torch.get_num_threads(), len(units)))
    with torch_threads(1):
        if workers == 1:
            results = dict(map(run, order))
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cpu-quant") as pool:
                results = dict(pool.map(run, order))
    out: dict[int, tuple[GroupQuant, TensorReport]] = {}
    for s, (members, lead, w) in enumerate(stacked):
        blocks = [results[(s, r0)] for r0 in range(0, w.shape[0], ROW_BLOCK)]
        gq = _cat([b[0] for b in blocks])
        stats = blocks[-1][1]
        importance = None if lead.hessian is None else torch.diag(lead.hessian)
        a = 0
        for j in members:
            job = jobs[j]
            b = a + job.weight.shape[0]
            part = gq if len(members) == 1 else _rows(gq, a, b)
            terms = [weighted_error_terms(job.weight[r:r + ROW_BLOCK],
                                          _rows(part, r, r + ROW_BLOCK).dequantize(), importance)
                     for r in range(0, job.weight.shape[0], ROW_BLOCK)]  # the head: in blocks
            snr = snr_db(sum(t[0] for t in terms), sum(t[1] for t in terms))
            out[j] = (part, TensorReport(job.plan.name, list(job.weight.shape), job.plan.group_size,
                                         round(snr, 3), stats.damp if stats else None,
                                         bool(stats and stats.damp_raised)))
            a = b
    return [out[j] for j in range(len(jobs))]


def _git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip()
        return sha if out.returncode == 0 and len(sha) == 40 else None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(src: Path) -> dict:
    import transformers

    from .. import __version__

    return {
        "source": str(src),
        "cpu_quant": __version__,
        "git_sha": _git_sha(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "compute_dtype": str(compute_dtype()).removeprefix("torch."),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def calibration_batches(src: Path, settings: QuantSettings) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    from ..data.corpus import load_texts, token_windows

    tok = AutoTokenizer.from_pretrained(src)
    windows = token_windows(tok, load_texts(settings.calib, "calibration"), settings.samples,
                            settings.seqlen)
    ids = torch.tensor(windows, dtype=torch.long)
    return list(torch.split(ids, settings.batch_size))


STATE_FILE = "cpu_quant_state.json"
HIDDEN_FILE = "cpu_quant_hidden.safetensors"
CACHE_DIR = "layer-cache"  # sequential.BatchStore files within a layer (offloaded runs)


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """A safetensors file written straight from the tensors' memory (no serialised copy of
    them, unlike ``safetensors.torch.save_file``) and fsynced, with Python I/O: a full disk is
    a plain OSError, and the GIL is free while the bytes go out. Read back by ``load_file``."""
    header: dict = {}
    offset = 0
    parts = []
    for name, t in tensors.items():
        t = t.detach().contiguous()
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        parts.append(t)
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in parts:
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


class ResumePoint:
    """Writes the run's resume point after a layer (the activations entering the next layer,
    then the state that names them) on a background thread while the next layer computes:
    75 MB a layer at the default calibration of the demo model, which the disk's write-back
    otherwise made the main thread wait for (6 s of a 177-s run, by py-spy). At most one write
    is in flight; :meth:`wait` joins it and raises its error. The state is written after the
    activations, so a crash at any point still leaves whole layers."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, job: Callable[[], None]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), name="cpu-quant-resume",
                                        daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # raised again by wait(), in the main thread
            self._error = exc

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def __enter__(self) -> ResumePoint:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.wait()
        elif self._thread is not None:  # an error is on its way out: only let the write end
            self._thread.join()


def _write_resume_point(out: StagedOutput, hidden: dict[int, torch.Tensor], state: dict) -> None:
    tmp = out.path(HIDDEN_FILE + ".tmp")
    write_safetensors(tmp, {f"batch.{b}": h for b, h in hidden.items()})
    os.replace(tmp, out.path(HIDDEN_FILE))
    out.write_json(STATE_FILE, state)


@dataclass
class RunState:
    """What a run has finished, persisted after every layer so that ``--resume`` can continue.

    Saved in the staging directory as ``cpu_quant_state.json`` (plus the propagated calibration
    activations in ``cpu_quant_hidden.safetensors``, or with ``offload_activations`` the
    generation ``activations/gen-<completed_layers>`` of ``activations.DiskActivations``), both
    written atomically after the layer's shard, so a crash at any point leaves a consistent
    state of whole layers.
    """

    fingerprint: str
    completed_layers: int = 0
    tensors: list[dict] = field(default_factory=list)
    layer_seconds: list[float] = field(default_factory=list)
    shards: dict[str, list[str]] = field(default_factory=dict)
    total_bytes: int = 0
    n_weights: int = 0
    bits_codes: float = 0.0
    bits_disk: float = 0.0
    true_sequential_layers: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def account(self, gq: GroupQuant, tensors: dict[str, torch.Tensor]) -> None:
        n, k = gq.codes.shape
        self.n_weights += n * k
        zeros = 0 if gq.zeros is None else gq.zeros.numel() * 16
        self.bits_codes += n * k * 4 + gq.scales.numel() * 16 + zeros
        self.bits_disk += sum(t.numel() * t.element_size() * 8 for t in tensors.values())


def run_fingerprint(ckpt, settings: QuantSettings, layout_name: str, batches: list[torch.Tensor]) -> str:
    """Source files (name, size, header), settings, layout and calibration tokens, hashed."""
    h = hashlib.sha256()
    fields = asdict(settings)
    fields.pop("offload_activations")  # where activations live does not change the result
    # the layers' compute dtype changes the propagated activations, so a resume must keep it
    h.update(json.dumps({"settings": fields, "layout": layout_name, "config": ckpt.config,
                         "compute_dtype": str(compute_dtype())}, sort_keys=True).encode())
    for f in sorted(set(ckpt.files.values())):
        h.update(f.name.encode() + str(f.stat().st_size).encode())
        h.update(json.dumps(ckpt.headers[f], sort_keys=True).encode())
    for b in batches:
        h.update(b.numpy().tobytes())
    return h.hexdigest()


class _StopRequest:
    """SIGINT/SIGTERM set a flag; the layer loop stops at the next layer boundary."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict = {}

    def __enter__(self) -> _StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        # a second Ctrl-C interrupts at once
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def quantize_checkpoint(src: str | Path, dst: str | Path, settings: QuantSettings, layout,
                        *, overwrite: bool = False, resume: bool = False, progress: bool = True,
                        on_layer: Callable[[int, int], None] | None = None) -> QuantReport:
    """Quantize ``src`` into ``dst`` through ``layout``; see the module docstring."""
    from tqdm import tqdm

    settings.validate()
    src = Path(src)
    if Path(dst).exists() and not overwrite:  # fail before any work, not after it
        raise CpuQuantError(f"output {dst} already exists (use --overwrite to replace it)")
    t_start = time.perf_counter()
    # see MMAP_THRESHOLD: the low pin only where the user traded time for memory
    threshold = MMAP_THRESHOLD_LOW if settings.offload_activations else MMAP_THRESHOLD
    mmap_pinned = pin_mmap_threshold(threshold)
    ckpt = open_checkpoint(src)
    stream = LayerStream(ckpt)
    grid = GridSpec(symmetric=layout.symmetric, scale_search=settings.scale_search)
    report = QuantReport(settings=asdict(settings), layout=layout.name, provenance=provenance(src))
    report.provenance["malloc_mmap_threshold"] = (threshold if mmap_pinned
                                                  else _env_mmap_threshold())
    batches = [] if settings.data_free else calibration_batches(src, settings)
    report.calibration_tokens = sum(b.numel() for b in batches)
    fingerprint = run_fingerprint(ckpt, settings, layout.name, batches)

    with StagedOutput(dst, overwrite=overwrite, resume=resume) as out, _StopRequest() as stop, \
            ResumePoint() as resume_point:
        state = RunState(fingerprint)
        if resume:
            state = _load_state(out, fingerprint)
        offload = settings.offload_activations
        if not batches:
            hidden = []
        elif state.completed_layers:  # resumed: record the layers' call arguments only
            stream.capture(batches, into=Discard())
            hidden = _restore_hidden(out, state.completed_layers, len(batches), offload)
        else:
            hidden = stream.capture(batches, into=DiskActivations(out.path(ACTIVATIONS_DIR), 0)
                                    if offload else [])
        if isinstance(hidden, list):  # in memory: one slab, each layer's outputs written over it
            hidden = one_slab(hidden)
        n_shards = stream.n_layers + 1

        def write_shard(index: int, tensors: dict[str, torch.Tensor]) -> None:
            fname = f"model-{index:05d}-of-{n_shards:05d}.safetensors"
            out.write_tensors(fname, tensors)
            state.shards[fname] = sorted(tensors)
            state.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())

        structures: dict = {}  # sequential.signature -> Structure or None

        def new_store(name: str, rows: list[int] | None) -> BatchStore:
            return BatchStore(out.path(CACHE_DIR) / name if offload else None, rows)

        plans: list[LinearPlan] = []
        layer_bar = tqdm(range(stream.n_layers), desc="layers", unit="layer", disable=not progress,
                         initial=0)
        for i in layer_bar:
            linears = stream.linears(i)
            layer_plans = {name: plan_linear(name, m.in_features, m.out_features,
                                             settings.group_size, settings.strict_group)
                           for name, m in linears.items()}
            plans.extend(layer_plans.values())
            if i < state.completed_layers:
                continue
            t0 = time.perf_counter()
            stream.load_layer(i)
            tensors, outputs = _quantize_layer(stream, ckpt, i, linears, layer_plans, hidden,
                                               settings, grid, layout, state, structures,
                                               new_store)
            previous = hidden
            if outputs is not None:
                resume_point.wait()  # the resume point being written reads this slab
                hidden = hidden.rewrite(outputs) if offload else in_place(outputs, hidden)
            shutil.rmtree(out.path(CACHE_DIR), ignore_errors=True)
            stream.unload_layer(i)
            write_shard(i + 1, tensors)
            del tensors
            release_free_heap()
            state.layer_seconds.append(round(time.perf_counter() - t0, 3))
            state.completed_layers = i + 1
            snapshot = asdict(state)
            if hidden and not offload:
                resume_point.write(functools.partial(_write_resume_point, out, dict(enumerate(hidden)),
                                               snapshot))
            else:
                out.write_json(STATE_FILE, snapshot)
            if offload and previous:
                previous.drop()  # the state now points at the next generation
            del previous
            if on_layer is not None:
                on_layer(i, stream.n_layers)
            if stop.requested and i + 1 < stream.n_layers:
                resume_point.wait()
                out.keep_on_exit = True
                raise Interrupted(f"interrupted after layer {i + 1} of {stream.n_layers}; run the "
                                  "same command with --resume to continue")

        # -- the outer tensors and the head --------------------------------------------------
        t0 = time.perf_counter()
        outer, head_plan = _quantize_outer(stream, ckpt, hidden, settings, grid, layout, state)
        report.head_quantized = head_plan.quantize
        report.head_seconds = round(time.perf_counter() - t0, 3)
        write_shard(n_shards, outer)
        write_shard_index(out, state.shards, state.total_bytes)

        all_plans = plans + [head_plan]
        default_group = settings.group_size
        dynamic = dynamic_overrides([p for p in all_plans if p.quantize or p.reason], default_group)
        report.plan_notes = [f"{p.name}: {p.reason}" for p in all_plans if p.reason]
        config = dict(ckpt.config)
        config["dtype"] = "bfloat16"
        config.pop("torch_dtype", None)
        if head_plan.quantize:
            config["tie_word_embeddings"] = False
            if isinstance(config.get("text_config"), dict):
                config["text_config"]["tie_word_embeddings"] = False
        config["quantization_config"] = layout.quantization_config(
            default_group, head_plan.quantize, dynamic,
            {"damp_percent": settings.damp, "quantizer": ["cpu-quant", report.provenance["cpu_quant"]],
             "cpu_quant": {"method": settings.method, "scale_search": settings.scale_search,
                           "act_order_static_groups": settings.act_order and settings.method == "gptq"}})
        out.write_json("config.json", config)
        out.copy_tokenizer_files(src)
        report.tensors = [TensorReport(**t) for t in state.tensors]
        report.layer_seconds = state.layer_seconds
        report.bits_per_weight = round(state.bits_codes / max(state.n_weights, 1), 4)
        report.bits_per_weight_on_disk = round(state.bits_disk / max(state.n_weights, 1), 4)
        report.total_seconds = round(time.perf_counter() - t_start, 3)
        resume_point.wait()
        for name in (STATE_FILE, HIDDEN_FILE):
            out.path(name).unlink(missing_ok=True)
        shutil.rmtree(out.path(ACTIVATIONS_DIR), ignore_errors=True)
        report.true_sequential_layers = state.true_sequential_layers
        report.phase_seconds = state.phase_seconds
        out.write_json("quantization_report.json", asdict(report))
        final = out.commit()
    ckpt.close()
    report.provenance["output"] = str(final)
    return report


# Blocks of this size and more are memory-mapped on their own (glibc), for the whole process.
# glibc's default threshold moves (up to 32 MiB) to the size of each freed mapped block; over a
# long run of identical layers the heap then fragments: measured on synthetic models of the
# demo model's shapes (8 x 512 calibration tokens, docs/reliability.md), its size grew by about
# 4 MB per layer at a constant 171 MB in use, and peak RssAnon followed (640 MiB at 30 layers,
# 797 at 120). A fixed threshold stops that. Its cost is in the blocks it maps afresh: at the
# default 128 x 512 calibration, interleaved 3-pass run (memory-20261201T135055Z.json):
#   moving (glibc default)  881 MiB peak, 282 s wall, 495 CPU-s
#   fixed at 16 MiB         761 MiB (0.91x, no difference), 277 s (0.99x), 495 CPU-s (1.01x)
#   fixed at 4 MiB          652 MiB (0.74x), 341 s (1.20x), 622 CPU-s (1.26x: page faults of
#                           every batch's 4-16 MiB forward temporaries, mapped anew each time)
# So 16 MiB by default, and 4 MiB with --offload-activations (time traded for memory). Against
# depth (8 x 512): glibc's moving threshold 1.36x at 4x the layers; 16 MiB 1.13x
# (memory-20261201T152007Z.json) until LayerStream.unload_layer stopped making new parameter
# objects every layer, then flat: 1.04x, no difference (memory-20261201T174651Z.json).
MMAP_THRESHOLD = 16 << 20
MMAP_THRESHOLD_LOW = 4 << 20


def _env_mmap_threshold() -> int | None:
    """The threshold a user fixed with ``MALLOC_MMAP_THRESHOLD_`` (glibc reads it at start)."""
    text = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(text) if text.isdigit() else None


def release_free_heap() -> None:
    """Give the allocator's free memory back after each layer. Every layer allocates and frees
    the same large tensors, and glibc malloc's dynamic mmap threshold moves them onto the heap,
    whose freed pages it keeps: measured on a 240-layer model, RssAnon then climbed by about
    6 MB per layer (600 -> 775 MB over 36 layers) and a run capped at 1 GiB was OOM-killed at
    layer 22, although nothing stays referenced. ``malloc_trim(0)`` (and tcmalloc's release
    when it is loaded) returns those pages, so the peak stays flat with depth."""
    for release in allocator_releasers().values():
        release()


def one_slab(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The same values as views of one tensor: one large block, mapped and unmapped whole.
    Sixteen separate 4.7 MB blocks (the demo model's activations at 128 x 512), made among a
    layer's short-lived temporaries and kept to the next layer, fragmented the heap
    (docs/reliability.md#memory)."""
    if not tensors:
        return tensors
    rows = [t.shape[:-1].numel() for t in tensors]
    slab = torch.empty(sum(rows), tensors[0].shape[-1], dtype=tensors[0].dtype)
    views, start = [], 0
    for t, n in zip(tensors, rows, strict=True):
        view = slab[start:start + n].view(t.shape)
        view.copy_(t)
        views.append(view)
        start += n
    return views


def in_place(outputs: Iterable[torch.Tensor], hidden: list[torch.Tensor]) -> list[torch.Tensor]:
    """A layer's outputs written over its inputs, batch by batch: each output is made after
    its batch's input was last read (the passes go batch by batch), and the run's resume point
    is the copy on disk, not this one. So the next layer's activations take no second copy."""
    for b, out in enumerate(outputs):
        hidden[b].copy_(out)
    return hidden


def _restore_hidden(out: StagedOutput, completed: int, n_batches: int, offload: bool):
    """The activations entering layer ``completed``, as the interrupted run saved them (in
    memory or offloaded), in the form this run asked for."""
    from safetensors.torch import load_file

    gen_dir = out.path(ACTIVATIONS_DIR)
    if (gen_dir / f"gen-{completed:05d}").is_dir():
        store = DiskActivations.open(gen_dir, completed, n_batches)
        return store if offload else list(store)
    path = out.path(HIDDEN_FILE)
    if not path.is_file():
        raise CpuQuantError(f"{out.staging} lacks the calibration activations of layer {completed}; "
                            "run without --resume to start over")
    saved = load_file(path)
    hidden = [saved[f"batch.{b}"] for b in range(n_batches)]
    if not offload:
        return hidden
    store = DiskActivations(gen_dir, completed)
    for h in hidden:
        store.append(h)
    path.unlink()
    return store


def _load_state(out: StagedOutput, fingerprint: str) -> RunState:
    path = out.path(STATE_FILE)
    if not path.is_file():
        raise CpuQuantError(f"nothing to resume: {out.staging} holds no completed layer")
    try:
        data = json.loads(path.read_text())
        state = RunState(**data)
    except (json.JSONDecodeError, TypeError):
        raise CpuQuantError(f"{path} is corrupted; run without --resume to start over") from None
    if state.fingerprint != fingerprint:
        raise CpuQuantError("cannot resume: the source files, settings or calibration data differ "
                            f"from those of the interrupted run in {out.staging}; run without "
                            "--resume to start over")
    return state


def _quantize_layer(stream: LayerStream, ckpt, i: int, linears: dict[str, nn.Linear],
                    layer_plans: dict[str, LinearPlan], hidden, settings: QuantSettings,
                    grid: GridSpec, layout, state: RunState, structures: dict, new_store
                    ) -> tuple[dict[str, torch.Tensor], Iterable[torch.Tensor] | None]:
    """Quantize layer ``i``'s linears in place (dequantized weights, for the passes after)
    and return its tensors for the artifact and its outputs (lazily; None without calibration).

    True-sequential (``sequential.py``) where the layer's structure allows it; otherwise two
    passes: Hessians from the original weights, every linear quantized, then the forward."""
    tensors: dict[str, torch.Tensor] = {}
    prefix = f"{stream.layers_prefix}.{i}."

    def timed(phase: str, fn: Callable) -> Callable:
        def run(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                state.phase_seconds[phase] = round(
                    state.phase_seconds.get(phase, 0.0) + time.perf_counter() - t0, 3)
        return run

    @functools.partial(timed, "quantize")
    def quantize(names: list[str], hessians: dict[str, torch.Tensor | None]) -> None:
        names = [n for n in names if layer_plans[n].quantize]
        jobs = [_Job(linears[n].weight.data, layer_plans[n], hessians.get(n)) for n in names]
        for name, (gq, trep) in zip(names, quantize_linears(jobs, settings, grid), strict=True):
            state.tensors.append(asdict(trep))
            module_tensors = layout.module_tensors(name, gq)
            state.account(gq, module_tensors)
            tensors.update(module_tensors)
            linears[name].weight.data = gq.dequantize().to(linears[name].weight.dtype)

    layer = stream.layers[i]
    structure = None
    if hidden:
        key = signature(layer)
        if key not in structures:
            first = next(iter(hidden))
            structures[key] = probe(layer, lambda: stream.call_layer(i, 0, first))
        structure = structures[key]
    if structure is not None:
        state.true_sequential_layers += 1

        def quantize_group(rel: tuple[str, ...], hessian: torch.Tensor) -> None:
            quantize([prefix + n for n in rel], {prefix + n: hessian for n in rel})

        outputs = run_true_sequential(layer, structure, hidden,
                                      lambda b, h: stream.call_layer(i, b, h),
                                      quantize_group, new_store, timed("hessians", gram))
    else:
        acc = HessianAccumulator({n: m for n, m in linears.items() if layer_plans[n].quantize})
        try:
            stream.observe_layer(i, hidden, acc.begin_batch, acc.end_batch)
        finally:
            acc.close()
        quantize(list(linears), {n: acc.hessian(n) for n in acc.h})
        outputs = stream.forward_layer(i, hidden) if hidden else None
    # the report lists a layer's tensors in module order, whatever order they were quantized in
    order = {n: k for k, n in enumerate(linears)}
    done = len([n for n in linears if layer_plans[n].quantize])
    state.tensors[-done:] = sorted(state.tensors[-done:], key=lambda t: order[t["name"]]) if done else []
    quantized_params = {f"{n}.weight" for n, p in layer_plans.items() if p.quantize}
    for pname in stream.layer_param_names(i):
        if pname not in quantized_params:
            tensors[pname] = ckpt.tensor(pname).to(torch.bfloat16)
    return tensors, outputs


def _quantize_outer(stream: LayerStream, ckpt, hidden: list[torch.Tensor], settings: QuantSettings,
                    grid: GridSpec, layout, state: RunState
                    ) -> tuple[dict[str, torch.Tensor], LinearPlan]:
    """Embedding and norms (bf16), and the output head, quantized with the Hessian of the final
    normed hidden state."""
    outer: dict[str, torch.Tensor] = {}
    prefix = stream.layers_prefix + "."
    for name in ckpt.names:
        if name.startswith(prefix) or name == "lm_head.weight" or name.endswith("rotary_emb.inv_freq"):
            continue
        outer[name] = ckpt.tensor(name).to(torch.bfloat16)
    head_w = ckpt.tensor(stream.head_weight_name(), check_finite=True)
    vocab, hidden_size = head_w.shape
    head_plan = plan_linear(HEAD_NAME, hidden_size, vocab, settings.head_group or settings.group_size,
                            settings.strict_group, quantize=settings.quantize_head)
    if head_plan.quantize:
        hess = None
        if hidden:
            norm = stream.final_norm()
            acc_h = torch.zeros(hidden_size, hidden_size)
            rows = 0
            with torch.no_grad():
                for h in hidden:
                    x = norm(h).reshape(-1, hidden_size)
                    acc_h += gram(x)
                    rows += x.shape[0]
            hess = 2.0 * acc_h / rows
        [(gq, trep)] = quantize_linears([_Job(head_w, head_plan, hess)], settings, grid)
        state.tensors.append(asdict(trep))
        head_tensors = layout.module_tensors(HEAD_NAME, gq)
        state.account(gq, head_tensors)
        outer.update(head_tensors)
    elif "lm_head.weight" in ckpt.names:
        outer["lm_head.weight"] = head_w.to(torch.bfloat16)
    return outer, head_plan


def update_report(dst: Path, **fields) -> dict:
    path = Path(dst) / "quantization_report.json"
    data = json.loads(path.read_text())
    data.update(fields)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return data
