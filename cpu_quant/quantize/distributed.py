"""Data-parallel GPTQ over ``torch.distributed`` (gloo, CPU only): what each rank does.

A run's processes are *ranks* of one gloo process group, started by ``torchrun`` (one host or
several) or by ``cpu-quant gptq --nproc P`` (one host, ``cpu_quant/cli/launcher.py``); both use
PyTorch's own rendezvous and store, and gloo for every transfer. The pipeline
(``pipeline.py``) runs unchanged on every rank; a :class:`Team` decides the few things that
differ, and the single process is the plain :class:`Team` (one rank, no transport):

* **Data.** Rank ``r`` takes the contiguous share ``[n r / P, n (r+1) / P)`` of the ``n``
  calibration batches (:meth:`Team.shard`) and runs the layer-streaming passes on it.
* **Smoothing.** The default's statistics pass (``smooth_fold.plan_smoothing``) forwards each
  rank's share of its batches and shares out the folds' candidate strengths; the ranks
  exchange the statistics and the candidates' errors (:meth:`Team.gather_objects`).
* **Hessians, bit for bit.** One process sums a linear's ``XᵀX`` batch after batch, in batch
  order, in float32 (:class:`~cpu_quant.quantize.hessians.GramSum`). :class:`ChainedGramSum`
  makes exactly those additions, in that order, across the ranks: rank 0 adds its batches'
  products as one process would, sends the running sum to rank 1, which adds its own (kept
  until then) and passes it on; the last rank broadcasts the total. So 1, 2 or 4 ranks give
  the same Hessians bit for bit, and the payload is one ``K x K`` float32 matrix per hop and
  one broadcast, whatever the number of batches. The matrix travels in row blocks so that
  the hops overlap (a pipeline). The price: a rank after the first holds its batches'
  products (``K x K`` float32 each) until the running sum reaches it.
* **GPTQ sweeps.** Every row of a GPTQ sweep is computed on its own, so each stack of linears
  (q/k/v, gate/up, ...) is cut into row ranges, one per rank (starting at multiples of 64
  rows, each cut further into the single process's row blocks), and every rank receives the
  others' codes, scales and zeros (:class:`TeamRows`, 4-bit codes packed two to a byte).
  Every rank so runs the next group and layer on the same quantized weights, true-sequential
  included. Each rank factors every Hessian itself; the factor has the same bits at any thread
  count (``factor.py``), so the ranks may run different numbers of torch threads.
* **Output.** Rank 0 writes the artifact through the same staging directory and atomic rename;
  the other ranks write only their batches' resume activations into it (so it must be on a
  filesystem every rank sees: checked at the start). The report records the world size and
  each rank's time, time in collectives and bytes moved (:meth:`GlooTeam.summary`).
* **Faults.** Before any work the ranks compare their options, cpu-quant's source files and
  package versions (:func:`agree_on_command`), then the run's fingerprint
  (source model, settings, calibration tokens: ``resume.run_fingerprint``); any difference
  stops every rank. A rank that dies or does not answer within the timeout
  (``--rank-timeout``) makes the others' next collective fail (:class:`RankLost`); they stop,
  keeping the completed layers for ``--resume`` (which may use another number of ranks).
  Exactly one rank prints the stop's one line: the first to claim it in the rendezvous store
  (:func:`joined`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..core.errors import CpuQuantError
from ..core.grid import GroupQuant
from ..core.io.artifact import StagedOutput
from . import schedule
from .hessians import GramSum
from .schedule import LOCAL_ROWS, Piece, RowShare, aligned_bounds
from .settings import DEFAULT_RANK_TIMEOUT

CHAIN_BLOCK_BYTES = 4 << 20  # the running Hessian sum travels in row blocks of about this size
VOICE_KEY = "cpu_quant/voice"  # the rank that prints a stopped run's one line
DONE_KEY = "cpu_quant/done"  # ranks past that decision (the store's host waits for them)
CLAIM_SECONDS = 5.0  # store operations on the error path
TROUBLE_POLLS = 20  # 50 ms apart: how long a failed collective looks for a peer's end


class RankLost(CpuQuantError):
    """A collective failed: another rank ended, stopped answering or lost its connection."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class Team:
    """One process alone (world size 1): every batch, every row, nothing to exchange."""

    rank = 0
    world_size = 1
    rows: RowShare = LOCAL_ROWS
    cause: str | None = None  # why a collective failed, once one has

    @property
    def writer(self) -> bool:
        """Does this process write the artifact and the run state (rank 0)?"""
        return self.rank == 0

    def share_of(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (rank order is item order)."""
        return range(n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size)

    def shard(self, n: int) -> range:
        """This rank's calibration batches (indices into the run's ``n``)."""
        return self.share_of(n)

    def new_sum(self, width: int) -> GramSum:
        return GramSum(width)

    def from_writer(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def gather_objects(self, obj: Any, what: str) -> list:
        """Every rank's ``obj``, in rank order, on every rank (``what``: the step)."""
        return [obj]

    def agree_on_run(self, fingerprint: dict[str, str]) -> None:
        """Refuse ranks whose source, settings or calibration tokens differ (before any work)."""

    def check_batches(self, n: int) -> None:
        """Refuse more ranks than calibration batches."""

    @contextmanager
    def enter(self, staged: StagedOutput) -> Iterator[Any]:
        """The staging directory this rank writes into: rank 0's, entered by rank 0."""
        with staged as out:
            yield out

    def all_written(self) -> bool:
        """Every rank's resume activations are on disk; True on the rank that writes the state."""
        return True

    def barrier(self, what: str) -> None:
        """Wait for every rank (``what``: the step, for an error message)."""

    def scratch(self, name: str) -> str:
        """A scratch directory name within the staging directory, private to this rank."""
        return name

    def resume_part(self) -> int | None:
        """The first batch of this rank's resume activations file (None: one file for all)."""
        return None

    def end_layer(self, label: str) -> None:
        """Close the per-layer account of collectives (``label``: the layer)."""

    def trouble(self) -> str | None:
        """What is wrong with another rank, if anything can be seen from here."""
        return None

    def summary(self, seconds: float) -> dict | None:
        """Every rank's account, gathered on every rank (None alone)."""
        return None

    def release_signals(self) -> None:
        """The run's collectives are over: SIGTERM acts as in a single process again."""


