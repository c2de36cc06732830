"""What an evaluation scores (:class:`EvalSettings`): the default, the full and the quick setting.

Measured on the demo model (SmolLM2-135M, float32, 2 shared cores under load, 2026-12-02):
the default (``DEFAULT_EVAL``) takes about 2 minutes for the ``weights`` variant; ``--full``
(``FULL_EVAL``) scores 4x the tokens and 2.7x the greedy tokens; the quick check that
``cpu-quant gptq`` runs at the end is ``EvalSettings.quick()``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class EvalSettings:
    windows: int = 16
    seqlen: int = 512
    prompts: int = 12
    prompt_len: int = 24
    new_tokens: int = 32
    text: str | None = None  # None = built-in held-out split

    @classmethod
    def quick(cls) -> EvalSettings:
        """The short version ``cpu-quant gptq`` runs at the end."""
        return cls(windows=8, seqlen=256, prompts=12, prompt_len=16, new_tokens=32)

    def with_overrides(self, **values) -> EvalSettings:
        """A copy with the given fields replaced, ``None`` values ignored."""
        return replace(self, **{k: v for k, v in values.items() if v is not None})


DEFAULT_EVAL = EvalSettings()
FULL_EVAL = EvalSettings(windows=64, seqlen=512, prompts=32, prompt_len=24, new_tokens=32)
