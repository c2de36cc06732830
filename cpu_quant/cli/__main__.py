"""``python -m cpu_quant.cli``: the same command line as ``cpu-quant``."""

from .group import main

if __name__ == "__main__":
    main(prog_name="cpu-quant")
