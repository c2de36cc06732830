"""Activation smoothing folded into the checkpoint that GPTQ quantizes (``gptq --smooth``).

vLLM's W4A8 kernel (``int4_scaled_mm_cpu``) and ExecuTorch's 8da4w programs quantize every
activation to int8 per token at run time, so a few input channels of large magnitude set every
token's step. A linear computes the same output from ``x / s`` and ``W · diag(s)``
(``quantize.smoothing``); the division is folded into what produces ``x``, so the checkpoint
stays a plain Llama-like checkpoint that stock vLLM loads. On a Llama-like decoder layer:

* ``q/k/v_proj`` read ``input_layernorm``'s output: the norm's weight is divided;
* ``o_proj`` reads the attention output, a mix of ``v_proj``'s rows: those rows (and their
  bias) are divided; with grouped-query attention one ``v`` row feeds ``n_heads / n_kv_heads``
  ``o_proj`` inputs, which share its factor;
* ``gate/up_proj`` read ``post_attention_layernorm``'s output: its weight is divided;
* ``down_proj`` reads ``silu(gate) · up``: ``up_proj``'s rows are divided;
* the quantized head reads the final norm's output: that norm's weight is divided (the head is
  untied in the artifact, so the embedding is not touched).

The strength is chosen per fold from calibration: before GPTQ, one float forward over the first
:data:`STATS_BATCHES` calibration batches records each fold's per-channel ``max|x|`` and a
sample of :data:`SAMPLE_TOKENS` tokens; for each candidate ``α`` (:data:`ALPHAS`, and no
smoothing at all) the reading linears' output is computed with the int8-per-token activations
and round-to-nearest 4-bit weights of the configured group (the W4A8 kernel's arithmetic), and
the ``α`` with the least relative squared error against the float output is kept. GPTQ then
runs on the folded weights as on any checkpoint. The folded norms are stored in bf16, like every
norm of the artifact; the factors are written beside the weights (:data:`FACTORS_FILE`) so that
``verify --source`` and ``export-phone`` can fold the source the same way.

Gemma's norms (``1 + w``, and norms after the attention and the MLP) and Phi-3's fused
projections are refused, as is any model whose modules are not the Llama names above.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.grid import QZERO, grouped
from ..core.memory import release_free_heap
from ..core.smoothing_factors import FACTORS_FILE, HEAD, Fold, all_folds, row_blocks
from .distributed import Team
from .smoothing import smoothing_scales, weights_absmax

if TYPE_CHECKING:
    from .settings import QuantSettings

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
# where the gptq command folds it by default: held-out KL fell with it on the demo model (a
# Llama: 0.1138 -> 0.0878) and on tiny random Llama/Mistral and Qwen3 models, and rose on a
# tiny random Qwen2 (0.0587 -> 0.0608; fidelity_archs-20261204T205049Z.json)
DEFAULT_ON = ("llama", "mistral", "qwen3")
ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
STATS_BATCHES = 2  # calibration batches of the statistics pass (16 windows at batch 8)
SAMPLE_TOKENS = 1024  # tokens per fold for the choice of alpha
HEAD_SAMPLE_TOKENS = 256  # the head is vocab-wide: fewer tokens for its choice
# a fold's weights up to this many elements are converted to float32 once for all candidates
# (256 MiB; a larger one, the head, a block of rows at a time per candidate)
FLOAT_COPY_ELEMENTS = 1 << 26


def model_type(config: dict) -> str:
    return str(config.get("text_config", {}).get("model_type") or config.get("model_type") or "?")


def refuse(config: dict) -> str | None:
    """Why ``--smooth`` cannot fold into this model, or None."""
    mt = model_type(config)
    if mt in SUPPORTED:
        return None
    why = {"gemma": "its norms multiply by 1 + w and sit after the attention and the MLP too",
           "phi3": "its q/k/v and gate/up projections are fused"}
    reason = next((v for k, v in why.items() if mt.startswith(k)),
                  "only Llama-like layers are folded")
    return f"--smooth cannot fold into a {mt} model: {reason} (folded: {', '.join(SUPPORTED)})"


def default_smoothing(config: dict, settings: QuantSettings) -> tuple[bool, str | None]:
    """Whether the default (``gptq`` without ``--smooth`` or ``--no-smooth``) folds smoothing
    into this run, and the plan's note when the model is why not. It folds for calibrated GPTQ
    on the symmetric grid, on the models of :data:`DEFAULT_ON`."""
    if settings.method != "gptq" or settings.data_free or not settings.symmetric:
        return False, None
    why = refuse(config)
    if why:
        return False, f"activation smoothing not folded: {why.removeprefix('--smooth ')}"
    mt = model_type(config)
    if mt not in DEFAULT_ON:
        return False, (f"activation smoothing not folded: not a default for a {mt} model (it "
                       "raised held-out KL on a tiny random one); --smooth folds it")
    return True, None


# -- choosing the factors ------------------------------------------------------------------------

def _int8_per_token(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
    return torch.round(x / scale).clamp_(-127, 127) * scale


def _rtn4(w: torch.Tensor, group: int) -> torch.Tensor:
    g = group if 0 < group <= w.shape[1] and w.shape[1] % group == 0 else w.shape[1]
    wg = grouped(w, g)
    scale = wg.abs().amax(-1, keepdim=True).clamp_min(1e-30) / (QZERO - 0.5)
    return (torch.round(wg / scale).clamp_(-QZERO, QZERO - 1) * scale).reshape(w.shape)


def float_outputs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x Wᵀ`` in float32, ``W`` converted a block of rows at a time."""
    return torch.cat([x @ w[rows].float().T for rows in row_blocks(w)], dim=1)


