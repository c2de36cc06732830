"""The pass worker of the ``runtime_patches`` suite (``benchmarks/suites/runtime_patches.py``):
vLLM engine start (cold and warm compile cache) and RssAnon after start-up, stock vs patched.

    python -m benchmarks.runtime_patches_bench one-pass MODEL OUT.json

The suite runs one harness suite per artifact (``runtime_patches-LABEL``), its arms below.

Arms, differing only in ``VLLM_PLUGINS`` (the A/B switch the plugin promises):

``stock``        ``VLLM_PLUGINS=""``: no general plugin at all (the baseline)
``patched``      ``VLLM_PLUGINS=cpu_quant``: only this project's plugin
``patches-off``  on a ``cpu_int4`` artifact, which stock vLLM cannot load (the quantization
                 method comes with the plugin), the baseline instead: the plugin with its three
                 patches switched off (``CPU_QUANT_PATCH_{KV_BUDGET,RELEASE_MEMORY,AOT_CACHE}=0``)

Every pass of an arm is one process, ``python -m benchmarks.runtime_patches_bench one-pass
MODEL OUT.json``, that starts the engine twice through ``benchmarks/vllm_engine.py``
(the same runner the tests use): a **cold** start with compilation (``enforce_eager`` off) into
a fresh ``VLLM_CACHE_ROOT`` private to that arm and pass (compile caches key on config, so
arms must never share one), then a **warm** start on the same cache. Both use
``kv_cache_memory_bytes=128 MiB``, ``max_model_len=256``, bf16 activations, and
``VLLM_CPU_KVCACHE_SPACE`` unset (the pass removes the empty value the harness passes), and
``VLLM_CPU_OMP_THREADS_BIND`` = every
CPU of the affinity mask, so both arms allocate the same KV
cache and the KV-budget patch cannot change the memory compared.

Metrics (all lower-is-better):
``cold_start_seconds``, ``warm_start_seconds``  ``LLM(...)`` construction time (imports excluded)
``warm_over_cold``                          warm / cold within the pass
``rss_anon_after_start_bytes``              RssAnon summed over the engine's process tree right
                                            after the warm ``LLM(...)`` returned (model loaded,
                                            warmed up, KV cache allocated)
plus the harness' ``wall_seconds`` and ``peak_rss_anon_bytes`` of the whole pass process.
Each pass checks that its knob is connected (MEASURING.md rule 4), from the engine's own log
lines (``cpu_quant patch <name>: <status>``): the patched arm must have every patch applied, the
stock arm no plugin line, the patches-off arm every patch off; whether the warm start loaded the
AOT artifact or compiled again is recorded as an extra.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from .harness import Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "benchmarks" / "vllm_engine.py"
KV_BYTES = 128 << 20
ENGINE_TIMEOUT_S = 1800
PASS_TIMEOUT_S = 2 * ENGINE_TIMEOUT_S + 60

METRICS = [
    Metric("cold_start_seconds", "s", "lower"),
    Metric("warm_start_seconds", "s", "lower"),
    Metric("warm_over_cold", "x", "lower"),
    Metric("rss_anon_after_start_bytes", "B", "lower"),
]
ARMS = {"stock": "", "patched": "cpu_quant"}  # arm -> VLLM_PLUGINS
PATCHES = ("kv_budget", "release_memory", "aot_cache")
# Stock vLLM cannot load a cpu_int4 checkpoint (the quantization method comes with the plugin),
# so on that artifact the baseline keeps the plugin and switches its three patches off.
PATCHES_OFF = {f"CPU_QUANT_PATCH_{name.upper()}": "0" for name in PATCHES}
PATCH_LINE = re.compile(r"cpu_quant patch (\w+): (\w+)")


# -- one pass (runs in its own process) --------------------------------------------------------
def _start(model: str, env: dict[str, str]) -> dict:
    cmd = [sys.executable, str(ENGINE), model, "--compile", "--kv-bytes", str(KV_BYTES)]
    from .vllm_engine import run_process_tree

    returncode, out, err, wall = run_process_tree(cmd, env, ENGINE_TIMEOUT_S)
    log = out + err
    if returncode != 0:
        sys.stderr.write(log[-4000:])
        raise SystemExit(f"engine start failed with exit status {returncode}")
    result = json.loads(next(line for line in out.splitlines()
                             if line.startswith("RESULT "))[len("RESULT "):])
    result.update({
        "process_wall_seconds": wall,
        "plugin_lines": log.count("cpu_quant patch "),
        "patch_status": {name: sorted({m.group(2) for m in PATCH_LINE.finditer(log)
                                       if m.group(1) == name}) for name in PATCHES},
        "saved_aot": "saved AOT compiled function" in log,
        "loaded_aot": "Directly load AOT compilation" in log,
        "compiled_again": "Compiling model again" in log,
        "release_lines": [ln.split("] ", 1)[-1] for ln in log.splitlines()
                          if "release_memory: after" in ln],
    })
    return result


def one_pass(model: str, out: Path) -> None:
    env = dict(os.environ)
    # The harness can only add variables; an empty VLLM_CPU_KVCACHE_SPACE is its way of saying
    # "unset" (vLLM's envs.py would fail on int("")).
    if env.get("VLLM_CPU_KVCACHE_SPACE") == "":
        del env["VLLM_CPU_KVCACHE_SPACE"]
    cold = _start(model, env)
    warm = _start(model, env)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"cold": cold, "warm": warm}, indent=1))
    os.replace(tmp, out)


# -- the suite ---------------------------------------------------------------------------------
def omp_bind() -> str:
    """Every CPU this process may run on, e.g. "0,1". vLLM's default ("auto") reserves one core
    for the engine core process, which on a 2-core machine halves the model's threads."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def _command(model: Path, plugins: str, switches: dict[str, str]):
    def command(ctx: PassContext) -> Command:
        env = {"VLLM_PLUGINS": plugins, "VLLM_CACHE_ROOT": str(ctx.workdir / "vllm-cache"),
               "VLLM_CPU_KVCACHE_SPACE": "", "VLLM_LOGGING_LEVEL": "INFO",
               "VLLM_CPU_OMP_THREADS_BIND": omp_bind(), **switches}
        return Command([sys.executable, "-m", "benchmarks.runtime_patches_bench", "one-pass",
                        str(model), str(ctx.workdir / "pass.json")], env=env, cwd=str(REPO),
                       timeout=PASS_TIMEOUT_S)
    return command


