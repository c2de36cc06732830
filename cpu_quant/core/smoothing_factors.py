"""The smoothing factors an artifact carries beside its weights, and the folds they apply.

A linear computes the same output from ``x / s`` and ``W · diag(s)``; a GPTQ run with activation
smoothing divides what produces ``x`` (a norm's weight, or the rows of the linear before) by
``s`` and multiplies the reading linears' columns, and writes the factors ``s`` beside the
weights (:data:`FACTORS_FILE`, safetensors, one float32 vector per fold keyed by the divided
tensor). ``verify --source``, ``export-phone`` and ``eval`` read the source through the same
folds (:func:`smoothed_source`) to see the weights the run quantized. The choice of the factors
is the quantizer's (``quantize.smooth_fold``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CpuQuantError

# safetensors bytes under a name that no loader globs for weights (vLLM reads *.safetensors)
FACTORS_FILE = "smoothing.factors"
HEAD = "lm_head.weight"

# elements of one block of a weight's rows: temporaries stay bounded whatever the weight (an
# 8B model's head is 525M weights, 2 GiB per float32 copy)
BLOCK_ELEMENTS = 1 << 24


def row_blocks(w: torch.Tensor) -> list[slice]:
    """``w``'s rows in blocks of at most :data:`BLOCK_ELEMENTS` elements."""
    rows = max(1, BLOCK_ELEMENTS // max(1, w.shape[1]))
    return [slice(r, min(r + rows, w.shape[0])) for r in range(0, w.shape[0], rows)]



@dataclass(frozen=True)
class Fold:
    """Divide ``divide`` (a norm weight [K], or a linear's rows [K, ·] with ``bias``) by ``s``
    and multiply the columns of every ``scale`` weight [N, K'] by ``s`` (``K' = K · rep`` when a
    ``v_proj`` row feeds ``rep`` query heads of ``head_dim`` channels each)."""

    divide: str
    scale: tuple[str, ...]
    bias: str | None = None
    rep: int = 1
    head_dim: int = 0

    @property
    def key(self) -> str:
        return self.divide

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """The factor of the scaled weights' columns (``v`` row factors repeated per head)."""
        if self.rep == 1:
            return s
        kv = s.numel() // self.head_dim
        return s.view(kv, 1, self.head_dim).expand(kv, self.rep, self.head_dim).reshape(-1)




def layer_folds(prefix: str, n_heads: int, n_kv_heads: int, head_dim: int,
                names: set[str]) -> list[Fold]:
    """The four folds of one decoder layer whose parameters start with ``prefix``."""
    p = prefix
    attn, mlp = p + "self_attn.", p + "mlp."
    v_bias = attn + "v_proj.bias"
    up_bias = mlp + "up_proj.bias"
    return [
        Fold(p + "input_layernorm.weight",
             tuple(attn + f"{n}_proj.weight" for n in "qkv")),
        Fold(attn + "v_proj.weight", (attn + "o_proj.weight",),
             bias=v_bias if v_bias in names else None, rep=n_heads // n_kv_heads,
             head_dim=head_dim),
        Fold(p + "post_attention_layernorm.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight")),
        Fold(mlp + "up_proj.weight", (mlp + "down_proj.weight",),
             bias=up_bias if up_bias in names else None),
    ]


def all_folds(config: dict, layers_prefix: str, n_layers: int, names: set[str],
              head: str | None, final_norm: str | None) -> list[Fold]:
    """Every fold of the model; the head's when ``head`` (its weight's name in the artifact)
    and ``final_norm`` are given."""
    cfg = config.get("text_config") or config
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads)
    folds = [f for i in range(n_layers)
             for f in layer_folds(f"{layers_prefix}.{i}.", n_heads, n_kv, head_dim, names)]
    if head and final_norm:
        folds.append(Fold(final_norm, (head,)))
    missing = sorted({n for f in folds for n in (f.divide, *f.scale)} - names - {head})
    if missing:
        raise CpuQuantError(f"--smooth: the checkpoint has no {missing[0]} (folded: the Llama "
                            "module names)")
    return folds