def w4a8_error(x: torch.Tensor, weights: list[torch.Tensor], s_cols: torch.Tensor | None,
               groups: list[int], outputs: list[torch.Tensor] | None = None) -> float:
    """Relative squared error of ``x Wᵀ`` (every W) when ``x / s`` is int8 per token and
    ``W · diag(s)`` is 4-bit round-to-nearest in groups of ``groups`` (one per W, as the run's
    plan gives them); ``outputs``: the float ``x Wᵀ``, when already computed. Each W goes a
    block of rows at a time (in float32): a row's groups lie within the row, so the blocks'
    errors add up to the whole's."""
    xs = x if s_cols is None else x / s_cols
    xq = _int8_per_token(xs)
    num = den = 0.0
    ys = outputs or [float_outputs(x, w) for w in weights]
    for w, group, y in zip(weights, groups, ys, strict=True):
        for rows in row_blocks(w):
            wb = w[rows] if w.dtype == torch.float32 else w[rows].float()
            ws = wb if s_cols is None else wb * s_cols
            diff = xq @ _rtn4(ws, group).T
            diff.sub_(y[:, rows])  # in place: the same values as a new tensor, no allocation
            num += float(diff.pow_(2).sum())
            del diff
        den += float(y.pow(2).sum())
    return num / max(den, 1e-30)


@dataclass
class Choice:
    alpha: float | None  # None: no smoothing (s = 1)
    error: float
    error_unsmoothed: float


CANDIDATES: tuple[float | None, ...] = (None, *ALPHAS)  # None: no smoothing (s = 1)


def candidate_errors(fold: Fold, absmax: torch.Tensor, sample: torch.Tensor,
                     weights: list[torch.Tensor], groups: list[int],
                     candidates: tuple[float | None, ...] = CANDIDATES
                     ) -> dict[float | None, tuple[torch.Tensor, float]]:
    """Each candidate strength's factor ``s`` (per divided channel) and W4A8 error on
    ``sample``; ``absmax`` and ``sample`` are of the reading linears' input (``K'`` channels).
    Each candidate is computed on its own, so any subset gives the same values."""
    x = sample.float()
    if fold.rep > 1:  # a v row's factor: over its rep heads' channels (o_proj: one layer's)
        kv = absmax.numel() // (fold.rep * fold.head_dim)
        a = absmax.float().view(kv, fold.rep, fold.head_dim).amax(1).reshape(-1)
        cols = [w.float().view(w.shape[0], kv, fold.rep, fold.head_dim).permute(0, 2, 1, 3)
                .reshape(w.shape[0] * fold.rep, kv * fold.head_dim) for w in weights]
    else:
        a, cols = absmax.float(), weights
    w_max = weights_absmax(cols)  # the same for every candidate
    ys = [float_outputs(x, w) for w in weights]
    if sum(w.numel() for w in weights) <= FLOAT_COPY_ELEMENTS:  # float32 once, not per candidate
        weights = [w.float() for w in weights]
    out: dict[float | None, tuple[torch.Tensor, float]] = {}
    for alpha in candidates:
        if alpha is None:
            out[alpha] = torch.ones_like(a), w4a8_error(x, weights, None, groups, ys)
        else:
            s = smoothing_scales(a, cols, alpha, w_max)
            out[alpha] = s, w4a8_error(x, weights, fold.expand(s), groups, ys)
    return out


def pick(errors: dict[float | None, tuple[torch.Tensor, float]]) -> tuple[torch.Tensor, Choice]:
    """The candidate with the least error (no smoothing first, then :data:`ALPHAS` in order;
    a later one must be strictly better)."""
    best_s, base = errors[None]
    best = Choice(None, base, base)
    for alpha in ALPHAS:
        s, err = errors[alpha]
        if err < best.error:
            best_s, best = s, Choice(alpha, err, base)
    return best_s, best


