"""Every block-grid quant type this package writes, registered (``blocks.QUANT_TYPES``)."""

from . import iq4_nl, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0  # noqa: F401  (registration)
from .blocks import QUANT_TYPES

NAMES = tuple(sorted(t.name for t in QUANT_TYPES.values()))
