"""The ``cpu-quant`` command line, one module per command, each a click command added to the
group in ``group.py`` (the entry point ``cpu_quant.cli:main``). Shared pieces: the one-line
error contract and the options of the quantizing commands (``quantize_run.py``), the run
conventions every command shares (``conventions.py``), what happens after a run
(``after_run.py``) and ``--nproc``'s launcher (``launcher.py``).

Importing this package loads nothing else: a rank started by ``--nproc`` must reach
``launcher.die_with_launcher`` before its imports take seconds.

It sets one thing, before torch loads: oneMKL's strict reproducibility mode
(``MKL_CBWR=AUTO,STRICT``, unless the environment gives another), in which oneMKL documents its
GEMM and TRSM as bitwise reproducible for any thread count; the GPTQ math relies on matrix
products giving the same bits at any ``--threads`` (``quantize/factor.py``). Measured on a
2-core AMD EPYC: the same bits and the same speed as without it."""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")


def __getattr__(name: str):
    if name == "main":
        from .group import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
