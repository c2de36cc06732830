"""The resume point: what a run has finished, saved after every layer for ``--resume``.

After each layer the staging directory holds the layer's output in every format sink, the
activations entering the next layer (``cpu_quant_hidden.safetensors``, or with
``offload_activations`` the generation ``activations/gen-<completed_layers>``) and then
``cpu_quant_state.json`` (:class:`RunState`), which names them. A crash at any point leaves
whole layers. :func:`run_fingerprint` ties a resume to the same source, settings, formats and
calibration tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from safetensors.torch import load_file

from ..errors import CpuQuantError
from ..io.artifact import StagedOutput
from ..io.safetensors_writer import write_safetensors
from .activations import ACTIVATIONS_DIR, DiskActivations
from .grid import GroupQuant
from .settings import QuantSettings
from .streaming import compute_dtype

STATE_FILE = "cpu_quant_state.json"
HIDDEN_FILE = "cpu_quant_hidden.safetensors"


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


def write_resume_point(out: StagedOutput, hidden: dict[int, torch.Tensor], state: dict) -> None:
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
    sinks: dict[str, dict] = field(default_factory=dict)  # format -> its sink's state()
    n_weights: int = 0
    bits_codes: float = 0.0
    bits_disk: float = 0.0
    true_sequential_layers: int = 0
    phase_seconds: dict[str, float] = field(default_factory=dict)

    def account(self, gq: GroupQuant, stored_bytes: int) -> None:
        n, k = gq.codes.shape
        self.n_weights += n * k
        zeros = 0 if gq.zeros is None else gq.zeros.numel() * 16
        self.bits_codes += n * k * 4 + gq.scales.numel() * 16 + zeros
        self.bits_disk += stored_bytes * 8


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


def restore_hidden(out: StagedOutput, completed: int, n_batches: int, offload: bool):
    """The activations entering layer ``completed``, as the interrupted run saved them (in
    memory or offloaded), in the form this run asked for."""
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


def load_state(out: StagedOutput, fingerprint: str) -> RunState:
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