def choose(fold: Fold, absmax: torch.Tensor, sample: torch.Tensor, weights: list[torch.Tensor],
           groups: list[int]) -> tuple[torch.Tensor, Choice]:
    """The factor ``s`` of ``fold`` with the least W4A8 error on ``sample`` (every candidate)."""
    return pick(candidate_errors(fold, absmax, sample, weights, groups))


def assign_candidates(costs: list[int], world: int) -> list[dict[int, tuple[float | None, ...]]]:
    """Which rank evaluates which candidates of which fold (per rank: fold index -> candidates),
    for one step's folds of the given costs. A fold goes whole to the least loaded rank,
    heaviest first; a fold heavier than a rank's fair share (the head) has its candidates
    shared out instead. Every rank computes the same shares from the same costs."""
    work: list[dict[int, tuple[float | None, ...]]] = [{} for _ in range(world)]
    load = [0.0] * world
    fair = sum(costs) / world
    for f in sorted(range(len(costs)), key=lambda f: (-costs[f], f)):
        whole = world == 1 or costs[f] <= fair
        for c in (CANDIDATES,) if whole else tuple((c,) for c in CANDIDATES):
            r = min(range(world), key=lambda r: (load[r], r))
            work[r][f] = work[r].get(f, ()) + c
            load[r] += costs[f] * len(c) / len(CANDIDATES)
    return work


