"""``python -m cpu_quant``: the same command line as ``cpu-quant``."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="cpu-quant")
