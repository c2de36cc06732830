"""The job schedule: a layer's linears stacked, cut into row blocks and shared out to threads.

:func:`quantize_linears` turns a list of :class:`QuantJob` (weight, plan, Hessian) into
:class:`GroupQuant` results, bit-identical to quantizing one job at a time. Which row blocks
this process sweeps is a :class:`RowShare`'s decision: all of them (:class:`LocalRows`), or in a
distributed run its rank's share, the others' results received from their ranks
(``distributed.TeamRows``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from ..core.block_grid import BlockQuant
from ..core.errors import CpuQuantError
from ..core.grid import GroupQuant
from .block_fit import quantize_block_gptq, quantize_block_rtn
from .gptq import (
    GPTQStats,
    GridSpec,
    HessianNotPositiveDefinite,
    HessianPrep,
    prepare_hessian,
    quantize_gptq,
    quantize_rtn,
    snr_db,
    weighted_error_terms,
)
from .plan import LinearPlan
from .settings import QuantSettings, TensorReport

logger = logging.getLogger("cpu_quant.quantize")


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
# where a stack is cut below a row block (into one piece per thread, or per rank of a
# distributed run): every row's codes and scales are the same whatever rows are swept with it
# (row-wise math, and a lazy update whose sums run along the block, not the rows), as long as
# the matrix is not a sliver of 1 to 3 rows (measured: BLAS takes another path there)
ROW_ALIGN = 64


def aligned_bounds(rows: int, parts: int) -> list[int]:
    """``parts`` near-equal ranges of ``0:rows`` as their bounds, each range starting at a
    multiple of ROW_ALIGN (so none is a sliver when ``rows >= parts * ROW_ALIGN``)."""
    return [min(rows, round(rows * r / parts / ROW_ALIGN) * ROW_ALIGN) for r in range(parts)] + [rows]


@dataclass(frozen=True)
class Piece:
    """Rows ``r0:r1`` of stack ``stack`` (jobs sharing a Hessian), swept by rank ``owner``."""

    stack: int
    r0: int
    r1: int
    owner: int


class RowShare(Protocol):
    """Which process sweeps which rows, and how the results reach every process."""

    rank: int

    def cut(self, stack: int, rows: int) -> list[Piece]:
        """Pieces covering rows ``0:rows`` in order, none taller than ROW_BLOCK."""
        ...

    def exchange(self, pieces: list[Piece], mine: dict[Piece, GroupQuant],
                 empty: Callable[[Piece], GroupQuant]) -> dict[Piece, GroupQuant]:
        """Every piece's result, from this process's own (``mine``); ``empty(piece)`` makes
        a result of the piece's shape to receive into."""
        ...


