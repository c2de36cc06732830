"""Phone export (``cpu-quant export-phone``): verified ExecuTorch programs.

* ``graph``: the exported graph's calling convention (static shapes, one call's inputs);
* ``model``: the static-KV-cache decoder built from a Llama-family checkpoint;
* ``runner``: the host loop (masks, positions, cache writes, greedy decoding) shared by eager
  graphs and ``.pte`` methods;
* ``qnn``: w8a16 with ExecuTorch's Qualcomm quantizer, calibration, portable/HTP lowering;
* ``xnnpack``: 8da8w / 8da4w for phone CPUs, and the int8 weight-only probe;
* ``verify``: the ``.pte`` against its quantized eager graph and float, with the tolerance;
* ``report``: ``export_report.json`` (op counts, sizes, provenance);
* ``pipeline``: ``export_phone(src, out, PhoneExportSettings(...))`` (the command line's
  ``export-phone`` is ``cpu_quant.cli.export_phone``).

Nothing here is imported by the package root: executorch and torchao (the ``phone`` extra)
are only loaded when an export runs.
"""
