"""The conventions every ``cpu-quant`` command shares, defined once.

* ``--json``: one JSON document on stdout and nothing else there; progress bars, notes and the
  human summary go to stderr. The same flag and the same meaning on every command.
* ``--threads N``: ``torch.set_num_threads(N)`` before any work (recorded in the provenance).
* ``-q``/``--quiet``: no progress bars and no notes; ``-v``/``--verbose``: every note and the
  library's debug log.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import click

from ..core.errors import CpuQuantError, Interrupted


def require_working_directory() -> None:
    """Exit with one line when this process's working directory was deleted: torch's MKL
    cannot load from there (it aborts with a fatal error of its own), and a default output
    path would have nowhere to go. Called before anything imports torch."""
    import os

    try:
        os.getcwd()
    except FileNotFoundError:
        click.echo("error: the working directory no longer exists (it was deleted): run "
                   "cpu-quant from an existing directory", err=True)
        sys.exit(2)


def exit_on_next_signal(status: int) -> None:
    """The command is on its way out with ``status``: a further Ctrl-C or SIGTERM ends the
    process at once with that status, never by the signal (Python's own death by SIGINT when
    a KeyboardInterrupt escapes at exit) nor with a traceback."""
    import os
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum, frame) -> None:
        sys.stderr.flush()
        os._exit(status)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, leave)


JSON_HELP = ("Print a machine-readable summary as one JSON document on stdout, and nothing else "
             "there (progress and notes go to stderr).")


def json_option(fn: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help=JSON_HELP)(fn)


OVERWRITE_HELP = ("Replace the output when it is a cpu-quant artifact or an empty directory "
                  "(swapped in atomically).")


def overwrite_option(fn: Callable) -> Callable:
    return click.option("--overwrite", is_flag=True, help=OVERWRITE_HELP)(fn)


def run_options(fn: Callable) -> Callable:
    """``--json``, ``--threads``, ``-q`` and ``-v``: for the commands that quantize or evaluate."""
    options = [
        json_option,
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="Torch threads (torch.set_num_threads); default: torch's own choice."),
        click.option("-q", "--quiet", is_flag=True, help="No progress bars and no notes."),
        click.option("-v", "--verbose", is_flag=True, help="Every note, and the debug log."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@dataclass
class RunConventions:
    as_json: bool = False
    threads: int | None = None
    quiet: bool = False
    verbose: bool = False

    @classmethod
    def take(cls, opts: dict) -> RunConventions:
        """Remove the convention options from a command's ``opts`` and apply them."""
        conv = cls(opts.pop("as_json", False), opts.pop("threads", None),
                   opts.pop("quiet", False), opts.pop("verbose", False))
        conv.apply()
        return conv

    def apply(self) -> None:
        if self.quiet and self.verbose:
            raise CpuQuantError("-q and -v contradict each other; give one")
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)
        if self.quiet:  # -q: errors only; the one-line warnings go too
            logging.getLogger("cpu_quant").setLevel(logging.ERROR)
        if self.verbose:
            logging.basicConfig(stream=sys.stderr, level=logging.INFO)
            logging.getLogger("cpu_quant").setLevel(logging.DEBUG)

    @property
    def progress(self) -> bool:
        return not self.quiet

    def note(self, message: str) -> None:
        if not self.quiet:
            click.echo(message, err=True)


def _jsonable(obj: object) -> object:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "as_dict"):
        return obj.as_dict()
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _finite(obj: object) -> object:
    """NaN and infinities as null: strict JSON parsers reject them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def json_text(doc: object) -> str:
    return json.dumps(_finite(json.loads(json.dumps(doc, default=_jsonable))), indent=2)


@contextlib.contextmanager
def stdout_for_json(as_json: bool) -> Iterator[Callable[[object], None]]:
    """Within the block stdout goes to stderr when ``as_json``; yields ``emit(doc)``, which
    writes the one JSON document to the real stdout."""
    real = sys.stdout
    docs: list[object] = []
    if not as_json:
        yield lambda doc: None
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield docs.append
    for doc in docs:
        real.write(json_text(doc) + "\n")
    real.flush()


def no_resume_on_interrupt(what: str) -> Callable:
    """Ctrl-C in a command that has no ``--resume``: say what was lost, not how to resume.

    Apply it inside ``friendly_errors``, which prints the ``Interrupted`` error as one line."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except KeyboardInterrupt:
                raise Interrupted(f"{what} interrupted; nothing was written (run the command "
                                  "again to start over)") from None

        return wrapper

    return decorate


_DTYPE_SUFFIX = re.compile(r"[-_.](bf16|fp16|f16|fp32|f32|float16|bfloat16)$", re.I)


def default_output_name(src: Path, kind: str, method: str, group: int) -> str:
    """``<source>-<kind>[-<method>]-w4g<group>``: a trailing dtype tag of the source dropped and
    the method left out when it is the kind, so nothing repeats."""
    from ..hub import checkpoint_name

    name = checkpoint_name(Path(src))
    stem = _DTYPE_SUFFIX.sub("", name) or name
    parts = [stem, kind] + ([] if method == kind else [method]) + [f"w4g{group}"]
    return "-".join(parts)