class FoldStats:
    """Forward pre-hooks on the reading linears: running per-channel ``max|x|`` and the first
    :data:`SAMPLE_TOKENS` tokens spread over the batches seen (``batches``: the statistics
    pass's batches, of every rank)."""

    def __init__(self, modules: dict[str, torch.nn.Module], batches: int) -> None:
        self.absmax: dict[str, torch.Tensor] = {}
        self.samples: dict[str, list[torch.Tensor]] = {n: [] for n in modules}
        self.per_batch = max(1, SAMPLE_TOKENS // max(batches, 1))
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str) -> Callable:
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            step = max(1, x.shape[0] // self.per_batch)
            self.add(name, x.abs().amax(0), x[::step][: self.per_batch].clone())
        return hook

    def add(self, name: str, absmax: torch.Tensor | None, *samples: torch.Tensor) -> None:
        """One batch's (or, merged from another rank, some batches') statistics of ``name``,
        in batch order."""
        if absmax is not None:
            old = self.absmax.get(name)
            self.absmax[name] = absmax if old is None else torch.maximum(old, absmax)
        self.samples.setdefault(name, []).extend(samples)

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def sample(self, name: str) -> torch.Tensor:
        return torch.cat(self.samples[name])[:SAMPLE_TOKENS]

    def everyone(self, team: Team) -> FoldStats:
        """The statistics of every rank's batches, on every rank: ``max|x|`` is the same in
        any order, the samples go in rank order, which is batch order."""
        mine = {n: (self.absmax.get(n), self.samples[n]) for n in self.samples}
        merged = FoldStats({}, 1)
        for part in team.gather_objects(mine, "the smoothing statistics"):
            for name, (absmax, samples) in part.items():
                merged.add(name, absmax, *samples)
        return merged


def _reader(fold: Fold) -> str:
    """The module (linear) whose input a fold smooths: its first scaled weight's module."""
    return fold.scale[0].removesuffix(".weight")


Errors = dict[float | None, tuple[torch.Tensor, float]]


def _evaluate(folds: list[Fold], weights: Callable[[Fold], list[torch.Tensor]],
              stats: Callable[[Fold], tuple[torch.Tensor, torch.Tensor]],
              group_of: Callable[[str], int], team: Team, into: dict[str, Errors]) -> None:
    """This rank's share of the candidates of one step's ``folds`` (:func:`assign_candidates`)."""
    costs = [sum(math.prod(w.shape) for w in weights(f)) for f in folds]
    for f, candidates in assign_candidates(costs, team.world_size)[team.rank].items():
        fold = folds[f]
        absmax, sample = stats(fold)
        into.setdefault(fold.key, {}).update(candidate_errors(
            fold, absmax, sample, weights(fold), [group_of(n) for n in fold.scale], candidates))


@torch.no_grad()
def plan_smoothing(stream, batches: list[torch.Tensor], group_of: Callable[[str], int],
                   head: str | None, progress: bool = False, team: Team | None = None
                   ) -> tuple[list[Fold], dict, dict]:
    """One float forward of ``stream`` (a fresh :class:`~.streaming.LayerStream`) over
    ``batches``; every fold with its chosen factor. ``group_of``: the effective group of a
    linear (its weight's name) in the run's plan. Returns (folds, factors, choices).

    In a distributed run (``team``) each rank forwards its share of ``batches`` and the ranks
    exchange each layer's statistics; each evaluates its share of the folds' candidate
    strengths (:func:`assign_candidates`), and every rank gets every error at the end and
    picks alike. Every number is computed as one process computes it, so the factors are the
    same bit for bit."""
    from tqdm import tqdm

    team = team or Team()
    ckpt = stream.ckpt
    names = set(ckpt.names)
    norm = stream.final_norm()
    norm_name = next(n for n, m in stream.model.named_modules() if m is norm) + ".weight"
    folds = all_folds(ckpt.config, stream.layers_prefix, stream.n_layers, names, head,
                      norm_name if head else None)
    by_layer: dict[int, list[Fold]] = {}
    pat = re.compile(re.escape(stream.layers_prefix) + r"\.(\d+)\.")
    for f in folds:
        m = pat.match(f.divide)
        by_layer.setdefault(int(m.group(1)) if m else -1, []).append(f)
    errors: dict[str, Errors] = {}  # fold key -> the candidates this rank evaluated
    share = team.share_of(len(batches))
    hidden = stream.capture(batches[share.start:share.stop])
    for i in tqdm(range(stream.n_layers), desc="smoothing", unit="layer", disable=not progress):
        layer = stream.load_layer(i)
        modules = dict(layer.named_modules())
        prefix = f"{stream.layers_prefix}.{i}."
        readers = {_reader(f): modules[_reader(f).removeprefix(prefix)] for f in by_layer[i]}
        stats = FoldStats(readers, len(batches))
        try:
            hidden = list(stream.forward_layer(i, hidden))
        finally:
            stats.close()
        stats = stats.everyone(team)

        def weights(f: Fold, modules=modules, prefix=prefix) -> list[torch.Tensor]:
            return [modules[n.removeprefix(prefix).removesuffix(".weight")].weight for n in f.scale]

        _evaluate(by_layer[i], weights,
                  lambda f, stats=stats: (stats.absmax[_reader(f)], stats.sample(_reader(f))),
                  group_of, team, errors)
        stream.unload_layer(i)
        # as after each quantized layer: without it, freed hidden states and candidate weights
        # stayed on glibc's heap, and RssAnon climbed through this pass (by 570 MiB over the
        # demo model's 30 layers, to the whole run's peak)
        release_free_heap()
    if by_layer.get(-1):  # the head: the final norm's output
        per = max(1, HEAD_SAMPLE_TOKENS // max(len(batches), 1))
        head_stats = FoldStats({}, len(batches))
        for h in hidden:
            x = norm(h.to(stream.compute)).reshape(-1, h.shape[-1]).float()
            head_stats.add(HEAD, x.abs().amax(0), x[::max(1, x.shape[0] // per)][:per].clone())
        head_stats = head_stats.everyone(team)
        head_w = ckpt.tensor(stream.head_weight_name())
        _evaluate(by_layer[-1], lambda f: [head_w],
                  lambda f: (head_stats.absmax[HEAD], torch.cat(head_stats.samples[HEAD])),
                  group_of, team, errors)
    every: dict[str, Errors] = {}
    for part in team.gather_objects(errors, "the smoothing factors"):
        for key, found in part.items():
            every.setdefault(key, {}).update(found)
    factors: dict[str, torch.Tensor] = {}
    choices: dict[str, dict] = {}
    for f in folds:
        s, c = pick(every[f.key])
        factors[f.key], choices[f.key] = s, {"alpha": c.alpha, "w4a8_error": c.error,
                                             "w4a8_error_unsmoothed": c.error_unsmoothed}
    return folds, factors, choices


def summary(choices: dict[str, dict], batches: list[torch.Tensor], seconds: float) -> dict:
    """What the report records of a smoothed run: per fold, the strength and the W4A8 error
    with and without it; how many folds took each strength; the statistics pass."""
    counts: dict[str, int] = {}
    for c in choices.values():
        key = "off" if c["alpha"] is None else str(c["alpha"])
        counts[key] = counts.get(key, 0) + 1
    return {"factors_file": FACTORS_FILE, "stats_tokens": sum(b.numel() for b in batches),
            "sample_tokens": SAMPLE_TOKENS, "alphas_tried": list(ALPHAS), "alpha_counts": counts,
            "seconds": round(seconds, 3),
            "folds": {k: {"alpha": c["alpha"], "w4a8_error": round(c["w4a8_error"], 6),
                          "w4a8_error_unsmoothed": round(c["w4a8_error_unsmoothed"], 6)}
                      for k, c in choices.items()}}


