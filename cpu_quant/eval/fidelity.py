"""Fidelity of a quantized artifact against its bf16 source, on held-out text.

Three faces (``shared/MEASURING.md``), all on the held-out split, never calibration text:

* KL(bf16 ‖ quant) of the next-token distributions over ``windows × seqlen`` positions (mean
  ± standard error, median, p90, p99, max), plus the perplexity of each model ± its error;
* same top-1 (the next-token argmaxes agree) ± its error (``stats.py``);
* greedy reproduction: ``prompts`` prompts of ``prompt_len`` held-out tokens, each continued
  greedily for ``new_tokens`` tokens by both models; we report the mean fraction of the
  continuation reproduced before the first divergence, and how many match exactly.

Variants: ``weights`` runs the dequantized weights with bf16/float activations (what
``cpu_gemm_wna16`` computes); ``w4a8_emulated`` also quantizes every linear's input to int8 per
token, as vLLM's AMX kernel ``int4_scaled_mm_cpu`` does (emulated in torch; on an AMX CPU the
emulation and the kernel agree after bf16 output rounding, which a test checks).

Both models are torch models; the quantized one holds the artifact's dequantized weights
(``dequantized.load_model``). Computation is float32 unless asked otherwise. The reference's
side comes from the model (``FreshReference``) or from a file that ``--save-reference`` wrote
(``StoredReference``, ``reference_logits.py``): the same full-vocabulary KL either way.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ..core.errors import CpuQuantError
from ..core.io.checkpoint import load_tokenizer, model_context, open_checkpoint
from ..data.corpus import token_windows
from ..data.mix import builtin_text, check_heldout, heldout_texts
from ..quantize.hessians import int8_per_token
from . import stats
from .reference_logits import (
    ExactWindow,
    SavedReference,
    WindowReference,
    check_factored,
    load_reference,
    save_reference,
    text_fingerprint,
)
from .reference_logits import (
    save_reference as save_reference_file,  # evaluate_artifact's parameter takes the name
)
from .settings import DEFAULT_EVAL, FULL_EVAL, EvalSettings  # noqa: F401  (re-exported)


@dataclass
class FidelityReport:
    """One variant's fidelity. Errors are standard errors (``stats.py``); ``kl_source`` says
    whether the reference ran or came from a saved file (``reference_logits``)."""

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
    kl_stderr: float = math.nan
    kl_median: float = math.nan
    kl_p90: float = math.nan
    kl_p99: float = math.nan
    kl_max: float = math.nan
    ppl_reference_stderr: float = math.nan
    ppl_quantized_stderr: float = math.nan
    ppl_delta_stderr: float = math.nan
    top1_stderr: float = math.nan
    kl_histogram: dict = field(default_factory=dict)
    kl_source: str = "full"

    def as_dict(self) -> dict:
        return asdict(self)


def _heldout_texts(settings: EvalSettings, tokenizer) -> list[str]:
    """``--text``: the Austen held-out split, a held-out domain (``data.mix.HELDOUT``, dialogue
    in ``tokenizer``'s chat template) or a file."""
    return heldout_texts(settings.text, tokenizer)


def _eval_windows(tokenizer, settings: EvalSettings, texts: list[str] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    texts = texts if texts is not None else _heldout_texts(settings, tokenizer)
    cache = builtin_text(settings.text)  # texts: settings.text's, the callers' as well
    total = settings.windows + settings.prompts
    wins = token_windows(tokenizer, texts, total, max(settings.seqlen, settings.prompt_len),
                         cache=cache)
    # every k-th window is a prompt, so both prompts and scored windows span all novels
    k = max(total // settings.prompts, 1)
    prompt_idx = set(range(k - 1, total, k)[: settings.prompts])
    scored = [w[: settings.seqlen] for i, w in enumerate(wins) if i not in prompt_idx]
    prompts = [w[: settings.prompt_len] for i, w in enumerate(wins) if i in prompt_idx]
    return torch.tensor(scored), torch.tensor(prompts)


@torch.no_grad()
def _greedy(model, prompts: torch.Tensor, new_tokens: int, progress: bool = False,
            desc: str = "greedy") -> torch.Tensor:
    from tqdm import tqdm

    bar = tqdm(total=new_tokens, desc=desc, unit="tok", disable=not progress, leave=False)
    out = model(input_ids=prompts, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1)
    generated = [nxt]
    bar.update()
    for _ in range(new_tokens - 1):
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
        generated.append(nxt)
        bar.update()
    bar.close()
    return torch.stack(generated, 1)


def _w4a8_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module`` as vLLM's W4A8 kernel computes it: the input quantized to int8 per token
    (``quantize.hessians.int8_per_token``) and multiplied by the weights in float32, the output
    in the input's dtype. With float32 weights (``eval``'s default) this gives
    ``int4_scaled_mm_cpu``'s outputs exactly once both are in bf16 (tested on an AMX CPU); a bf16
    model's weights are the dequantized ones rounded to bf16, the only difference left."""
    bias = None if module.bias is None else module.bias.float()
    return F.linear(int8_per_token(x.float()), module.weight.float(), bias).to(x.dtype)


@contextmanager
def w4a8_activations(model):
    """Within the block, every linear layer of ``model`` computes as the W4A8 kernel does."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in linears:
        m.forward = partial(_w4a8_linear, m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


VARIANTS = {"weights": nullcontext, "w4a8_emulated": w4a8_activations}


class FreshReference:
    """Runs the reference model; with ``keep`` it also keeps what ``--save-reference`` stores
    (the output head's input per position: ``reference_logits``)."""

    def __init__(self, model, keep: bool = False) -> None:
        self.model = model
        self.keep = keep
        self.kept: list[WindowReference] = []
        self.greedy_tokens: torch.Tensor | None = None

    def window(self, i: int, ids: torch.Tensor) -> ExactWindow:
        head = self.model.get_output_embeddings()
        captured: list[torch.Tensor] = []
        hook = (head.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
                if self.keep else None)
        try:
            logits = self.model(input_ids=ids[None]).logits[0, :-1].float()
        finally:
            if hook is not None:
                hook.remove()
        window = ExactWindow(_finite(F.log_softmax(logits, -1), "the reference"), ids[1:])
        if self.keep:
            kept = WindowReference(captured[-1][0, :-1].float().clone(), head.weight.detach(),
                                   torch.logsumexp(logits, -1), window.nll)
            if i == 0:
                check_factored(kept, logits, "--save-reference")
            self.kept.append(kept)
        return window

    def greedy(self, prompts: torch.Tensor, new_tokens: int, progress: bool) -> torch.Tensor:
        self.greedy_tokens = _greedy(self.model, prompts, new_tokens, progress, "greedy (reference)")
        return self.greedy_tokens


class StoredReference:
    """The reference's side read from a ``--reference-logits`` file: no reference model runs."""

    def __init__(self, saved: SavedReference) -> None:
        self.saved = saved

    def window(self, i: int, ids: torch.Tensor) -> ExactWindow:
        return self.saved.per_window[i].scored()

    def greedy(self, prompts: torch.Tensor, new_tokens: int, progress: bool) -> torch.Tensor:
        return self.saved.greedy


def _variant_report(kl: torch.Tensor, nll_q: torch.Tensor, nll_r: torch.Tensor,
                    agree: torch.Tensor, prefix: torch.Tensor, examples: list[dict],
                    settings: EvalSettings, kl_source: str) -> FidelityReport:
    kls = stats.kl_summary(kl)
    ppl_r, ppl_q = stats.perplexity(nll_r), stats.perplexity(nll_q)
    delta = stats.perplexity_delta(nll_q, nll_r)
    top1 = stats.proportion(agree)
    return FidelityReport(
        kl_mean=kls["mean"], ppl_reference=ppl_r.value, ppl_quantized=ppl_q.value,
        ppl_delta=delta.value, top1_agreement=top1.value,
        greedy_prefix_fraction=float(prefix.mean()), greedy_exact=int((prefix == 1).sum()),
        greedy_prompts=prefix.numel(), tokens=kl.numel(), settings=asdict(settings),
        greedy_examples=examples, kl_stderr=kls["stderr"], kl_median=kls["median"],
        kl_p90=kls["p90"], kl_p99=kls["p99"], kl_max=kls["max"],
        ppl_reference_stderr=ppl_r.stderr, ppl_quantized_stderr=ppl_q.stderr,
        ppl_delta_stderr=delta.stderr, top1_stderr=top1.stderr,
        kl_histogram=stats.kl_histogram(kl), kl_source=kl_source)


@torch.no_grad()
def score_against(reference: FreshReference | StoredReference, quantized, tokenizer,
                  scored: torch.Tensor, prompts: torch.Tensor, settings: EvalSettings,
                  progress: bool = False, variants: tuple[str, ...] = ("weights",)
                  ) -> dict[str, FidelityReport]:
    """One report per variant, the reference's side coming from a model or a saved file."""
    from tqdm import tqdm

    per = {v: {"kl": [], "nll": [], "agree": []} for v in variants}
    nll_ref = []
    for i, ids in enumerate(tqdm(scored, desc="eval windows", unit="win", disable=not progress)):
        ref = reference.window(i, ids)
        nll_ref.append(ref.nll)
        target = ids[1:]
        for v in variants:
            with VARIANTS[v](quantized):
                lq = _finite(F.log_softmax(quantized(input_ids=ids[None]).logits[0, :-1].float(),
                                           -1), "the quantized checkpoint")
            per[v]["kl"].append(ref.kl(lq))
            per[v]["nll"].append(-lq.gather(-1, target[:, None])[:, 0])
            per[v]["agree"].append(ref.argmax == lq.argmax(-1))
    g_ref = reference.greedy(prompts, settings.new_tokens, progress)
    kl_source = ("full, from the saved reference" if isinstance(reference, StoredReference)
                 else "full")
    reports = {}
    for v in variants:
        with VARIANTS[v](quantized):
            g_q = _greedy(quantized, prompts, settings.new_tokens, progress, f"greedy ({v})")
        prefix = (g_ref == g_q).int().cumprod(1).sum(1).float() / settings.new_tokens
        examples = [{"prompt": tokenizer.decode(p), "reference": tokenizer.decode(r),
                     "quantized": tokenizer.decode(q)}
                    for p, r, q in zip(prompts[:3], g_ref[:3], g_q[:3], strict=True)]
        reports[v] = _variant_report(torch.cat(per[v]["kl"]), torch.cat(per[v]["nll"]),
                                     torch.cat(nll_ref), torch.cat(per[v]["agree"]), prefix,
                                     examples, settings, kl_source)
    return reports


def compare_models(reference, quantized, tokenizer, settings: EvalSettings,
                   progress: bool = False, variants: tuple[str, ...] = ("weights",)
                   ) -> dict[str, FidelityReport]:
    """One report per variant: ``weights`` (bf16 activations) and/or ``w4a8_emulated``."""
    scored, prompts = _eval_windows(tokenizer, settings)
    return score_against(FreshReference(reference), quantized, tokenizer, scored, prompts,
                         settings, progress, variants)


def _finite(logprobs: torch.Tensor, which: str) -> torch.Tensor:
    """NaN or Inf logits (from non-finite weights) would make every metric NaN: refuse."""
    if not bool(torch.isfinite(logprobs).all()):
        raise CpuQuantError(f"{which} produces NaN or Inf logits (its weights are not finite); "
                            "no fidelity can be measured")
    return logprobs


def _check_checkpoint(label: str, path: str | Path, settings: EvalSettings,
                      float_weights: bool = False) -> None:
    """Before any work: the checkpoint opens (its config, headers and index are sound), a float
    model where one is expected (``float_weights``: the reference) loads, and the windows fit
    its context."""
    from .dequantized import check_float_model

    try:
        ckpt = open_checkpoint(path)
        if float_weights:
            check_float_model(ckpt)
    except CpuQuantError as exc:
        raise CpuQuantError(f"{label}: {exc}") from None
    ckpt.close()
    context = model_context(ckpt.config)
    if context is not None and max(settings.seqlen, settings.prompt_len + settings.new_tokens) > context:
        raise CpuQuantError(f"--seqlen {settings.seqlen} is beyond the context of {label} "
                            f"{path}, {context} tokens (max_position_embeddings)")


def check_consistent(path: str | Path) -> None:
    """A quantized checkpoint that verify finds damaged (scales that disagree with the config's
    group, a missing or mis-typed tensor, a bad dynamic rule, a non-finite scale) is refused,
    not scored."""
    if ("quantization_config" not in open_checkpoint(path).config
            and not (Path(path) / "quantize_config.json").is_file()):
        return  # a float model: nothing quantized to check
    from ..verify.checks import damage

    why = damage(path)
    if why:
        raise CpuQuantError(f"QUANT {path} fails verify ({why}); `cpu-quant verify {path}` "
                            "lists what is wrong")


def _load_tokenizer(path: str | Path):
    return load_tokenizer(path)


def _loading(progress: bool, what: str):
    if progress:
        import sys

        print(f"loading {what} ...", file=sys.stderr, flush=True)


def save_reference_logits(reference_path: str | Path, path: str | Path,
                          settings: EvalSettings | None = None, progress: bool = False,
                          dtype: torch.dtype = torch.float32) -> int:
    """Run only the reference and save its side of the evaluation (``reference_logits``)."""
    settings = settings or EvalSettings()
    settings.validate()
    _check_checkpoint("--reference", reference_path, settings, float_weights=True)
    check_heldout(settings.text)
    tok = _load_tokenizer(reference_path)
    texts = _heldout_texts(settings, tok)
    scored, prompts = _eval_windows(tok, settings, texts)
    ref = _run_reference(reference_path, scored, prompts, texts, settings, dtype, progress)
    return save_reference(path, ref)


def _run_reference(reference_path, scored, prompts, texts, settings: EvalSettings,
                   dtype: torch.dtype, progress: bool) -> SavedReference:
    """The reference's side of the evaluation, its model freed once it has run."""
    from tqdm import tqdm

    from .dequantized import load_model

    _loading(progress, f"the reference {reference_path}")
    ref = FreshReference(load_model(reference_path, dtype), keep=True)
    with torch.no_grad():
        for i, ids in enumerate(tqdm(scored, desc="reference windows", unit="win",
                                     disable=not progress)):
            ref.window(i, ids)
        ref.greedy(prompts, settings.new_tokens, progress)
    return _saved(ref, scored, prompts, texts, settings, reference_path)


def _saved(ref: FreshReference, scored, prompts, texts, settings, reference_path) -> SavedReference:
    return SavedReference(scored, prompts, ref.greedy_tokens, ref.kept,
                          text_fingerprint(texts), asdict(settings), str(reference_path))


def _write_saved(path, ref: FreshReference, scored, prompts, texts, settings, reference_path) -> int:
    return save_reference(path, _saved(ref, scored, prompts, texts, settings, reference_path))


# what a model in memory needs beside its weights (activations, logits over the vocabulary)
MODEL_HEADROOM = 1.25


def model_bytes(path: str | Path, dtype: torch.dtype) -> int:
    """The bytes of ``path``'s model loaded in ``dtype`` (a quantized one dequantized, its
    head untied), from the tensor shapes alone."""
    import math

    from ..core.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    try:
        cfg = ckpt.config.get("text_config") or ckpt.config
        layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
        inter, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        hd = int(cfg.get("head_dim") or hidden // heads)
    except (KeyError, TypeError, ValueError):  # no Llama-like shape: count the stored tensors
        n = sum(math.prod(ckpt.shape(t)) for t in ckpt.names)
        ckpt.close()
        return n * dtype.itemsize
    ckpt.close()
    per_layer = hidden * hd * (2 * heads + 2 * kv) + 3 * hidden * inter
    return (layers * per_layer + 2 * vocab * hidden) * dtype.itemsize


@dataclass(frozen=True)
class EvalPlan:
    """How an evaluation fits this machine's memory: the dtype, and whether the reference runs
    first and is freed before the quantized model loads (instead of both side by side)."""

    dtype: torch.dtype
    reference_first: bool
    note: str | None


def plan_memory(reference_path, quantized_path, dtype: torch.dtype,
                available: int | None = None) -> EvalPlan:
    """Both models side by side in ``dtype`` where they fit in the available memory (the
    default, and every result published for the small models); else the reference first, then
    the quantized model; else both in bf16, one after the other, which the note says."""
    from ..core.memory import available_bytes

    available = available_bytes() if available is None else available
    ref = model_bytes(reference_path, dtype) if reference_path is not None else 0
    quant = model_bytes(quantized_path, dtype)
    if (ref + quant) * MODEL_HEADROOM <= available:
        return EvalPlan(dtype, False, None)
    if max(ref, quant) * MODEL_HEADROOM <= available:
        return EvalPlan(dtype, True, None)
    half = torch.bfloat16
    need = max(model_bytes(p, half) for p in (reference_path, quantized_path) if p is not None)
    if dtype != half and need * MODEL_HEADROOM <= available:
        return EvalPlan(half, True, f"computed in bf16: in {str(dtype)[6:]} one model needs "
                        f"{max(ref, quant) / 2**30:.1f} GiB, {available / 2**30:.1f} GiB are "
                        "available")
    raise CpuQuantError(f"the evaluation needs {need * MODEL_HEADROOM / 2**30:.1f} GiB for one "
                        f"model in bf16, and {available / 2**30:.1f} GiB are available")


def evaluate_artifact(quantized_path: str | Path, reference_path: str | Path | None,
                      settings: EvalSettings | None = None, progress: bool = False,
                      dtype: torch.dtype = torch.float32,
                      variants: tuple[str, ...] = ("weights",), *,
                      reference_logits: str | Path | None = None,
                      save_reference: str | Path | None = None) -> dict[str, FidelityReport]:
    """Score ``quantized_path`` against the reference model, or against a file saved by
    ``--save-reference`` (``reference_logits``: no reference model is loaded)."""
    from .dequantized import load_model

    settings = settings or EvalSettings()
    settings.validate()
    if reference_logits is None and reference_path is None:
        raise CpuQuantError("give --reference SRC or --reference-logits FILE")
    check_heldout(settings.text)  # a bad --text, before any model is read
    _check_checkpoint("QUANT", quantized_path, settings)
    if reference_logits is None:
        _check_checkpoint("--reference", reference_path, settings, float_weights=True)
    check_consistent(quantized_path)  # verify's checks: after the quick ones of both sides
    saved = load_reference(reference_logits) if reference_logits is not None else None
    tok = _load_tokenizer(reference_path if reference_logits is None else quantized_path)
    texts = _heldout_texts(settings, tok)
    scored, prompts = _eval_windows(tok, settings, texts)
    plan = plan_memory(reference_path if saved is None else None, quantized_path, dtype)
    if plan.note and progress:
        import sys

        print(f"note: {plan.note}", file=sys.stderr)
    dtype = plan.dtype
    if saved is None and plan.reference_first:
        saved = _run_reference(reference_path, scored, prompts, texts, settings, dtype, progress)
        if save_reference is not None:
            save_reference_file(save_reference, saved)
            save_reference = None
        reference: FreshReference | StoredReference = StoredReference(saved)
    elif saved is not None:
        saved.check_matches(scored, prompts, text_fingerprint(texts), asdict(settings),
                            Path(reference_logits))
        reference = StoredReference(saved)
    else:
        _loading(progress, f"the reference {reference_path}")
        reference = FreshReference(load_model(reference_path, dtype),
                                   keep=save_reference is not None)
    _loading(progress, f"the quantized checkpoint {quantized_path}")
    quantized = load_model(quantized_path, dtype)
    reports = score_against(reference, quantized, tok, scored, prompts, settings, progress, variants)
    if save_reference is not None and isinstance(reference, FreshReference):
        _write_saved(save_reference, reference, scored, prompts, texts, settings, reference_path)
    return reports