def _read(ctx: PassContext) -> dict:
    return json.loads((ctx.workdir / "pass.json").read_text())


def _check_connected(arm: str, start: dict) -> None:
    """MEASURING.md rule 4: the knob an arm turns must show in the engine's own log."""
    status = start["patch_status"]
    if arm == "stock" and start["plugin_lines"] != 0:
        raise HarnessError("stock arm: the cpu_quant plugin ran")
    if arm == "patched" and not all(set(status[p]) & {"applied", "deferred"} for p in PATCHES):
        raise HarnessError(f"patched arm: not every patch was applied: {status}")
    if arm == "patches-off" and not all(status[p] == ["off"] for p in PATCHES):
        raise HarnessError(f"patches-off arm: a patch was not switched off: {status}")


def _collect(arm: str):
    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        data = _read(ctx)
        cold, warm = data["cold"], data["warm"]
        for start in (cold, warm):
            _check_connected(arm, start)
        return {"cold_start_seconds": cold["start_seconds"],
                "warm_start_seconds": warm["start_seconds"],
                "warm_over_cold": warm["start_seconds"] / cold["start_seconds"],
                "rss_anon_after_start_bytes": warm["anon_rss_bytes"]}
    return collect


def _extras(ctx: PassContext, run: RunRecord) -> dict:
    data = _read(ctx)
    return {phase: {k: data[phase][k] for k in
                    ("process_wall_seconds", "kv_tokens", "anon_rss_bytes", "anon_rss_by_process",
                     "saved_aot", "loaded_aot", "compiled_again", "release_lines", "text",
                     "patch_status")}
            for phase in ("cold", "warm")}


def arm_plan(model: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """arm -> (VLLM_PLUGINS, patch switches); the first arm is the baseline."""
    config = json.loads((Path(model) / "config.json").read_text())
    if config.get("quantization_config", {}).get("quant_method") == "cpu_int4":
        return {"patches-off": ("cpu_quant", PATCHES_OFF), "patched": ("cpu_quant", {})}
    return {name: (plugins, {}) for name, plugins in ARMS.items()}


def build_suite(label: str, model: Path) -> Suite:
    plan = arm_plan(model)
    arms = [Arm(name, {"VLLM_PLUGINS": plugins, **switches}, _command(model, plugins, switches),
                _collect(name), extras=_extras)
            for name, (plugins, switches) in plan.items()]
    baseline = next(iter(plan))
    import torch

    return Suite(
        name=f"runtime_patches-{label}",
        description=("vLLM CPU engine start, cold and warm compile cache, and RssAnon after "
                     f"start-up, {baseline} vs cpu_quant plugin, on the {label} artifact"),
        metrics=METRICS, arms=arms, baseline=baseline,
        settings={"artifact": label, "model": str(model), "kv_cache_memory_bytes": KV_BYTES,
                  "max_model_len": 256, "dtype": "bfloat16", "enforce_eager": False,
                  "VLLM_CPU_KVCACHE_SPACE": None, "VLLM_CPU_OMP_THREADS_BIND": omp_bind(),
                  "torch_threads": torch.get_num_threads()},
        inputs={label: model},
        notes=["start times exclude interpreter start and imports (process_wall_seconds in the "
               "extras include them)"],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.runtime_patches_bench",
                                 description="one pass of the runtime_patches suite: two engine "
                                             "starts, cold and warm")
    sub = ap.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("one-pass")
    one.add_argument("model")
    one.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    one_pass(args.model, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
