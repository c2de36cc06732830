"""Fidelity of a quantized artifact against its bf16 source, on held-out text.

Three faces (``shared/MEASURING.md``), all on the held-out split, never calibration text:

* mean KL(bf16 ‖ quant) of the next-token distributions over ``windows × seqlen`` positions,
  plus the perplexity of each model;
* top-1 agreement of the next-token argmax;
* greedy reproduction: ``prompts`` prompts of ``prompt_len`` held-out tokens, each continued
  greedily for ``new_tokens`` tokens by both models; we report the mean fraction of the
  continuation reproduced before the first divergence, and how many match exactly.

Variants: ``weights`` runs the dequantized weights with bf16/float activations (what
``cpu_gemm_wna16`` computes); ``w4a8_emulated`` also quantizes every linear's input to int8 per
token, as vLLM's AMX kernel ``int4_scaled_mm_cpu`` does (emulated: this machine has no AMX).

Both models are torch models; the quantized one holds the artifact's dequantized weights
(``dequantized.load_model``). Computation is float32 unless asked otherwise.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data.corpus import load_texts, token_windows
from ..errors import CpuQuantError
from ..io.checkpoint import load_tokenizer, model_context, open_checkpoint


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
        """The short version ``cpu-quant gptq`` runs at the end (well under a minute here)."""
        return cls(windows=8, seqlen=256, prompts=12, prompt_len=16, new_tokens=32)

    def validate(self) -> None:
        for flag, value, least in (("--windows", self.windows, 1), ("--prompts", self.prompts, 1),
                                   ("--seqlen", self.seqlen, 2), ("--new-tokens", self.new_tokens, 1)):
            if value < least:
                raise CpuQuantError(f"{flag} must be >= {least} (got {value})")


@dataclass
class FidelityReport:
    kl_mean: float
    ppl_reference: float
    ppl_quantized: float
    ppl_delta: float
    top1_agreement: float
    greedy_prefix_fraction: float
    greedy_exact: int
    greedy_prompts: int
    tokens: int
    settings: dict = field(default_factory=dict)
    greedy_examples: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _eval_windows(tokenizer, settings: EvalSettings) -> tuple[torch.Tensor, torch.Tensor]:
    texts = load_texts(settings.text, "heldout") if settings.text else load_texts(None, "heldout")
    total = settings.windows + settings.prompts
    wins = token_windows(tokenizer, texts, total, max(settings.seqlen, settings.prompt_len))
    # every k-th window is a prompt, so both prompts and scored windows span all novels
    k = max(total // settings.prompts, 1)
    prompt_idx = set(range(k - 1, total, k)[: settings.prompts])
    scored = [w[: settings.seqlen] for i, w in enumerate(wins) if i not in prompt_idx]
    prompts = [w[: settings.prompt_len] for i, w in enumerate(wins) if i in prompt_idx]
    return torch.tensor(scored), torch.tensor(prompts)


@torch.no_grad()
def _greedy(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model(input_ids=prompts, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1)
    generated = [nxt]
    for _ in range(new_tokens - 1):
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
        generated.append(nxt)
    return torch.stack(generated, 1)


def _int8_per_token(module, inputs):
    """Fake-quantize a linear's input the way vLLM's W4A8 kernel does before its int8 GEMM.

    ``int4_scaled_mm_cpu`` (sgl-kernel's AMX W4A8 GEMM in vLLM's CPU build) quantizes each
    activation row dynamically to int8 with one scale per row (amax / 127) before multiplying
    with the int4 weights. This machine has no AMX, so we emulate it in torch.
    """
    x = inputs[0]
    scale = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / 127.0
    xq = torch.clamp(torch.round(x.float() / scale), -127, 127) * scale
    return (xq.to(x.dtype),) + tuple(inputs[1:])


@contextmanager
def w4a8_activations(model):
    """Within the block, every linear layer of ``model`` sees int8-per-token activations."""
    handles = [m.register_forward_pre_hook(_int8_per_token) for m in model.modules()
               if isinstance(m, torch.nn.Linear)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


VARIANTS = {"weights": nullcontext, "w4a8_emulated": w4a8_activations}


def _finite(logprobs: torch.Tensor, which: str) -> torch.Tensor:
    """NaN or Inf logits (from non-finite weights) would make every metric NaN: refuse."""
    if not bool(torch.isfinite(logprobs).all()):
        raise CpuQuantError(f"{which} produces NaN or Inf logits (its weights are not finite); "
                            "no fidelity can be measured")
    return logprobs


@torch.no_grad()
def compare_models(reference, quantized, tokenizer, settings: EvalSettings,
                   progress: bool = False, variants: tuple[str, ...] = ("weights",)
                   ) -> dict[str, FidelityReport]:
    """One report per variant: ``weights`` (bf16 activations) and/or ``w4a8_emulated``."""
    from tqdm import tqdm

    scored, prompts = _eval_windows(tokenizer, settings)
    acc = {v: {"kl": 0.0, "nll": 0.0, "agree": 0} for v in variants}
    nll_ref = 0.0
    count = 0
    for ids in tqdm(scored, desc="eval windows", disable=not progress):
        ids = ids[None]
        target = ids[0, 1:]
        lr = _finite(F.log_softmax(reference(input_ids=ids).logits[0, :-1].float(), -1),
                     "the reference")
        nll_ref -= float(lr.gather(-1, target[:, None]).sum())
        for v in variants:
            with VARIANTS[v](quantized):
                lq = _finite(F.log_softmax(quantized(input_ids=ids).logits[0, :-1].float(), -1),
                             "the quantized checkpoint")
            acc[v]["kl"] += float((lr.exp() * (lr - lq)).sum())
            acc[v]["nll"] -= float(lq.gather(-1, target[:, None]).sum())
            acc[v]["agree"] += int((lr.argmax(-1) == lq.argmax(-1)).sum())
        count += target.numel()
    g_ref = _greedy(reference, prompts, settings.new_tokens)
    ppl_r = math.exp(nll_ref / count)
    reports = {}
    for v in variants:
        with VARIANTS[v](quantized):
            g_q = _greedy(quantized, prompts, settings.new_tokens)
        prefix = (g_ref == g_q).int().cumprod(1).sum(1).float() / settings.new_tokens
        ppl_q = math.exp(acc[v]["nll"] / count)
        examples = [{"prompt": tokenizer.decode(p), "reference": tokenizer.decode(r),
                     "quantized": tokenizer.decode(q)}
                    for p, r, q in zip(prompts[:3], g_ref[:3], g_q[:3], strict=True)]
        reports[v] = FidelityReport(
            kl_mean=acc[v]["kl"] / count, ppl_reference=ppl_r, ppl_quantized=ppl_q,
            ppl_delta=ppl_q - ppl_r, top1_agreement=acc[v]["agree"] / count,
            greedy_prefix_fraction=float(prefix.mean()), greedy_exact=int((prefix == 1).sum()),
            greedy_prompts=len(prompts), tokens=count, settings=asdict(settings),
            greedy_examples=examples)
    return reports


def evaluate_artifact(quantized_path: str | Path, reference_path: str | Path,
                      settings: EvalSettings | None = None, progress: bool = False,
                      dtype: torch.dtype = torch.float32,
                      variants: tuple[str, ...] = ("weights",)) -> dict[str, FidelityReport]:
    from .dequantized import load_model

    settings = settings or EvalSettings()
    settings.validate()
    for label, path in (("quantized checkpoint", quantized_path), ("--reference", reference_path)):
        if not Path(path).is_dir():
            raise CpuQuantError(f"{label} {path} is not a directory")
        if not (Path(path) / "config.json").is_file():
            raise CpuQuantError(f"{label} {path} has no config.json")
    context = model_context(open_checkpoint(reference_path).config)
    if context is not None and settings.seqlen > context:
        raise CpuQuantError(f"--seqlen {settings.seqlen} is beyond the model's context of "
                            f"{context} tokens (max_position_embeddings)")
    tok = load_tokenizer(reference_path)
    reference = load_model(reference_path, dtype)
    quantized = load_model(quantized_path, dtype)
    return compare_models(reference, quantized, tok, settings, progress, variants)
