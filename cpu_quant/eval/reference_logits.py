"""The reference model's side of an evaluation, saved once so later artifacts skip the bf16 run.

``cpu-quant eval --save-reference FILE`` stores the reference's logits in factored form: for
every scored position the hidden state that enters the output head (float32) and, once, the
head's weight, so ``logits = h Wᵀ`` is recomputed exactly (the same float32 product a fresh run
computes); plus the log-sum-exp of each position's logits (checked against the recomputed
logits when the file is read), the reference's NLL of the true next token and its greedy
continuations of the prompts. ``--reference-logits FILE`` scores an artifact against that
file: KL is then the full-vocabulary ``Σ p (log p − log q)`` of a fresh run, and matches it to
float rounding (``tests/test_eval_stats.py`` holds it to 1e-4 on the demo model).

Why not the top-k logits plus the log-sum-exp: with ``K`` the reference's top-k tokens and
``P_T``, ``Q_T`` the two models' mass outside them, the best one can do is the KL of the
distributions coarsened to ``k + 1`` outcomes, ``Σ_K p (log p − log q) + P_T log(P_T / Q_T)``,
which misses ``P_T`` times the KL between the two tails. On the demo model the top 64 tokens
hold 86% of the mass on average; against a round-to-nearest w4g128 copy (KL 0.70, 4 × 256
tokens) that estimate was 0.120 too low at k = 64 and still 0.059 at k = 256: nowhere near
1e-4. (The factored file of the default evaluation of the demo model: 38 MB of hidden states
plus the 57 MB head.)

File: safetensors, written by the one safetensors writer; tensors ``hidden`` float32
[W, T, H], ``head`` [V, H] (bf16 when that is lossless, else float32), ``lse`` float32 [W, T],
``nll`` float32 [W, T], ``windows`` int32 [W, T + 1], ``prompts`` int32 [P, L], ``greedy``
int32 [P, new_tokens]; metadata ``format`` (``cpu-quant-reference-logits/1``),
``text_sha256``, ``settings`` (JSON) and ``reference`` (the source path).

An architecture that post-processes the head's output (Gemma 2's logit soft-capping) does not
give ``logits = h Wᵀ``; saving is refused for it rather than storing something else.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..core.errors import CpuQuantError

FORMAT = "cpu-quant-reference-logits/1"


def text_fingerprint(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class WindowReference:
    """The reference's view of one window, in factored form: ``logits = hidden @ head.T``."""

    hidden: torch.Tensor  # float32 [T, H], the input of the output head
    head: torch.Tensor  # [V, H], shared by every window
    lse: torch.Tensor  # float32 [T], as the reference computed it
    nll: torch.Tensor  # float32 [T]

    def log_probs(self) -> torch.Tensor:
        return torch.log_softmax(F.linear(self.hidden, self.head.to(self.hidden.dtype)), -1)

    def scored(self) -> ExactWindow:
        return ExactWindow(self.log_probs(), nll=self.nll)


class ExactWindow:
    """The reference's full log-probs over one window: KL over the whole vocabulary."""

    def __init__(self, log_p: torch.Tensor, target: torch.Tensor | None = None,
                 nll: torch.Tensor | None = None) -> None:
        self.log_p = log_p
        self.nll = nll if nll is not None else -log_p.gather(-1, target[:, None])[:, 0]
        self.argmax = log_p.argmax(-1)

    def kl(self, log_q: torch.Tensor) -> torch.Tensor:
        return (self.log_p.exp() * (self.log_p - log_q)).sum(-1)


@dataclass
class SavedReference:
    windows: torch.Tensor  # int64 [W, T + 1]
    prompts: torch.Tensor  # int64 [P, L]
    greedy: torch.Tensor  # int64 [P, new_tokens]
    per_window: list[WindowReference]
    text_sha256: str
    settings: dict
    reference: str

    def check_matches(self, windows: torch.Tensor, prompts: torch.Tensor, text_sha256: str,
                      settings: dict, path: Path) -> None:
        """Refuse a file saved for other held-out tokens, naming what differs."""
        keys = ("windows", "seqlen", "prompts", "prompt_len", "new_tokens", "text")
        differ = [k for k in keys if self.settings.get(k) != settings.get(k)]
        if differ:
            saved = ", ".join(f"{k}={self.settings.get(k)!r}" for k in differ)
            raise CpuQuantError(f"--reference-logits {path} was saved with {saved}; run with the "
                                "same settings, or save the reference again with --save-reference")
        if self.text_sha256 != text_sha256:
            raise CpuQuantError(f"--reference-logits {path} was saved for a different held-out text "
                                "(its SHA-256 differs); save the reference again with --save-reference")
        if not (torch.equal(self.windows, windows) and torch.equal(self.prompts, prompts)):
            raise CpuQuantError(f"--reference-logits {path} was saved for different token ids (a "
                                "different tokenizer?); save the reference again with --save-reference")


def save_reference(path: str | Path, ref: SavedReference) -> int:
    from ..core.io.safetensors_writer import write_safetensors

    head = ref.per_window[0].head
    if torch.equal(head.bfloat16().to(head.dtype), head):
        head = head.bfloat16()  # lossless: the reference's weights were bf16
    tensors = {
        "hidden": torch.stack([w.hidden for w in ref.per_window]).float(), "head": head,
        "lse": torch.stack([w.lse for w in ref.per_window]).float(),
        "nll": torch.stack([w.nll for w in ref.per_window]).float(),
        "windows": ref.windows.int(), "prompts": ref.prompts.int(), "greedy": ref.greedy.int(),
    }
    meta = {"format": FORMAT, "text_sha256": ref.text_sha256,
            "settings": json.dumps(ref.settings, sort_keys=True), "reference": ref.reference}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    try:
        return write_safetensors(path, tensors, metadata=meta)
    except OSError as exc:
        raise CpuQuantError(f"cannot write --save-reference {path}: {exc.strerror or exc}") from None


def load_reference(path: str | Path) -> SavedReference:
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise CpuQuantError(f"--reference-logits {path} is not a file")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise CpuQuantError(f"--reference-logits {path} is not a file written by "
                                    "--save-reference")
            t = {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except (SafetensorError, OSError) as exc:
        raise CpuQuantError(f"cannot read --reference-logits {path}: {exc}") from None
    try:
        head = t["head"].float()
        per_window = [WindowReference(t["hidden"][i], head, t["lse"][i], t["nll"][i])
                      for i in range(t["hidden"].shape[0])]
        return SavedReference(t["windows"].long(), t["prompts"].long(), t["greedy"].long(),
                              per_window, meta["text_sha256"], json.loads(meta["settings"]),
                              meta.get("reference", ""))
    except (KeyError, IndexError, ValueError) as exc:  # a damaged or hand-made file
        raise CpuQuantError(f"--reference-logits {path} is not a whole file written by "
                            f"--save-reference ({type(exc).__name__}: {exc})") from None


def check_factored(window: WindowReference, logits: torch.Tensor, what: str) -> None:
    """The head's input times its weight must give the model's logits (no post-processing)."""
    lse = torch.logsumexp(F.linear(window.hidden, window.head.to(window.hidden.dtype)), -1)
    err = float((lse - torch.logsumexp(logits, -1)).abs().max())
    if err > 1e-3:
        raise CpuQuantError(f"{what}: the logits are not the output head applied to its input "
                            f"(log-sum-exp off by {err:.3g}; the architecture post-processes "
                            "them), so they cannot be saved in factored form")
