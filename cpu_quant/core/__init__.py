"""The shared vocabulary of every layer: the 4-bit grid and ``GroupQuant``, verify's findings,
the naming rules of modules and ``dynamic`` overrides, the smoothing factors an artifact carries,
errors, checkpoint and artifact io, memory, and this CPU. Nothing here imports anything of the
package above it (``tests/test_layers.py``)."""

__version__ = "0.1.0"
