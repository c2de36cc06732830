"""``cpu-quant gptq --nproc P``: the ranks of a distributed run started on this host.

The ranks are started by PyTorch's own launcher, in this process: the elastic agent that
``torchrun --standalone --nproc-per-node P`` runs (a c10d rendezvous on a free local port,
gloo between the ranks). Each rank is ``python -m cpu_quant`` with this command's arguments
(``--threads`` added when not given: this host's CPUs shared out), and joins the run as
``quantize/distributed.py`` describes; ``CPU_QUANT_LAUNCHER`` records who started it.

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

from .quantize.distributed import LAUNCHER_ENV

SHUTDOWN_SECONDS = 10  # a stopped run's other ranks: SIGTERM, then SIGKILL after this
LAUNCHER_NAME = "cpu-quant --nproc"


def rank_threads(nproc: int) -> int:
    """Torch threads per rank when ``--threads`` is not given: this host's CPUs shared out."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // nproc)


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
    os.environ[LAUNCHER_ENV] = LAUNCHER_NAME
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
