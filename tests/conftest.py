"""Shared fixtures (the real demo model, a real `cpu-quant gptq` artifact, tiny random models)
and the two test tiers.

* The unit tier, what ``pytest`` runs with no arguments: math, layouts, plans, CLI argument
  errors, tiny random models, the real demo model only where reading it is the point.
* The end-to-end tier, ``pytest -m e2e``: the real vLLM, ExecuTorch, llama.cpp and GPTQModel,
  and real quantizations of the demo model. A test is in it when it is marked ``e2e``,
  ``vllm`` or ``slow``, or when it uses one of the fixtures in :data:`E2E_FIXTURES` (they
  quantize the demo model or start a runtime; each is built once per run and shared).

``pytest -m "e2e or not e2e"`` runs both in one process. CI runs each tier on two
pytest-xdist workers (``-n 2``; the end-to-end tier with ``--dist loadgroup``). In the
end-to-end tier:

* every demo-model artifact a fixture builds is built once per run, by whichever worker asks
  first, into a directory the workers share (:func:`build_once`); the other worker waits for
  it and reuses it;
* tests that share a fixture which cannot be shared through files (running engines, a peer's
  process, a module's benchmark run) go to one worker together (:data:`WORKER_GROUPS`);
* the longest tests are handed out first (:data:`LONGEST_FIRST`), so that no worker is left
  alone with one of them at the end.

Each worker runs on its own share of the CPUs (:func:`_pin_worker`), and so does everything it
starts: torch's threads, vLLM's engines, ExecuTorch's thread pool and the ranks of a run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest


def _pin_worker() -> None:
    """Pin this pytest-xdist worker to its own share of the CPUs, before torch loads (its
    OpenMP pool sizes itself to the affinity mask, and the processes the tests start inherit
    it), instead of two workers each running two threads on two cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus, workers, index = sorted(os.sched_getaffinity(0)), int(count), int(worker.lstrip("gw"))
    if workers < 2:
        return
    share = max(1, len(cpus) // workers)
    start = (index * share) % len(cpus)
    os.sched_setaffinity(0, cpus[start:start + share])


_pin_worker()

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "cpu_quant.cli"]
# Small calibration for CI; the benchmarks use the full 128 x 512.
SMALL_CALIB = ["--samples", "16", "--seqlen", "256"]


# Fixtures that quantize the demo model or start a real runtime: a test using any of them (even
# through another fixture) belongs to the end-to-end tier.
E2E_FIXTURES = frozenset({
    "demo_formats", "gptq_artifact", "rtn_search_artifact", "asym_artifact", "sym_artifact",
    "uniform_artifact", "peer", "engines", "served_artifact", "vllm_run", "isa_results", "xnnpack_8da8w",
    "qnn_w8a16", "qnn_16a4w", "xnnpack_8da4w", "tiny_gptq", "demo_gptq_g32", "quantize_dir",
    "quantize_result", "fidelity_result", "stream_and_hidden", "random_1b", "gptq_1b",
})
E2E_MARKS = ("e2e", "vllm", "slow")


# Fixtures whose value lives in one worker's memory (engines started once, a peer's run, a
# module's benchmark run): the tests that use one run on the same worker, so it is built once.
WORKER_GROUPS = {
    "engines": "vllm-engines", "vllm_run": "tinygemm-vllm", "peer": "peer-loaders",
    "quantize_dir": "bench-quantize", "xnnpack_8da8w": "phone-tiny", "qnn_w8a16": "phone-tiny",
    "qnn_16a4w": "phone-tiny", "xnnpack_8da4w": "phone-tiny", "tiny_gptq": "phone-tiny",
    # one worker builds the 1B artifact and runs its tests: on two, the second would wait
    # idle for the whole quantization
    "gptq_1b": "scale-1b", "random_1b": "scale-1b",
}

# The end-to-end tier's longest tests and groups: seconds on one (pinned) worker of the 2-core
# CI machine in a clean-clone run of both tiers, fixtures included. Handing them out in this
# order left the two workers within 3 % of each other. The rest keep their file order.
LONGEST_FIRST = (
    "test_scale.py",  # writes and quantizes a 1.2B-parameter model, then serves it
    "test_demo_model_8da4w_holds_the_gptq_codes",  # ~330 s with its group-32 GPTQ run
    "test_runtime_patches.py",  # seven engine starts, ~710 s
    "test_runtime_suite_smoke",  # two engine starts through the harness, ~120 s
    "test_tinygemm.py",  # a calibrated cpu_int4 run and an engine start, ~350 s
    "test_ranks_write_the_one_process_artifact",  # nine rank processes, ~135 s
    "test_phone_suite_smoke",  # two ExecuTorch exports, ~90 s
    "test_peer_loaders.py",  # GPTQModel's loader in its own venv, ~50 s
    "test_sigkill_then_resume_is_bit_identical",  # three runs of a 12-layer tiny model, ~90 s
    "test_fidelity_ordering_on_heldout_text",  # two more demo-model runs, ~190 s
    "test_export_phone.py",  # the tiny model's exports, ~320 s
)


def _longest_first(item: pytest.Item) -> int:
    for rank, fragment in enumerate(LONGEST_FIRST):
        if fragment in item.nodeid:
            return rank
    return len(LONGEST_FIRST)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if any(item.get_closest_marker(m) for m in E2E_MARKS) or E2E_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.e2e)
        groups = {WORKER_GROUPS[f] for f in item.fixturenames if f in WORKER_GROUPS}
        if groups:
            item.add_marker(pytest.mark.xdist_group(sorted(groups)[0]))
    items.sort(key=_longest_first)  # stable: the rest keep their order


