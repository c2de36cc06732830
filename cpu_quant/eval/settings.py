"""What an evaluation scores (:class:`EvalSettings`): the default, the full and the quick setting.

The default (``DEFAULT_EVAL``) is sized for about 2 minutes on the demo model (SmolLM2-135M,
float32) on 2 idle cores. Measured on 2 shared cores under a load average of 12, so in CPU
seconds of one thread rather than wall time: 4 windows and 4 prompts took 39 CPU-seconds
(``eval-saved-reference-20261202T143002Z.json``), one 512-token forward 1.8 s and one greedy
step for 12 prompts 0.3 s, which puts the default near 190 CPU-seconds of one thread.
``--full`` (``FULL_EVAL``) scores 4× the tokens and 2.7× the greedy tokens (about 12
CPU-minutes). The quick check that ``cpu-quant gptq`` runs at the end is
``EvalSettings.quick()``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import CpuQuantError


@dataclass
class EvalSettings:
    windows: int = 32
    seqlen: int = 512
    prompts: int = 12
    prompt_len: int = 24
    new_tokens: int = 32
    text: str | None = None  # None = built-in held-out split

    @classmethod
    def quick(cls) -> EvalSettings:
        """The short version ``cpu-quant gptq`` runs at the end."""
        return cls(windows=8, seqlen=256, prompts=12, prompt_len=16, new_tokens=32)

    def validate(self) -> None:
        for flag, value, least in (("--windows", self.windows, 1), ("--prompts", self.prompts, 1),
                                   ("--seqlen", self.seqlen, 2), ("--new-tokens", self.new_tokens, 1)):
            if value < least:
                raise CpuQuantError(f"{flag} must be >= {least} (got {value})")

    def with_overrides(self, **values) -> EvalSettings:
        """A copy with the given fields replaced, ``None`` values ignored."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})


DEFAULT_EVAL = EvalSettings()
FULL_EVAL = EvalSettings(windows=128, seqlen=512, prompts=32, prompt_len=24, new_tokens=32)