def fold_tensor(name: str, t: torch.Tensor, folds: list[Fold], factors: dict[str, torch.Tensor]
                ) -> torch.Tensor:
    """``t`` (the tensor ``name``) with every fold that touches it applied, in ``t``'s dtype;
    the arithmetic in float64 for float64 input and in float32 otherwise, a block of rows at a
    time (every operation is per element: the same values as in one piece)."""
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    if t.dim() != 2:
        return _fold_rows(name, t, folds, factors, dtype, slice(None))
    out = torch.empty_like(t)
    for rows in row_blocks(t):
        out[rows] = _fold_rows(name, t[rows], folds, factors, dtype, rows)
    return out


def _fold_rows(name: str, t: torch.Tensor, folds: list[Fold], factors: dict[str, torch.Tensor],
               dtype: torch.dtype, rows: slice) -> torch.Tensor:
    work = t.to(dtype)
    for f in folds:
        s = factors[f.key].to(dtype)
        if name == f.divide:
            work = work / (s if work.dim() == 1 else s[rows].unsqueeze(1))
        elif name == f.bias:
            work = work / s
        elif name in f.scale:
            work = work * f.expand(s).unsqueeze(0)
    return work.to(t.dtype)


def touched(folds: list[Fold]) -> set[str]:
    return {n for f in folds for n in (f.divide, *f.scale, f.bias) if n}


class SmoothedCheckpoint:
    """A checkpoint whose tensors read with the folds applied (everything else delegated)."""

    def __init__(self, ckpt, folds: list[Fold], factors: dict[str, torch.Tensor]) -> None:
        self._ckpt, self.folds, self.factors = ckpt, folds, factors
        self.changed = touched(folds)  # the tensor names the folds change

    def __getattr__(self, attr):
        return getattr(self._ckpt, attr)

    def tensor(self, name: str, check_finite: bool = False) -> torch.Tensor:
        t = self._ckpt.tensor(name, check_finite=check_finite)
        return fold_tensor(name, t, self.folds, self.factors) if name in self.changed else t

    def head_tensor(self, name: str, head_key: str, check_finite: bool = False) -> torch.Tensor:
        """The head's weight with its fold (``name`` may be the tied embedding's, which itself
        is read unfolded)."""
        t = self._ckpt.tensor(name, check_finite=check_finite)
        return fold_tensor(head_key, t, self.folds, self.factors)




def save_factors(path: Path, factors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save

    path.write_bytes(save({k: v.float().contiguous() for k, v in factors.items()}))


def load_factors(root: str | Path) -> dict[str, torch.Tensor] | None:
    path = Path(root) / FACTORS_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load

    try:
        factors = load(path.read_bytes())
    except Exception as exc:  # a truncated or foreign file: safetensors' own error types
        raise CpuQuantError(f"{path}: not a smoothing factors file ({str(exc)[:120]})") from None
    bad = [k for k, v in factors.items() if v.dim() != 1 or not bool(torch.isfinite(v).all())
           or not bool((v > 0).all())]
    if bad:
        raise CpuQuantError(f"{path}: the factors of {bad[0]} are not a vector of finite "
                            "positive numbers")
    return factors




def smoothed_source(ckpt, factors: dict[str, torch.Tensor], what: str) -> SmoothedCheckpoint:
    """The source ``ckpt`` read through the folds of an artifact's ``factors`` (``what`` names
    the artifact in the error): the weights the artifact's GPTQ run quantized."""
    names = set(ckpt.names)
    found = [re.match(r"^(.*)\.(\d+)\.input_layernorm\.weight$", n) for n in factors]
    prefixes = {m.group(1) for m in found if m}
    layer_keys = {k for k in factors if any(k.startswith(p + ".") for p in prefixes)}
    head_keys = set(factors) - layer_keys
    cfg = ckpt.config.get("text_config") or ckpt.config
    if len(prefixes) != 1 or len(head_keys) > 1:
        raise CpuQuantError(f"{what}: {FACTORS_FILE} does not hold a model's smoothing factors")
    [prefix] = prefixes
    norm = next(iter(head_keys), None)
    folds = all_folds(ckpt.config, prefix, int(cfg["num_hidden_layers"]), names,
                      HEAD if norm else None, norm)
    if {f.key for f in folds} != set(factors):
        raise CpuQuantError(f"{what}: its {FACTORS_FILE} does not fit the source (other layers "
                            "or another model)")
    for f in folds:
        if tuple(factors[f.key].shape) != (ckpt.shape(f.divide)[0],):
            raise CpuQuantError(f"{what}: its {FACTORS_FILE} does not fit the source "
                                f"({f.key} has {factors[f.key].numel()} factors)")
    return SmoothedCheckpoint(ckpt, folds, factors)
