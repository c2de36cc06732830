"""Benchmarks for cpu-quant: ``python -m benchmarks run SUITE [--passes N] [--smoke] [--out DIR]``.

The harness (``harness.py``) enforces the rules of ``MEASURING.md``: interleaved arms with the
order rotated every pass, at least three passes, median and spread, a "no difference" verdict,
per-metric direction, failed passes kept, and provenance in every result file.
"""
