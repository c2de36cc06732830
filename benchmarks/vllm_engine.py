"""Start one real vLLM engine and print what it allocated, as one JSON line.

Run by benchmarks/runtime_patches_bench.py and tests/test_runtime_patches.py in a subprocess,
because vLLM spawns its engine core and worker processes (hence the ``__main__`` guard).

Usage: python benchmarks/vllm_engine.py MODEL_DIR [--kv-bytes N] [--compile]
                                              [--max-model-len N] [--dtype D]

Output: the last stdout line is ``RESULT {json}`` with the keys ``start_seconds`` (LLM(...)
construction), ``num_blocks`` and ``block_size`` (read back from the engine's cache config after
start-up), ``kv_tokens`` (their product), ``anon_rss_bytes`` (RssAnon summed over this process
and all of its descendants right after start-up), ``anon_rss_by_process`` ({pid: [name, bytes]}),
``text`` (greedy completion of a fixed prompt), ``plugins_loaded_before_start`` and
``outcomes`` (cpu_quant plugin outcomes in this process, [] when the plugin did not run).

``CPU_QUANT_TEST_SIMULATE_UPSTREAM=1`` simulates, in every process of the engine (spawned
children import this file as ``__mp_main__`` before they load plugins), an upstream vLLM whose
patch targets changed: the KV budget overwrite is gone (an explicit ``kv_cache_memory_bytes``
survives by upstream's own doing), ``CPUWorker.compile_or_warm_up_model`` calls ``malloc_trim``
itself, and ``_try_load_aot_compiled_fn`` no longer exists (unused with ``enforce_eager``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

PROMPT = "The capital of France is"


def _simulate_upstream_changes() -> None:
    from vllm.compilation import decorators
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.worker import cpu_worker

    upstream_check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):  # an upstream that honours the explicit budget
        env_key = "VLLM_CPU_KVCACHE_SPACE"
        hidden = None
        if vllm_config.cache_config.kv_cache_memory_bytes is not None:
            hidden = os.environ.pop(env_key, None)
        try:
            upstream_check(cls, vllm_config)
        finally:
            if hidden is not None:
                os.environ[env_key] = hidden

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

    upstream_warm_up = cpu_worker.CPUWorker.compile_or_warm_up_model

    def compile_or_warm_up_model(self):  # an upstream that releases memory itself
        result = upstream_warm_up(self)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return result

    cpu_worker.CPUWorker.compile_or_warm_up_model = compile_or_warm_up_model
    del decorators._try_load_aot_compiled_fn


if os.environ.get("CPU_QUANT_TEST_SIMULATE_UPSTREAM") == "1":
    _simulate_upstream_changes()


def run_process_tree(cmd: list[str], env: dict[str, str], timeout: float
                     ) -> tuple[int, str, str, float]:
    """Run ``cmd`` (an engine start) in its own session and return (exit status, stdout,
    stderr, wall seconds). On a timeout the whole tree goes (engine core and worker included),
    not just the runner, and stderr says so. Shared by the tests and the benchmark."""
    import signal
    import subprocess

    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\nkilled after {timeout} s"
    return proc.returncode, out, err, time.perf_counter() - t0


def _rss_by_process(pids: list[int]) -> dict[str, list]:
    """{pid: [name, RssAnon bytes]}; a short-lived child (a compiler, ldconfig) may exit while
    being read and is left out."""
    from cpu_quant.core import memory
    from cpu_quant.core.errors import CpuQuantError

    out: dict[str, list] = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            out[str(pid)] = [name, memory.anon_rss_bytes(pid, tree=False)]
        except (OSError, CpuQuantError):
            continue
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--kv-bytes", type=int, default=None)
    parser.add_argument("--compile", action="store_true", help="torch.compile (default: eager)")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    import vllm.plugins
    from vllm import LLM, SamplingParams

    from cpu_quant.core import memory

    plugins_loaded_before = vllm.plugins.plugins_loaded
    kwargs = {}
    if args.kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = args.kv_bytes
    t0 = time.perf_counter()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, dtype=args.dtype,
              enforce_eager=not args.compile, seed=0, **kwargs)
    start_seconds = time.perf_counter() - t0
    rss_total = memory.anon_rss_bytes(tree=True)
    by_process = _rss_by_process([os.getpid(), *memory.descendant_pids(os.getpid())])
    cache_config = llm.llm_engine.vllm_config.cache_config
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)

    outcomes = []
    if "cpu_quant.runtime_patches" in sys.modules:
        from cpu_quant import runtime_patches

        outcomes = [o.__dict__ for o in runtime_patches.registered_outcomes() or []]
    result = {
        "start_seconds": start_seconds,
        "num_blocks": cache_config.num_gpu_blocks,
        "block_size": cache_config.block_size,
        "kv_tokens": cache_config.num_gpu_blocks * cache_config.block_size,
        "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
        "anon_rss_bytes": rss_total,
        "anon_rss_by_process": by_process,
        "text": out[0].outputs[0].text,
        "plugins_loaded_before_start": plugins_loaded_before,
        "outcomes": outcomes,
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
