"""What an evaluation scores (:class:`EvalSettings`): the default, the full and the quick setting.

The default (``DEFAULT_EVAL``) takes about 2 minutes on the demo model (SmolLM2-135M) on 2
idle cores: 98 s wall and 183 CPU-seconds, the median of 3 passes of the whole command with the
bf16 reference run afresh (the ``eval`` benchmark suite, ``eval-20261202T211940Z.json``).
``--full`` (``FULL_EVAL``) scores 4× the tokens and 2.7× the greedy tokens (not measured; by
its size, about 4× the default's work). The quick check that ``cpu-quant gptq`` runs at the end
is ``EvalSettings.quick()``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.errors import CpuQuantError


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