class LocalRows:
    """The single process: every row block is its own."""

    rank = 0

    def cut(self, stack: int, rows: int) -> list[Piece]:
        """Row blocks of ROW_BLOCK rows; a stack with fewer blocks than torch has threads is
        cut into one piece per thread instead (:func:`aligned_bounds`), since the pieces run
        side by side, one per thread: a 1B model's q/k/v, o and down projections are one block
        each, and one thread swept them while the other idled."""
        threads = torch.get_num_threads()
        if -(-rows // ROW_BLOCK) >= threads or rows < 2 * ROW_ALIGN:
            return [Piece(stack, r0, min(r0 + ROW_BLOCK, rows), 0)
                    for r0 in range(0, rows, ROW_BLOCK)]
        bounds = aligned_bounds(rows, min(threads, rows // ROW_ALIGN))
        return [Piece(stack, a, b, 0) for a, b in itertools.pairwise(bounds) if b > a]

    def exchange(self, pieces: list[Piece], mine: dict[Piece, GroupQuant],
                 empty: Callable[[Piece], GroupQuant]) -> dict[Piece, GroupQuant]:
        return mine


LOCAL_ROWS = LocalRows()


@dataclass
class QuantJob:
    """One linear to quantize: its weight, plan and Hessian (None for data-free RTN).
    ``fallback``: why a GPTQ run quantizes it by round-to-nearest with the scale search
    weighted by its Hessian's diagonal instead (recorded as its ``gptq_fallback``; an expert
    the router starved, ``experts.FALLBACK``), or None."""

    weight: torch.Tensor
    plan: LinearPlan
    hessian: torch.Tensor | None
    fallback: str | None = None


def _quantize_rows(w: torch.Tensor, plan: LinearPlan, hessian: torch.Tensor | None,
                   settings: QuantSettings, grid: GridSpec, prep: HessianPrep | None):
    """Rows of one stack on the run's group grid, or on the plan's own block grid."""
    if plan.grid is not None:
        if prep is not None:
            return quantize_block_gptq(w, prep, plan.grid, act_order=settings.act_order)
        importance = None if hessian is None else torch.diag(hessian)
        return quantize_block_rtn(w, plan.grid, importance), None
    if prep is not None:
        return quantize_gptq(w, prep, plan.group_size, grid, act_order=settings.act_order)
    importance = None if hessian is None else torch.diag(hessian)
    return quantize_rtn(w, plan.group_size, grid, importance), None


def _rows(gq: GroupQuant | BlockQuant, a: int, b: int) -> GroupQuant | BlockQuant:
    if isinstance(gq, BlockQuant):
        return gq.rows(a, b)
    return GroupQuant(gq.codes[a:b], gq.scales[a:b], None if gq.zeros is None else gq.zeros[a:b],
                      gq.group_size)


def _cat(parts: list) -> GroupQuant | BlockQuant:
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], BlockQuant):
        return BlockQuant.cat(parts)
    return GroupQuant(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                      None if parts[0].zeros is None else torch.cat([p.zeros for p in parts]),
                      parts[0].group_size)


def _prepare(hessian: torch.Tensor, jobs: list[QuantJob], settings: QuantSettings, rank: int,
             preps: dict[int, HessianPrep]) -> bool:
    """Factor ``hessian`` into ``preps``; False when no damping makes it factor (its jobs then
    take the weighted scale search without GPTQ, with a one-line warning from rank 0). A
    Hessian holding Inf or NaN is refused: the model overflowed on the calibration text."""
    names = [j.plan.name for j in jobs if j.hessian is hessian]
    if not bool(torch.isfinite(hessian).all()):
        raise CpuQuantError(f"{names[0]}: its calibration inputs are not finite (Inf or NaN in "
                            "its Hessian): the model overflows on the calibration text")
    try:
        preps[id(hessian)] = prepare_hessian(hessian, act_order=settings.act_order,
                                             damp=settings.damp)
    except HessianNotPositiveDefinite as exc:
        if rank == 0:
            logger.warning(f"warning: {', '.join(names)}: {exc}; quantized by round-to-nearest "
                           "with the weighted scale search, without GPTQ (recorded in the "
                           "report as gptq_fallback rtn)")
        return False
    return True


def quantize_linears(jobs: list[QuantJob], settings: QuantSettings, grid: GridSpec,
                     share: RowShare = LOCAL_ROWS) -> list[tuple[GroupQuant, TensorReport]]:
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
        key = (id(job.hessian), job.plan.group_size, job.plan.grid, job.weight.shape[1],
               job.weight.dtype, job.fallback)
        stacks.setdefault(key, []).append(j)
    stacked = [(members, jobs[members[0]], torch.cat([jobs[j].weight for j in members])
                if len(members) > 1 else jobs[members[0]].weight) for members in stacks.values()]
    pieces = [p for s, (_, _, w) in enumerate(stacked) for p in share.cut(s, w.shape[0])]
    mine = [p for p in pieces if p.owner == share.rank]

    def size(piece: Piece) -> int:
        return (piece.r1 - piece.r0) * stacked[piece.stack][2].shape[1]

    # each distinct Hessian's Cholesky once, on every thread
    preps: dict[int, HessianPrep] = {}
    to_rtn: set[int] = set()  # Hessians no damping makes factor: their jobs go to RTN
    if settings.method == "gptq":
        for _, lead, _ in stacked:
            if (lead.hessian is not None and lead.fallback is None
                    and id(lead.hessian) not in preps.keys() | to_rtn):
                if not _prepare(lead.hessian, jobs, settings, share.rank, preps):
                    to_rtn.add(id(lead.hessian))

    def prep_of(lead: QuantJob) -> HessianPrep | None:
        if lead.hessian is None or lead.fallback is not None:
            return None
        return preps.get(id(lead.hessian))

    def run(piece: Piece):
        _, lead, w = stacked[piece.stack]
        gq, _ = _quantize_rows(w[piece.r0:piece.r1], lead.plan, lead.hessian, settings, grid,
                               prep_of(lead))
        return piece, gq

    order = sorted(mine, key=size, reverse=True)
    workers = max(1, min(torch.get_num_threads(), len(mine)))
    with torch_threads(1):
        if workers == 1:
            results = dict(map(run, order))
        else:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cpu-quant")
            try:
                results = dict(pool.map(run, order))
            finally:  # a stop (Ctrl-C) drops the blocks not yet started
                pool.shutdown(wait=True, cancel_futures=True)
    def empty(piece: Piece) -> GroupQuant:
        _, lead, w = stacked[piece.stack]
        k = w.shape[1]
        g = k if lead.plan.group_size == -1 else lead.plan.group_size
        shape = (piece.r1 - piece.r0, k // g)
        return GroupQuant(torch.empty(piece.r1 - piece.r0, k, dtype=torch.uint8),
                          torch.empty(shape), None if grid.symmetric else torch.empty(shape), g)

    results = share.exchange(pieces, results, empty)
    out: dict[int, tuple[GroupQuant, TensorReport]] = {}
    for s, (members, lead, _) in enumerate(stacked):
        gq = _cat([results[p] for p in pieces if p.stack == s])
        prep = prep_of(lead)
        stats = None if prep is None else GPTQStats(prep.damp, prep.damp_raised, prep.fallback)
        if lead.hessian is not None and id(lead.hessian) in to_rtn:
            stats = GPTQStats(None, True, "rtn")
        if lead.fallback is not None and settings.method == "gptq":
            stats = GPTQStats(None, False, lead.fallback)
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
                                         bool(stats and stats.damp_raised),
                                         stats.fallback if stats else None))
            a = b
    return [out[j] for j in range(len(jobs))]
