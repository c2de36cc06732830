"""Next-token logits of a GGUF model in llama.cpp, and their distance to a reference.

Run by the llama-cpp-python peer venv's interpreter (numpy and llama_cpp only):

    python llama_cpp_fidelity.py save    MODEL.gguf WINDOWS.json LOGITS.npy
    python llama_cpp_fidelity.py compare MODEL.gguf WINDOWS.json REF_LOGITS.npy OUT.json [S N]

``WINDOWS.json`` is a list of equal-length token-id lists (tokenized by the Hugging Face
tokenizer, so every arm sees the same ids). Each window is evaluated from an empty KV cache in
one batch with ``logits_all=True``: position ``t`` gives the distribution of token ``t + 1``.
``save`` writes the float32 logits ``[windows, tokens, vocab]`` (the reference); ``compare``
scores MODEL against such a file, on every window or, given ``S N``, on the windows ``i`` with
``i % N == S`` (one slice of the text per pass):

``kl_mean``         mean over all positions of KL(ref || model), nats
``kl_se``           its standard error over positions (std / sqrt(n)); ``kl_se_windows`` the
                    standard error of the per-window means (positions in a window correlate)
``top1_agreement``  fraction of positions where both argmaxes agree
``ppl_*``           perplexity of the window's own next tokens (positions 0 .. T-2), reference
                    and model; ``ppl_delta`` = model - reference

The model is opened by ``llama_cpp_open.open_model`` (repacking off on AMX builds).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)  # float32 logits; the sums below accumulate in float64
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)


def _open(model: str, seqlen: int):
    sys.path.insert(0, str(REPO))
    from benchmarks.peers.llama_cpp_open import extra_bufts_off, open_model

    threads = len(os.sched_getaffinity(0))
    llm = open_model(model, n_ctx=seqlen, n_batch=seqlen, n_ubatch=seqlen, logits_all=True,
                     n_threads=threads, n_threads_batch=threads, seed=0, verbose=False)
    return llm, {"n_threads": threads, "extra_bufts_off": extra_bufts_off()}


def window_logits(llm, tokens: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def save(model: str, windows: list[list[int]], out: Path) -> dict:
    llm, info = _open(model, len(windows[0]))
    tmp = out.with_name(out.name + ".partial.npy")
    arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32,
                                    shape=(len(windows), len(windows[0]), llm.n_vocab()))
    for i, w in enumerate(windows):
        arr[i] = window_logits(llm, w)
    arr.flush()
    del arr
    os.replace(tmp, out)
    return info


def compare(model: str, windows: list[list[int]], ref_path: Path, part: int = 0,
            parts: int = 1) -> dict:
    ref = np.load(ref_path, mmap_mode="r")
    llm, info = _open(model, len(windows[0]))
    if ref.shape[:2] != (len(windows), len(windows[0])) or ref.shape[2] != llm.n_vocab():
        raise SystemExit(f"reference {ref.shape} does not match {len(windows)} windows x "
                         f"{len(windows[0])} tokens x vocab {llm.n_vocab()}")
    kls, top1, nll_ref, nll_arm, per_window = [], 0, 0.0, 0.0, []
    n_next = 0
    chosen = [i for i in range(len(windows)) if i % parts == part]
    for i in chosen:
        w = windows[i]
        lp_arm = _log_softmax(window_logits(llm, w))
        lp_ref = _log_softmax(np.asarray(ref[i]))
        kl = (np.exp(lp_ref) * (lp_ref - lp_arm)).sum(axis=-1, dtype=np.float64)
        kls.append(kl)
        per_window.append(float(kl.mean()))
        top1 += int((lp_ref.argmax(-1) == lp_arm.argmax(-1)).sum())
        nxt = np.asarray(w[1:])
        idx = np.arange(len(w) - 1)
        nll_ref -= float(lp_ref[idx, nxt].sum())
        nll_arm -= float(lp_arm[idx, nxt].sum())
        n_next += len(nxt)
    kl_all = np.concatenate(kls)
    n = kl_all.size
    ppl_ref, ppl_arm = math.exp(nll_ref / n_next), math.exp(nll_arm / n_next)
    return {**info, "kl_mean": float(kl_all.mean()),
            "kl_se": float(kl_all.std(ddof=1) / math.sqrt(n)),
            "kl_se_windows": float(np.std(per_window, ddof=1) / math.sqrt(len(per_window))),
            "kl_median": float(np.median(kl_all)), "kl_p99": float(np.quantile(kl_all, 0.99)),
            "kl_max": float(kl_all.max()), "kl_per_window": per_window,
            "top1_agreement": top1 / n, "ppl_reference": ppl_ref, "ppl_model": ppl_arm,
            "ppl_delta": ppl_arm - ppl_ref, "positions": n, "windows": chosen,
            "seqlen": len(windows[0])}


def main(argv: list[str]) -> int:
    mode, model, windows_path = argv[0], argv[1], Path(argv[2])
    windows = json.loads(windows_path.read_text())

    if mode == "save":
        result = save(model, windows, Path(argv[3]))
        out = Path(argv[3]).with_suffix(".json")
    elif mode == "compare":
        part, parts = (int(argv[5]), int(argv[6])) if len(argv) > 5 else (0, 1)
        result = compare(model, windows, Path(argv[3]), part, parts)
        out = Path(argv[4])
    else:
        raise SystemExit(f"unknown mode {mode!r}: save or compare")
    from benchmarks.peers.llama_cpp_open import write_result  # sys.path set by _open

    write_result(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
