"""A child process that must not outlive the process that started it.

:func:`die_with` asks the kernel to SIGKILL the calling process when its parent ends, however
the parent ends (a SIGKILL to it included, when it can do nothing itself), and kills the caller
at once if the parent is already gone. Used by the ranks that ``cpu-quant gptq --nproc`` starts
and by the GPTQ run that ``export-phone`` spawns: neither may go on computing, or writing into
a directory, after the command that wanted its result has ended. :func:`dies_with_this_process`
asks the same for a child that cannot call it itself (any program), at its start.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(parent: int) -> None:
    """SIGKILL this process when ``parent``, its parent process, ends (Linux; elsewhere
    nothing)."""
    if sys.platform.startswith("linux"):
        _death_request(parent)()


def dies_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the child is SIGKILLed when the process
    that starts it ends, as :func:`die_with` does (None where that is not available). It runs
    between fork and exec, so it calls only what is resolved here, before the fork. Start the
    child from the thread that lives as long as the process: the kernel watches the thread
    that forked."""
    return _death_request(os.getpid()) if sys.platform.startswith("linux") else None


def _death_request(parent: int) -> Callable[[], None]:
    """The request, made by the process to be killed: SIGKILL when its parent ends, and at once
    if ``parent`` is no longer its parent (it ended before the request was made)."""
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    kill = int(signal.SIGKILL)

    def request() -> None:
        prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), kill)

    return request
