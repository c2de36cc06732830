"""``cpu-quant gptq --nproc P``: the ranks of a distributed run started on this host.

The ranks are started by PyTorch's own launcher, in this process: the elastic agent that
``torchrun --standalone --nproc-per-node P`` runs (a c10d rendezvous on a free local port,
gloo between the ranks). Each rank is ``python -m cpu_quant`` with this command's arguments
(``--threads`` added when not given: this host's CPUs shared out), and joins the run as
``quantize/distributed.py`` describes; ``CPU_QUANT_LAUNCHER`` records who started it.

:func:`check_nproc` refuses, before any process starts, more ranks than the calibration
batches can feed or than :data:`MAX_RANKS_PER_CPU` per CPU. Each rank asks the kernel to
SIGKILL it when the process that started it ends (:func:`die_with_launcher`), so a launcher
that is killed, or whose launch fails half-way, leaves no rank running on its own (and no rank
that could still finish writing DST after the run was reported failed).

When a rank fails, the agent stops the others (SIGTERM, then SIGKILL after
:data:`SHUTDOWN_SECONDS`). The ranks print the stop's one line themselves (the first to
claim it), so this process stays silent, and speaks only when no rank could: every rank
ended by a signal. The agent's own log lines are silenced.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid

import click

from ..core.errors import CpuQuantError
from ..core.process import die_with

SHUTDOWN_SECONDS = 10  # a stopped run's other ranks: SIGTERM, then SIGKILL after this
LAUNCHER_NAME = "cpu-quant --nproc"
LAUNCHER_PID_ENV = "CPU_QUANT_LAUNCHER_PID"  # the process a rank dies with
# Ranks beyond this many per CPU only time-share the CPUs, each holding its own layer and
# activations; it still lets a 1-CPU test machine run the 2-, 3- and 4-rank runs.
MAX_RANKS_PER_CPU = 4


def host_cpus() -> int:
    """The CPUs this process may run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cpus or 1


def rank_threads(nproc: int) -> int:
    """Torch threads per rank when ``--threads`` is not given: this host's CPUs shared out."""
    return max(1, host_cpus() // nproc)


def check_nproc(nproc: int, samples: int, batch_size: int, calibrated: bool) -> None:
    """Refuse, before any rank starts, a number of ranks this host or the calibration cannot
    give work to (``calibrated``: the run reads calibration batches)."""
    cpus = host_cpus()
    if nproc > MAX_RANKS_PER_CPU * cpus:
        raise CpuQuantError(f"--nproc {nproc} is more than {MAX_RANKS_PER_CPU} ranks per CPU "
                            f"of the {cpus} this process may use: give at most "
                            f"{MAX_RANKS_PER_CPU * cpus}")
    if calibrated and samples >= 1 and batch_size >= 1:
        batches = -(-samples // batch_size)
        if nproc > batches:  # the ranks would start only to refuse it (Team.check_batches)
            raise CpuQuantError(f"{nproc} ranks need at least {nproc} calibration batches, "
                                f"there are {batches}: raise --samples or lower --batch-size")


def die_with_launcher() -> None:
    """In a rank started by ``--nproc``: have the kernel SIGKILL this process when the
    launcher ends, however it ends (a SIGKILL to it included: the elastic agent then cannot
    stop its ranks itself, and they run in sessions of their own). Nothing elsewhere."""
    launcher = os.environ.pop(LAUNCHER_PID_ENV, "")  # not for this rank's own children
    if launcher.isdigit():
        die_with(int(launcher))


def launch_ranks(nproc: int, argv: list[str], threads: int | None) -> int:
    """Run ``cpu-quant ARGV`` as ``nproc`` ranks on this host; the exit status of the run."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    args = list(argv)
    if threads is None:
        args += ["--threads", str(rank_threads(nproc))]
    from ..quantize.distributed import LAUNCHER_ENV

    os.environ[LAUNCHER_ENV] = LAUNCHER_NAME
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks' environment is copied from ours
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                          shutdown_timeout=SHUTDOWN_SECONDS)
    try:
        elastic_launch(config, entrypoint=sys.executable)("-m", "cpu_quant", *args)
    except ChildFailedError as exc:
        return _failed(exc.failures)
    except SignalException as exc:  # Ctrl-C or SIGTERM to this process: the ranks say where
        return 128 + int(exc.sigval)
    except (OSError, RuntimeError) as exc:  # e.g. no more processes or files: the ranks
        # already started die with this process (die_with_launcher)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CpuQuantError(f"could not start {nproc} ranks: {first}") from None
    finally:
        os.environ.pop(LAUNCHER_PID_ENV, None)
    return 0


def _failed(failures: dict) -> int:
    """The run's exit status; one line of our own only if every rank ended by a signal."""
    codes = [f.exitcode for f in failures.values()]
    spoke = [c for c in codes if c > 0]
    if spoke:
        return max(spoke)
    rank, first = min(failures.items(), key=lambda kv: kv[1].timestamp)
    name = signal.Signals(-first.exitcode).name if first.exitcode < 0 else str(first.exitcode)
    click.echo(f"error: rank {rank} (pid {first.pid}) was killed by {name} and no rank could "
               "report it; run the same command with --resume to continue from the last "
               "completed layer, if any", err=True)
    return 1
