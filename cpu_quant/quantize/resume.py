"""The resume point: what a run has finished, saved after every layer for ``--resume``.

After each layer the staging directory holds the layer's output in every format sink, the
activations entering the next layer (``cpu_quant_hidden-<completed_layers>.safetensors``, its
``__metadata__`` stamped with that layer and the run's fingerprint, or with
``offload_activations`` the generation ``activations/gen-<completed_layers>``) and then
``cpu_quant_state.json`` (:class:`RunState`), which names them; the previous layer's
activations are deleted only after the state. A crash at any point leaves whole layers, and a
resume checks that the activations are those of the state's layer and run.

A distributed run (``distributed.py``) keeps the same point: each rank writes the activations
of its own batches (``cpu_quant_hidden-<layer>-b<first batch>.safetensors``, tensors named by
the run's batch index), and rank 0 writes the state once every rank's are on disk. A resume
reads each batch from whichever file holds it, so it may use another number of ranks.
:func:`run_fingerprint` ties a resume to the same source (down to sampled tensor bytes),
settings, formats and calibration tokens.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..core.block_grid import BlockQuant
from ..core.errors import CpuQuantError
from ..core.grid import GroupQuant
from ..core.io.artifact import StagedOutput
from ..core.io.safetensors_writer import write_safetensors
from .activations import ACTIVATIONS_DIR, DiskActivations
from .settings import QuantSettings
from .signals import kill_point
from .streaming import compute_dtype

STATE_FILE = "cpu_quant_state.json"
HIDDEN_PREFIX = "cpu_quant_hidden-"  # + the layer the activations enter, see hidden_file
FINGERPRINT_PARTS = {"source": "the source model's files or tensor contents",
                     "settings": "the settings, formats or compute dtype",
                     "calibration": "the calibration tokens"}


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

    def write(self, job: Callable[[], None], then: Callable[[], None] = lambda: None) -> None:
        """Run ``job`` in the background, then ``then`` once it succeeded."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job, then),
                                        name="cpu-quant-resume", daemon=True)
        self._thread.start()

    def _run(self, job: Callable[[], None], then: Callable[[], None]) -> None:
        try:
            job()
            then()
        except BaseException as exc:  # raised again by wait(), in the main thread
            self._error = exc

    def settle(self) -> None:
        """Let the write in flight end (its error, if any, is raised by :meth:`wait`)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

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


def hidden_file(completed_layers: int, first_batch: int | None = None) -> str:
    """The in-memory run's saved activations entering layer ``completed_layers``: all of them,
    or (a distributed rank's part) those of the batches from ``first_batch`` on."""
    part = "" if first_batch is None else f"-b{first_batch:05d}"
    return f"{HIDDEN_PREFIX}{completed_layers:05d}{part}.safetensors"


def _hidden_layer(path: Path) -> int | None:
    digits = path.name[len(HIDDEN_PREFIX):len(HIDDEN_PREFIX) + 5]
    return int(digits) if digits.isdigit() else None


def write_resume_point(out: StagedOutput, hidden: dict[int, torch.Tensor], state: dict,
                       first_batch: int | None = None,
                       all_written: Callable[[], bool] = lambda: True) -> None:
    """The activations (``hidden``: batch index -> tensor), stamped with their layer and the
    run's fingerprint, then the state that names them, then the older activations: a kill at
    any point leaves a state whose activations are on disk (a layer never applied twice).

    A distributed rank names its file after ``first_batch``; ``all_written()`` returns once
    every rank's activations are on disk, True on the rank that writes the state."""
    layer = state["completed_layers"]
    name = hidden_file(layer, first_batch)
    write_safetensors(out.path(name), {f"batch.{b}": h for b, h in hidden.items()},
                      metadata={"format": "pt", "completed_layers": str(layer),
                                "fingerprint": fingerprint_digest(state["fingerprint"])})
    kill_point("resume-activations")
    if not all_written():
        return
    out.write_json(STATE_FILE, state)
    kill_point("resume-state")
    for old in out.staging.glob(f"{HIDDEN_PREFIX}*.safetensors"):
        # older layers only: a rank ahead of this one may already be writing the next layer's
        if (_hidden_layer(old) or 0) < layer:
            old.unlink(missing_ok=True)


def saved_layers(staging: Path) -> int:
    """The layers a run's state file in ``staging`` says are complete (0 if none is readable)."""
    try:
        return int(json.loads((staging / STATE_FILE).read_text())["completed_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def remove_hidden_files(out: StagedOutput) -> None:
    for f in out.staging.glob(f"{HIDDEN_PREFIX}*"):
        f.unlink(missing_ok=True)


@dataclass
class RunState:
    """What a run has finished, persisted after every layer so that ``--resume`` can continue.

    Saved in the staging directory as ``cpu_quant_state.json`` (plus the propagated calibration
    activations in ``hidden_file(completed_layers)``, or with ``offload_activations`` the
    generation ``activations/gen-<completed_layers>`` of ``activations.DiskActivations``), both
    written atomically after the layer's shard, so a crash at any point leaves a consistent
    state of whole layers.
    """

    fingerprint: dict[str, str]  # run_fingerprint: one digest per FINGERPRINT_PARTS key
    completed_layers: int = 0
    tensors: list[dict] = field(default_factory=list)
    layer_seconds: list[float] = field(default_factory=list)
    sinks: dict[str, dict] = field(default_factory=dict)  # format -> its sink's state()
    n_weights: int = 0
    bits_codes: float = 0.0
    bits_disk: float = 0.0
    true_sequential_layers: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    experts: dict[str, dict] = field(default_factory=dict)  # experts block -> its record

    def account(self, gq: GroupQuant | BlockQuant, stored_bytes: int) -> None:
        n, k = gq.codes.shape
        self.n_weights += n * k
        if isinstance(gq, BlockQuant):  # codes and scales are exactly what its type stores
            self.bits_codes += stored_bytes * 8
        else:
            zeros = 0 if gq.zeros is None else gq.zeros.numel() * 16
            self.bits_codes += n * k * 4 + gq.scales.numel() * 16 + zeros
        self.bits_disk += stored_bytes * 8


def run_fingerprint(ckpt, settings: QuantSettings, layout_name: str, batches: list[torch.Tensor]
                    ) -> dict[str, str]:
    """One SHA-256 per part a resume must share with the interrupted run: the source (its
    files' names, sizes, headers and sampled tensor bytes: ``Checkpoint.content_digest``, and
    its config), the settings (with the layout and the compute dtype, which changes the
    propagated activations) and the calibration token ids. Where the activations live is not
    part of it: it does not change the result."""
    fields = asdict(settings)
    fields.pop("offload_activations")
    settings_doc = json.dumps({"settings": fields, "layout": layout_name,
                               "compute_dtype": str(compute_dtype())}, sort_keys=True)
    source = hashlib.sha256(json.dumps(ckpt.config, sort_keys=True).encode())
    source.update(ckpt.content_digest().encode())
    calibration = hashlib.sha256()
    for b in batches:
        calibration.update(str(tuple(b.shape)).encode())
        if b.is_floating_point():  # an image window's input embeddings
            calibration.update(str(b.dtype).encode())
            b = b.view(torch.int16) if b.dtype == torch.bfloat16 else b
        calibration.update(b.numpy().tobytes())
    return {"source": source.hexdigest(),
            "settings": hashlib.sha256(settings_doc.encode()).hexdigest(),
            "calibration": calibration.hexdigest()}


def fingerprint_digest(fingerprint: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def _check_hidden(path: Path, completed: int, fingerprint: dict[str, str]) -> list[str]:
    """The tensor names of a saved activations file, checked against the state (their layer)
    and the run (their fingerprint)."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            keys = list(fh.keys())
    except Exception:  # safetensors raises its own error types for a torn or foreign file
        raise CpuQuantError(f"{path} is corrupted; run without --resume to start over") from None
    if "completed_layers" not in meta:
        raise CpuQuantError(f"cannot resume: {path.name} carries no layer stamp, so it cannot "
                            "be told to be the state's; run without --resume to start over")
    if meta.get("completed_layers") != str(completed):
        raise CpuQuantError(f"cannot resume: {path.name} holds the activations of layer "
                            f"{meta.get('completed_layers')}, the state says {completed}; run "
                            "without --resume to start over")
    if meta.get("fingerprint") != fingerprint_digest(fingerprint):
        raise CpuQuantError(f"cannot resume: {path.name} was written by another run; run without "
                            "--resume to start over")
    return keys


def restore_hidden(out: StagedOutput, completed: int, batches: range, offload: bool,
                   fingerprint: dict[str, str]):
    """The activations of ``batches`` entering layer ``completed``, as the interrupted run
    saved them (in memory or offloaded, by one process or by several ranks), in the form this
    run asked for."""
    gen_dir = out.path(ACTIVATIONS_DIR)
    if (gen_dir / f"gen-{completed:05d}").is_dir():
        store = DiskActivations.open(gen_dir, completed, len(batches), batches.start)
        return store if offload else list(store)
    wanted = {f"batch.{b}": b for b in batches}
    found: dict[int, torch.Tensor] = {}
    whole: list[Path] = []  # files holding only batches of this run's share
    for path in sorted(out.staging.glob(f"{HIDDEN_PREFIX}{completed:05d}*.safetensors")):
        keys = _check_hidden(path, completed, fingerprint)
        mine = [k for k in keys if k in wanted]
        if mine:
            saved = load_file(path)
            found.update({wanted[k]: saved[k] for k in mine})
            if len(mine) == len(keys):
                whole.append(path)
    missing = [b for b in batches if b not in found]
    if missing:
        raise CpuQuantError(f"{out.staging} lacks the calibration activations of layer {completed}"
                            f"{'' if len(missing) == len(batches) else f' (batch {missing[0]})'}; "
                            "run without --resume to start over")
    hidden = [found[b] for b in batches]
    if not offload:
        return hidden
    store = DiskActivations(gen_dir, completed, offset=batches.start)
    for h in hidden:
        store.append(h)
    for path in whole:
        path.unlink()
    return store


# the state's fields a resume relies on, with their JSON types
STATE_TYPES = {"fingerprint": dict, "completed_layers": int, "tensors": list,
               "layer_seconds": list, "sinks": dict}


def load_state(out: StagedOutput, fingerprint: dict[str, str], n_layers: int) -> RunState:
    """The interrupted run's state, when it is whole, of a model of ``n_layers`` layers and of
    this run (``fingerprint``); else a one-line refusal that leaves the partial run as it is."""
    path = out.path(STATE_FILE)
    if not path.is_file():
        raise CpuQuantError(f"nothing to resume: {out.staging} holds no completed layer")
    corrupted = CpuQuantError(f"{path} is corrupted; run without --resume to start over")
    try:
        data = json.loads(path.read_text())
        state = RunState(**data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        raise corrupted from None
    if any(not isinstance(data.get(k), kind) or isinstance(data.get(k), bool)
           for k, kind in STATE_TYPES.items()) or not 1 <= state.completed_layers <= n_layers:
        raise corrupted
    saved = state.fingerprint if isinstance(state.fingerprint, dict) else {}
    differ = [what for part, what in FINGERPRINT_PARTS.items() if saved.get(part) != fingerprint[part]]
    if differ:
        raise CpuQuantError(f"cannot resume: {' and '.join(differ)} differ from those of the "
                            f"interrupted run in {out.staging}; run without --resume to start over")
    return state