def pytest_configure(config) -> None:
    # hand the work out in the order above (pytest-xdist would otherwise put the groups with
    # the most tests first, whatever their length)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def vllm_gptq_unavailable() -> str | None:
    """Why vLLM with the cpu_quant plugin (installed with cpu-quant) cannot run a GPTQ checkpoint
    on this CPU, or None: the product's own check on /proc/cpuinfo (its kernel table puts GPTQ
    layers on tinygemm on x86 with AVX2 or AVX-512, so only stock vLLM's limits remain
    elsewhere)."""
    from cpu_quant.core.cpu import read_machine
    from cpu_quant.formats.gptq.serving import vllm_gptq_unavailable as why

    return why(read_machine())


def stock_vllm_gptq_unavailable() -> str | None:
    """Why stock vLLM (no cpu_quant plugin, or its GPTQ kernel switched off) cannot run a GPTQ
    checkpoint on this CPU (no AVX-512: its AVX2 kernel library lacks cpu_gemm_wna16), or None."""
    from cpu_quant.core.cpu import read_machine
    from cpu_quant.formats.gptq.serving import stock_vllm_gptq_unavailable as why

    return why(read_machine())


# vLLM serving a GPTQ checkpoint as users run it (the plugin installed): skipped, with the
# reason, only where neither vLLM's build nor the plugin's kernel can run it.
needs_vllm_gptq_kernel = pytest.mark.skipif(vllm_gptq_unavailable() is not None,
                                            reason=f"{vllm_gptq_unavailable()}")
# stock vLLM's own GPTQ kernel (tests that compare against it or exclude the plugin)
needs_stock_vllm_gptq_kernel = pytest.mark.skipif(stock_vllm_gptq_unavailable() is not None,
                                                  reason=f"{stock_vllm_gptq_unavailable()}")


def run_cli(*args: str, check: bool = True, timeout: int = 1800, env: dict | None = None
            ) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"cpu-quant {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def demo_src() -> Path:
    from cpu_quant.models.demo import demo_model_path

    return demo_model_path()


def build_once(dst: Path, build: Callable[[], object]) -> Path:
    """``dst``, built by ``build()`` once per test run: the first worker to ask builds it under
    a file lock while the others wait, then everyone reuses it. Only a build that returned is
    marked done; after a failure the next caller builds again (and reports its own error)."""
    from filelock import FileLock

    done = dst.with_name(dst.name + ".done")
    with FileLock(str(dst) + ".lock"):
        if not done.exists():
            if dst.exists():
                shutil.rmtree(dst)
            build()
            done.touch()
    return dst


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory) -> Path:
    """Demo-model artifacts, shared by the run's workers (their base directories' parent,
    which is this run's own): build them with :func:`build_once`."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "artifacts"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def demo_formats(demo_src: Path, artifacts_dir: Path) -> Path:
    """The real main job writing every format from one calibrated run (GPTQ, group 128, head
    quantized, smoothing folded in: the defaults; small calibration): ``DIR/gptq``,
    ``DIR/cpu_int4``, ``DIR/gguf``. The one
    quantization of the demo model that the end-to-end tier shares."""
    dst = artifacts_dir / "demo-formats"
    return build_once(dst, lambda: run_cli(
        "gptq", str(demo_src), str(dst), "--group", "128", *SMALL_CALIB, "--no-eval",
        "--format", "gptq,cpu_int4,gguf"))


@pytest.fixture(scope="session")
def gptq_artifact(demo_formats: Path) -> Path:
    """The main job's GPTQ checkpoint (see ``demo_formats``)."""
    return demo_formats / "gptq"


@pytest.fixture(scope="session")
def rtn_plain_artifact(demo_src: Path, artifacts_dir: Path) -> Path:
    dst = artifacts_dir / "demo-rtn-plain"
    return build_once(dst, lambda: run_cli("gptq", str(demo_src), str(dst), "--method", "rtn",
                                           "--calib", "none", "--no-scale-search", "--no-eval"))


@pytest.fixture(scope="session")
def rtn_search_artifact(demo_src: Path, artifacts_dir: Path) -> Path:
    dst = artifacts_dir / "demo-rtn-search"
    return build_once(dst, lambda: run_cli("gptq", str(demo_src), str(dst), "--method", "rtn",
                                           *SMALL_CALIB, "--no-eval"))


@pytest.fixture(scope="session")
def tiny_llama(demo_src: Path, tmp_path_factory) -> Path:
    from cpu_quant.models.tiny import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", demo_src)


@pytest.fixture(scope="session")
def hostile_bases(tiny_llama, tmp_path_factory):
    """The hostile-input corpus' base inputs (tests/hostile/generate.py): the tiny model,
    another of its shapes, its GPTQ, cpu_int4 and GGUF artifacts (RTN), a run interrupted
    after its first layer, and a short calibration text. Built in-process, once."""
    from .hostile.generate import build_bases

    return build_bases(tmp_path_factory.mktemp("hostile-bases"), model=tiny_llama)


def put_nan(checkpoint: Path, tensor: str, index: tuple[int, int]) -> None:
    """Write one NaN into ``tensor`` of a one-file checkpoint (``model.safetensors``)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(checkpoint / "model.safetensors")
    w = tensors[tensor].clone()
    w[index] = float("nan")
    tensors[tensor] = w
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
