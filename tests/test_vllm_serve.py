"""`vllm serve` on a cpu-quant GPTQ artifact, over HTTP, held to the artifact's dequantized weights.

The server runs as a user runs it: the cpu_quant plugin installed, none of its switches set, so
GPTQ layers run on the kernel this CPU's row of ``cpu_quant.formats.kernels.KERNEL_TABLE`` names
(tinygemm on x86 without AMX, which is also what makes GPTQ servable on AVX2-only CPUs).

End-to-end tier: quantizes the demo model (session fixture ``gptq_artifact``), starts the real
``vllm`` console script on loopback, and asks ``/v1/completions`` and ``/v1/chat/completions``
for greedy tokens. Needs the ``vllm`` metadata alias (``python -m cpu_quant.vllm_alias``,
run by scripts/setup.sh): without it ``vllm serve`` dies on ``importlib.metadata.version("vllm")``.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .conftest import needs_vllm_gptq_kernel
from .helpers.vllm_paths import NEAR_TIE_NATS, reference_context, vllm_gptq_path

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 8
HEALTH_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 120
SERVED_NAME = "demo-gptq"
PROMPTS = [
    "The capital of France is",
    "Emma Woodhouse, handsome, clever, and rich,",
    "def fibonacci(n):",
    "It is a truth universally acknowledged that",
]
# vLLM returns log-probs from before ``min_tokens`` masks EOS (its default logprobs_mode is
# raw_logprobs), so the runner-up can be the masked EOS: ask for a few more and drop EOS.
TOP_LOGPROBS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited with {proc.returncode} before /health:\n"
                                 f"{_log_tail(log)}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise AssertionError(f"vllm serve not healthy after {HEALTH_TIMEOUT_S} s:\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (API server, engine core, workers), SIGKILL if it
    is still there after 30 s."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _on_tinygemm() -> bool:
    from cpu_quant.core.cpu import local_cpu
    from cpu_quant.formats.kernels import serving_kernels

    return serving_kernels(local_cpu()).gptq_kernel == "tinygemm"


@contextmanager
def vllm_server(model_dir: Path, log: Path, env: dict | None = None, clean: bool = False
                ) -> Iterator[str]:
    """``vllm serve model_dir`` on 127.0.0.1 (a free port); yields the base URL once healthy.
    ``clean``: none of cpu_quant's ``CPU_QUANT_*`` switches, nor vLLM's W4A8 switch, reaches the
    server (as on a user's machine)."""
    vllm_cli = Path(sys.executable).with_name("vllm")
    assert vllm_cli.is_file(), f"no vllm console script beside {sys.executable}"
    port = _free_port()
    cmd = [str(vllm_cli), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", "512",
           "--enforce-eager", "--seed", "0"]
    base_env = {k: v for k, v in os.environ.items()
                if not (clean and (k.startswith("CPU_QUANT_") or k == "VLLM_CPU_INT4_W4A8"))}
    full_env = dict(base_env, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, base, log)
        yield base
    finally:
        _stop(proc)


def _steps(top_logprobs: list[dict[str, float]]) -> list[dict[int, float]]:
    """``{"token_id:N": logprob}`` per step (``return_tokens_as_token_ids``) -> ``{N: logprob}``."""
    return [{int(k.removeprefix("token_id:")): v for k, v in step.items()}
            for step in top_logprobs]


def complete(base: str, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    """One /v1/completions request, prompts given as token ids: per prompt, the greedy tokens
    and the top log-probs of every step."""
    resp = _post(f"{base}/v1/completions", {
        "model": SERVED_NAME, "prompt": prompts, "max_tokens": NEW_TOKENS,
        "min_tokens": NEW_TOKENS, "temperature": 0, "logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True, "return_token_ids": True})
    choices = sorted(resp["choices"], key=lambda c: c["index"])
    return [(c["token_ids"], _steps(c["logprobs"]["top_logprobs"])) for c in choices]


def chat(base: str) -> tuple[list[int], list[int], list[dict[int, float]], str]:
    """One /v1/chat/completions request: (the prompt ids vLLM rendered from the chat, greedy
    tokens, top log-probs per step, text)."""
    resp = _post(f"{base}/v1/chat/completions", {
        "model": SERVED_NAME, "messages": CHAT, "max_tokens": NEW_TOKENS,
        "min_tokens": NEW_TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = resp["choices"][0]
    top = _steps([{t["token"]: t["logprob"] for t in step["top_logprobs"]}
                  for step in choice["logprobs"]["content"]])
    return resp["prompt_token_ids"], choice["token_ids"], top, choice["message"]["content"]


def reference_greedy(model, prompt_ids: list[int]) -> list[int]:
    """Greedy tokens of the torch model; ``min_new_tokens`` masks EOS as vLLM's ``min_tokens``."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    return out[0, len(prompt_ids):].tolist()


def assert_greedy_agrees(got: list[int], top: list[dict[int, float]], expected: list[int],
                         masked: set[int], tolerance: float, what: str) -> None:
    """``got`` equals ``expected`` up to a first difference at which the reference's token is
    within ``tolerance`` nats of vLLM's choice in vLLM's log-probs (among the tokens not
    ``masked``): where several tokens lie that close, either arithmetic may pick any of them."""
    assert len(got) == len(expected) == NEW_TOKENS, (what, got, expected)
    diff = next((i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None)
    if diff is None:
        return
    step = {t: lp for t, lp in top[diff].items() if t not in masked}
    margin = step[got[diff]] - step.get(expected[diff], float("-inf"))
    assert margin <= tolerance, (
        f"{what}: vLLM left the dequantized model's greedy path at token {diff} by "
        f"{margin:.3f} nats (tolerance {tolerance}; vLLM's top log-probs there: {top[diff]}):\n"
        f"  vLLM      {got}\n  reference {expected}")


@pytest.mark.e2e
@pytest.mark.vllm
@needs_vllm_gptq_kernel
def test_vllm_serve_answers_like_the_dequantized_weights(gptq_artifact: Path, tmp_path: Path):
    import torch
    from transformers import AutoTokenizer

    from cpu_quant.eval.dequantized import load_model

    try:
        md.version("vllm")
    except md.PackageNotFoundError:
        pytest.fail("no 'vllm' distribution metadata, so `vllm serve` cannot start: run "
                    "python -m cpu_quant.vllm_alias (scripts/setup.sh does)")
    tok = AutoTokenizer.from_pretrained(gptq_artifact)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    # as a user runs it: the plugin installed, no switch of ours set, so the kernel is the one
    # this CPU's kernel-table row names
    log = tmp_path / "vllm-serve.log"
    with vllm_server(gptq_artifact, log, clean=True) as base:
        completions = complete(base, prompts)
        chat_prompt, chat_tokens, chat_top, chat_text = chat(base)
    kernel = "GptqTinygemmLinearKernel" if _on_tinygemm() else "CPUWNA16LinearKernel"
    assert f"Using {kernel} for AutoGPTQLinearMethod" in log.read_text(), _log_tail(log)

    # the artifact's chat template, rendered by vLLM as by transformers
    assert chat_prompt == tok.apply_chat_template(CHAT, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    assert chat_text == tok.decode(chat_tokens, skip_special_tokens=True)
    path = vllm_gptq_path()
    tolerance = NEAR_TIE_NATS[path]
    reference = load_model(gptq_artifact, dtype=torch.bfloat16)
    eos = reference.generation_config.eos_token_id
    masked = set(eos if isinstance(eos, list) else [eos])  # by min_tokens / min_new_tokens
    cases = [(f"completion {p!r}", ids, got, top)
             for p, ids, (got, top) in zip(PROMPTS, prompts, completions, strict=True)]
    cases.append(("chat", chat_prompt, chat_tokens, chat_top))
    with reference_context(reference, path):  # on the W4A8 path: that kernel's arithmetic
        for what, ids, got, top in cases:
            assert_greedy_agrees(got, top, reference_greedy(reference, ids), masked, tolerance,
                                 what)
