"""One pass of a llama.cpp arm, run by the llama-cpp-python peer venv's interpreter.

    python llama_cpp_pass.py MODEL.gguf OUT.json DECODE_TOKENS PROMPT_LEN

Measures what ``benchmarks.tinygemm_bench.one_pass`` measures for vLLM, the same way, so the
ratios to vLLM bf16 compare like with like:

``decode_tok_s``    batch 1: ``(N - 1) / (t(N tokens) - t(1 token))`` for a 16-token prompt of
                    random ids, greedy, best of 3 (N = DECODE_TOKENS); each timing starts from an
                    empty KV cache; a sample with t(N) <= t(1) (a stall, on a loaded machine) is
                    dropped and listed in ``decode_invalid_samples``, and a pass without any valid
                    sample fails
``prefill_tok_s``   a PROMPT_LEN-token prompt of random ids evaluated in one batch, plus one
                    greedy token: PROMPT_LEN / time, best of 3
``rss_anon_bytes``  RssAnon of this process after the model is loaded
``start_seconds``   ``Llama(...)`` construction

Threads: every CPU of the affinity mask (``n_threads`` and ``n_threads_batch``). The model is
memory-mapped as llama.cpp does by default; its weights then count as file-backed pages, not
RssAnon, which is what a user of llama.cpp gets.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DECODE_PROMPT_LEN = 16


def main(argv: list[str]) -> int:
    model, out, decode_tokens, prompt_len = argv[0], Path(argv[1]), int(argv[2]), int(argv[3])
    sys.path.insert(0, str(REPO))  # the project's one RssAnon reader (stdlib only)
    import llama_cpp

    from benchmarks.peers.llama_cpp_open import open_model, write_result
    from cpu_quant.core.memory import anon_rss_bytes

    threads = len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    llm = open_model(model, n_ctx=prompt_len + decode_tokens + 16, n_batch=prompt_len,
                     n_ubatch=prompt_len, n_threads=threads, n_threads_batch=threads, seed=0,
                     verbose=False)
    start = time.perf_counter() - t0
    rss = anon_rss_bytes(tree=True)
    vocab = llm.n_vocab()
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    def timed(tokens: list[int], max_tokens: int) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(tokens)  # the prompt, then max_tokens greedy tokens: max_tokens - 1 steps
        token = llm.sample(temp=0.0)
        for _ in range(max_tokens - 1):
            llm.eval([token])
            token = llm.sample(temp=0.0)
        return time.perf_counter() - t

    timed(prompt(DECODE_PROMPT_LEN), 8)  # warm-up
    decode, prefill, invalid = [], [], []
    for _ in range(3):
        p = prompt(DECODE_PROMPT_LEN)
        one = timed(p, 1)
        many = timed(p, decode_tokens)
        if many > one:
            decode.append((decode_tokens - 1) / (many - one))
        else:  # a stall during t(1 token) (a loaded machine): no rate, not an infinite one
            invalid.append([one, many])
        prefill.append(prompt_len / timed(prompt(prompt_len), 1))
    if not decode:
        raise SystemExit(f"no valid decode sample: t(1 token) >= t(N tokens) in {invalid}")
    result = {"start_seconds": start, "rss_anon_bytes": rss, "decode_tok_s": max(decode),
              "prefill_tok_s": max(prefill), "decode_all": decode, "prefill_all": prefill,
              "decode_invalid_samples": invalid,
              "decode_tokens": decode_tokens, "prompt_len": prompt_len, "n_threads": threads,
              "system_info": llama_cpp.llama_print_system_info().decode()}
    write_result(out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
