"""The ``cpu-quant`` command line, one module per command, each a click command added to the
group in ``group.py`` (the entry point ``cpu_quant.cli:main``). Shared pieces: the one-line
error contract and the options of the quantizing commands (``quantize_run.py``), the run
conventions every command shares (``conventions.py``), what happens after a run
(``after_run.py``) and ``--nproc``'s launcher (``launcher.py``).

Importing this package loads nothing else: a rank started by ``--nproc`` must reach
``launcher.die_with_launcher`` before its imports take seconds."""


def __getattr__(name: str):
    if name == "main":
        from .group import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