@dataclass
class CollectiveAccount:
    """Time inside collectives (waiting for the others included) and payload bytes."""

    seconds: float = 0.0
    received: int = 0
    sent: int = 0
    calls: int = 0

    def add(self, seconds: float, received: int, sent: int) -> None:
        self.seconds += seconds
        self.received += received
        self.sent += sent
        self.calls += 1


@dataclass
class RankIdentity:
    rank: int
    host: str
    pid: int
    started: str  # /proc/PID/stat's start time: a pid reused later is not mistaken for it
    threads: int


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_state(pid: int, started: str) -> str | None:
    """The state letter of a process on this host (R, S, T, ...), None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields and fields[19] == started else None


class GlooTeam(Team):
    """This process's rank in the gloo process group that ``torchrun`` or ``--nproc`` set up
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment)."""

    def __init__(self, timeout: float = DEFAULT_RANK_TIMEOUT) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.timeout = timeout
        self.ranks: list[RankIdentity] = []
        self.account = CollectiveAccount()
        self.layers: list[dict] = []
        self._layer_start = CollectiveAccount()
        self._shard = range(0)
        self.sigterm: Any = None  # SIGTERM's handler before joined() set it aside
        try:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        except (ValueError, RuntimeError) as exc:
            raise CpuQuantError(f"cannot join the distributed run: {str(exc).splitlines()[0]}") from None
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # the resume point's writer thread waits for the ranks on a group of its own
        self.resume_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.store = dist.distributed_c10d._get_default_store()
        self.rows = TeamRows(self)
        fields = _stat_fields(os.getpid())
        me = RankIdentity(self.rank, socket.gethostname(), os.getpid(),
                          fields[19] if fields else "", torch.get_num_threads())
        self.ranks = [RankIdentity(**d) for d in self.gather_objects(asdict(me), "the start")]
        self.host = me.host

    # -- collectives, timed and counted; a failure becomes RankLost -------------------------
    def _call(self, what: str, fn: Callable[[], Any], received: int = 0, sent: int = 0) -> Any:
        t0 = time.perf_counter()
        try:
            result = fn()
        except RuntimeError as exc:  # gloo: a closed connection, a timeout
            self.cause = self._cause(exc, what)
            raise RankLost(self.cause) from None
        self.account.add(time.perf_counter() - t0, received, sent)
        return result

    def _cause(self, exc: BaseException, what: str) -> str:
        # a killed peer's sockets close before its process is seen to end: look for a moment
        for _ in range(TROUBLE_POLLS):
            seen = self.trouble()
            if seen:
                return seen
            time.sleep(0.05)
        text = str(exc).strip()
        if "timed out" in text.lower() or "timeout" in text.lower():
            return f"a rank did not answer within {self.timeout:g} s ({what})"
        # gloo's message: "[source.cc:537] Read error [127.0.0.1]:53989: Connection reset by
        # peer. This is typically caused by ..." -> its first sentence, without the source
        first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else "").split(". ")[0]
        return f"the connection to another rank was lost ({what}: {first or type(exc).__name__})"

    def trouble(self) -> str | None:
        for peer in self.ranks:
            if peer.rank == self.rank or peer.host != socket.gethostname():
                continue
            state = _process_state(peer.pid, peer.started)
            if state in (None, "Z", "X"):  # gone, or dead and not yet reaped by its parent
                return f"rank {peer.rank} (pid {peer.pid}) ended"
            if state in ("T", "t"):
                return f"rank {peer.rank} (pid {peer.pid}) is stopped and does not answer"
        return None

    def gather_objects(self, obj: Any, what: str) -> list:
        out: list = [None] * self.world_size
        self._call(what, lambda: self.dist.all_gather_object(out, obj))
        return out

    def from_writer(self, obj: Any) -> Any:
        box = [obj]
        self._call("rank 0's decision", lambda: self.dist.broadcast_object_list(box, src=0))
        return box[0]

    def barrier(self, what: str) -> None:
        self._call(what, self.dist.barrier)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        n = tensor.numel() * tensor.element_size()
        mine = self.rank == src
        self._call(what, lambda: self.dist.broadcast(tensor, src=src),
                   received=0 if mine else n, sent=n * (self.world_size - 1) if mine else 0)

    # -- agreement before any work -----------------------------------------------------------
    def agree(self, mine: dict[str, Any], describe: Callable[[str, int, Any, Any], str],
              what: str) -> None:
        """Every rank's ``mine`` equal to rank 0's, or every rank raises the same one line
        (``describe(key, rank, its value, rank 0's value)``, the lowest rank's first key)."""
        docs = self.gather_objects(mine, what)
        for r, doc in enumerate(docs):
            for key, value in docs[0].items():
                if doc.get(key) != value:
                    raise CpuQuantError(describe(key, r, doc.get(key), value))

    def agree_on_run(self, fingerprint: dict[str, str]) -> None:
        from .resume import FINGERPRINT_PARTS

        self.agree(fingerprint, lambda part, r, _a, _b: (
            f"rank {r} differs from rank 0 in {FINGERPRINT_PARTS[part]}: every rank must "
            "quantize the same source with the same settings and calibration text"),
            "the run fingerprint")

    def check_batches(self, n: int) -> None:
        if n and n < self.world_size:
            raise CpuQuantError(f"{self.world_size} ranks need at least {self.world_size} "
                                f"calibration batches, there are {n}: raise --samples or "
                                "lower --batch-size")

    def shard(self, n: int) -> range:
        self._shard = super().shard(n)
        return self._shard

    # -- Hessians: the one-process order across the ranks --------------------------------------
    def new_sum(self, width: int) -> GramSum:
        return ChainedGramSum(self, width)

    def chain(self, total: torch.Tensor | None, pending: list[torch.Tensor], rows: int,
              width: int) -> tuple[torch.Tensor, int]:
        """The batch-order sum over every rank (see the module docstring); every rank gets it."""
        dist, r, last = self.dist, self.rank, self.world_size - 1
        if last == 0:
            return total, rows  # type: ignore[return-value]
        count = torch.tensor([rows], dtype=torch.int64)
        if r > 0:
            prefix = torch.zeros(1, dtype=torch.int64)
            self._call("the Hessian sum", lambda: dist.recv(prefix, src=r - 1), received=8)
            count += prefix
            total = torch.empty(width, width)
        if r < last:
            self._call("the Hessian sum", lambda: dist.send(count, dst=r + 1), sent=8)
        step = max(1, CHAIN_BLOCK_BYTES // (4 * width))
        sends = []
        for a in range(0, width, step):
            block = total[a:a + step]  # type: ignore[index]
            if r > 0:
                self._call("the Hessian sum", lambda block=block: dist.recv(block, src=r - 1),
                           received=block.numel() * 4)
                for xtx in pending:  # this rank's batches, in order, after those before it
                    block.add_(xtx[a:a + step])
            if r < last:
                sends.append(self._call("the Hessian sum",
                                        lambda block=block: dist.isend(block, dst=r + 1),
                                        sent=block.numel() * 4))
        for work in sends:
            self._call("the Hessian sum", work.wait)
        pending.clear()
        if r < last:
            total = torch.empty(width, width)
        self.broadcast(total, last, "the Hessian sum")  # type: ignore[arg-type]
        self.broadcast(count, last, "the Hessian sum")
        return total, int(count.item())  # type: ignore[return-value]

    # -- the staging directory, shared ---------------------------------------------------------
    @contextmanager
    def enter(self, staged: StagedOutput) -> Iterator[Any]:
        if self.writer:
            with staged as out:
                self.barrier("the start")
                self._check_shared(staged)
                yield out
            return
        self.barrier("the start")  # rank 0 has made the staging directory (or failed)
        self._check_shared(staged)
        yield SharedStaging(staged.staging)

    def _check_shared(self, staged: StagedOutput) -> None:
        """Every rank sees the staging directory rank 0 made (by its lock file's pid)."""
        try:
            owner = int(staged.lock.read_text().strip() or 0)
        except (OSError, ValueError):
            owner = 0
        seen = staged.staging.is_dir() and owner == self.ranks[0].pid
        self.agree({"sees": seen}, lambda _k, r, _a, _b: (
            f"rank {r} (host {self.ranks[r].host}) does not see the staging directory "
            f"{staged.staging} that rank 0 made: a distributed run writes DST on a filesystem "
            "every rank shares"), "the staging directory")

    def all_written(self) -> bool:
        self._call("the resume point", lambda: self.dist.barrier(group=self.resume_group))
        return self.writer

    def scratch(self, name: str) -> str:
        return f"{name}-rank{self.rank}"

    def resume_part(self) -> int | None:
        return self._shard.start

    # -- the account ------------------------------------------------------------------------
    def end_layer(self, label: str) -> None:
        a, b = self.account, self._layer_start
        self.layers.append({"layer": label, "collective_seconds": round(a.seconds - b.seconds, 4),
                            "bytes_received": a.received - b.received,
                            "bytes_sent": a.sent - b.sent, "calls": a.calls - b.calls})
        self._layer_start = CollectiveAccount(a.seconds, a.received, a.sent, a.calls)

    def summary(self, seconds: float) -> dict | None:
        me = self.ranks[self.rank]
        mine = {"rank": self.rank, "host": me.host, "pid": me.pid, "threads": torch.get_num_threads(),
                "batches": [self._shard.start, self._shard.stop],
                "seconds": round(seconds, 3),
                "collective_seconds": round(self.account.seconds, 3),
                "bytes_received": self.account.received, "bytes_sent": self.account.sent,
                "collective_calls": self.account.calls, "layers": self.layers}
        ranks = self.gather_objects(mine, "the report")
        return {"world_size": self.world_size, "backend": "gloo", "timeout_seconds": self.timeout,
                "launcher": os.environ.get(LAUNCHER_ENV, "torchrun"), "ranks": ranks}

    def release_signals(self) -> None:
        if self.sigterm is not None:
            signal.signal(signal.SIGTERM, self.sigterm)
            self.sigterm = None

    def close(self) -> None:
        """Leave the process group (idempotent): the others' collectives fail from now on."""
        if self.dist.is_initialized():
            try:
                self.dist.destroy_process_group()
            except (RuntimeError, ValueError):
                pass


LAUNCHER_ENV = "CPU_QUANT_LAUNCHER"  # set by ``--nproc``'s launcher, recorded in the report


class ChainedGramSum(GramSum):
    """A :class:`GramSum` whose additions continue across the ranks in batch order: rank 0
    adds its batches' products as one process would; a later rank keeps its own until the
    running sum arrives (:meth:`GlooTeam.chain`)."""

    def __init__(self, team: GlooTeam, width: int) -> None:
        self.team, self.width = team, width
        self.total = torch.zeros(width, width) if team.rank == 0 else None  # type: ignore[assignment]
        self.pending: list[torch.Tensor] = []
        self.rows = 0
        self.summed = False
        self.scaled = False

    def add(self, xtx: torch.Tensor, rows: int) -> None:
        if self.total is not None:
            self.total.add_(xtx)
        else:
            self.pending.append(xtx)
        self.rows += rows

    def hessian(self) -> torch.Tensor | None:
        if not self.summed:
            self.total, self.rows = self.team.chain(self.total, self.pending, self.rows, self.width)
            self.summed = True
        return super().hessian()


class TeamRows:
    """Each stack's rows cut into one range per rank (starting at multiples of ROW_ALIGN
    rows, then cut into the single process's ROW_BLOCK blocks); every result broadcast by
    its owner."""

    def __init__(self, team: GlooTeam) -> None:
        self.team = team
        self.rank = team.rank

    def cut(self, stack: int, rows: int) -> list[Piece]:
        return rank_pieces(stack, rows, self.team.world_size)

    def exchange(self, pieces: list[Piece], mine: dict[Piece, GroupQuant],
                 empty: Callable[[Piece], GroupQuant]) -> dict[Piece, GroupQuant]:
        out = dict(mine)
        for piece in pieces:
            own = piece.owner == self.rank
            gq = mine[piece] if own else empty(piece)
            packed = _pack_codes(gq.codes) if own else _packed_like(gq.codes)
            self.team.broadcast(packed, piece.owner, "the quantized rows")
            self.team.broadcast(gq.scales, piece.owner, "the quantized rows")
            if gq.zeros is not None:
                self.team.broadcast(gq.zeros, piece.owner, "the quantized rows")
            if not own:
                gq.codes.copy_(_unpack_codes(packed, gq.codes.shape[1]))
                out[piece] = gq
        return out


def rank_pieces(stack: int, rows: int, world_size: int) -> list[Piece]:
    """Rows ``0:rows`` of a stack cut into one near-equal range per rank, each starting at a
    multiple of ROW_ALIGN rows (``schedule.aligned_bounds``), and at the single process's block
    boundaries (multiples of ``schedule.ROW_BLOCK``): no piece is a sliver of a few rows."""
    p, block = world_size, schedule.ROW_BLOCK
    bounds = aligned_bounds(rows, p)
    pieces = []
    for r in range(p):
        a = bounds[r]
        while a < bounds[r + 1]:
            b = min(bounds[r + 1], (a // block + 1) * block)
            pieces.append(Piece(stack, a, b, r))
            a = b
    return pieces


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [n, k] as [n, ceil(k/2)] bytes, the even column in the low nibble."""
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _packed_like(codes: torch.Tensor) -> torch.Tensor:
    return torch.empty(codes.shape[0], (codes.shape[1] + 1) // 2, dtype=torch.uint8)


def _unpack_codes(packed: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out[:, :k]


class NoSinks:
    """What a rank other than 0 hands its results to: nothing is written (rank 0 has the same
    results and writes them)."""

    directories: dict[str, Path] = {}

    def add_module(self, module: str, gq: GroupQuant) -> int:
        return 0

    def add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def end_layer(self, index: int) -> None:
        pass

    def state(self) -> dict[str, dict]:
        return {}


class SharedStaging:
    """Rank 0's staging directory as another rank writes into it (its own resume files)."""

    def __init__(self, staging: Path) -> None:
        self.staging = staging

    def path(self, name: str) -> Path:
        return self.staging / name


# -- agreement on the command, before any work ---------------------------------------------------
def code_digest() -> str:
    """SHA-256 of cpu-quant's Python source files and the versions of the packages whose code
    computes the result: ranks that differ here could compute different bytes."""
    from importlib.metadata import PackageNotFoundError, version

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    for package in ("torch", "transformers", "safetensors", "accelerate"):
        try:
            digest.update(f"{package}=={version(package)}".encode())
        except PackageNotFoundError:
            digest.update(f"{package} absent".encode())
    return digest.hexdigest()


def agree_on_command(team: Team, options: dict[str, Any], flags: dict[str, str]) -> None:
    """Every rank started with the same options (``flags``: option name -> its flag, for the
    message) and the same cpu-quant source and package versions. Their torch threads may
    differ: the result does not depend on them."""
    if not isinstance(team, GlooTeam):
        return
    mine = {f"option:{k}": v for k, v in sorted(options.items())}
    mine["code"] = code_digest()

    def describe(key: str, r: int, theirs: Any, ours: Any) -> str:
        if key == "code":
            return (f"rank {r} runs a different cpu-quant (its source files or torch/transformers "
                    "versions differ from rank 0's): install the same one on every host")
        name = key.split(":", 1)[1]
        flag = flags.get(name, name)
        return (f"rank {r} was started with {flag} {_shown(theirs)}, rank 0 with {flag} "
                f"{_shown(ours)}: every rank must run the same command")

    team.agree(mine, describe, "the command")


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# -- joining, and the one line a stopped run prints -------------------------------------------
def launched_rank() -> bool:
    """Was this process started as a rank (``torchrun`` or ``--nproc``)?"""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@contextmanager
def joined(timeout: float = DEFAULT_RANK_TIMEOUT) -> Iterator[Team]:
    """This process's team: a :class:`GlooTeam` when started as a rank, else one process.

    An exception leaving the block is marked quiet (``exc.cpu_quant_quiet``) on every rank
    but the one that claimed the run's one line first in the store; the CLI then exits without
    printing. The rank hosting the store (rank 0 started by hand, without an agent) waits a
    moment for the others' claims before it exits."""
    if not launched_rank():
        yield Team()
        return
    # The launcher stops the other ranks with SIGTERM when one fails. Outside a run's compute
    # (where StopRequest turns it into a clean stop) it is ignored: a rank on its way out with
    # its error must live to print it, up to its exit (the launcher kills a lingering rank).
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    team = GlooTeam(timeout)
    team.sigterm = previous
    try:
        yield team
    except BaseException as exc:
        if not _claim_voice(team):
            exc.cpu_quant_quiet = True  # type: ignore[attr-defined]
        team.close()  # the others' collectives fail now, not when this process exits
        _linger(team)
        raise
    else:
        team.release_signals()
    finally:
        team.close()


def _claim_voice(team: GlooTeam) -> bool:
    me = str(team.rank)
    try:
        team.store.set_timeout(timedelta(seconds=CLAIM_SECONDS))
        won = team.store.compare_set(VOICE_KEY, "", me) == me.encode()
        team.store.add(DONE_KEY, 1)
        return won
    except Exception:  # the store's host is gone: speak rather than risk silence
        return True


def _linger(team: GlooTeam) -> None:
    """Rank 0 started without an agent hosts the store: keep it up until every rank has
    claimed or not (a few seconds at most)."""
    if team.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    deadline = time.monotonic() + CLAIM_SECONDS
    while time.monotonic() < deadline:
        try:
            if team.store.add(DONE_KEY, 0) >= team.world_size:
                return
        except Exception:  # the store's own error types: nothing left to wait for
            return
        time.sleep(0.05)
