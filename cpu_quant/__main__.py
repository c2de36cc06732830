"""``python -m cpu_quant``: the same command line as ``cpu-quant``."""

from .cli.launcher import die_with_launcher

die_with_launcher()  # before the imports of a rank's first seconds

from .cli.group import main  # noqa: E402

if __name__ == "__main__":
    main(prog_name="cpu-quant")
