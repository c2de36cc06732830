"""Runtime benchmark: vLLM decode and prefill speed and memory, bf16 vs GPTQ vs cpu_int4.

    python -m benchmarks.runtime_bench [--models demo,qwen05b] [--passes N] [--smoke]
                                       [--out DIR] [--workdir DIR] [--eager]

One harness suite per model (``benchmarks/harness.py``: arms interleaved with the order rotated
every pass, >= 3 passes, median and spread, per-pass ratios to the ``bf16`` arm, failures
recorded, provenance with artifact sha256). Arms:

``bf16``      the source checkpoint (vLLM's unquantized CPU GEMM)
``gptq``      ``cpu-quant gptq`` layout, served by stock vLLM (``cpu_gemm_wna16`` here: no AMX)
``cpu_int4``  ``cpu-quant tinygemm`` layout, served through the cpu_quant plugin (tinygemm)

Models: ``demo`` (SmolLM2-135M; per-step overhead dominates) and ``qwen05b``: a random-init
Qwen2 with Qwen2-0.5B's shapes (hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab
151936, tied embeddings), bandwidth-bound. Decode speed does not depend on trained weights, so
the quantized arms are built data-free (RTN, ``--calib none --no-scale-search``): the speed
measured is the layout's and the kernel's, not the calibration's. Fidelity is measured
elsewhere (``cpu-quant eval``, docs/tinygemm.md).

Each pass of an arm is one process (``one-pass``) that starts ``LLM(model)`` with
``VLLM_CPU_OMP_THREADS_BIND`` = every CPU of the affinity mask (vLLM's default binds one core
less), a private ``VLLM_CACHE_ROOT`` per arm (compile caches key on config), prefix caching off
and a 256 MiB KV cache, then measures:

``rss_anon_bytes``         RssAnon summed over the engine's process tree after start-up
``decode_tok_s``           batch 1: ``(N - 1) / (t(N tokens) - t(1 token))`` for a 16-token
                           prompt, N = ``--decode-tokens`` (128), best of 3 inside the pass
``prefill_tok_s``          a 512-token prompt, 1 output token: 512 / time, best of 3
``start_seconds``          ``LLM(...)`` construction

Each pass checks its knob (MEASURING.md rule 4): the engine's whole log (all processes) goes
to ``pass.json.log``; the cpu_int4 arm must log the tinygemm layout line, the gptq arm vLLM's
``CPUWNA16LinearKernel``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .harness import Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite, run_suite

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
PASS_TIMEOUT_S = 3600
KV_BYTES = 256 << 20
PROMPT_LEN = 512
DECODE_PROMPT_LEN = 16
METRICS = [
    Metric("decode_tok_s", "tok/s", "higher"),
    Metric("prefill_tok_s", "tok/s", "higher"),
    Metric("rss_anon_bytes", "B", "lower"),
    Metric("start_seconds", "s", "lower"),
]
QWEN05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
               max_position_embeddings=4096, tie_word_embeddings=True)
KNOBS = {"cpu_int4": "cpu_int4: tinygemm kernel layout", "gptq": "CPUWNA16LinearKernel"}


# -- one pass (its own process) -----------------------------------------------------------------
def _timed(llm, prompt: list[int], max_tokens: int) -> float:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return time.perf_counter() - t0


def one_pass(model: str, out: Path, decode_tokens: int, eager: bool) -> None:
    import random

    # the engine core and worker inherit these descriptors: their log lines land in one file,
    # where the knob check can read them
    log_path = out.with_name(out.name + ".log")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)

    from vllm import LLM

    from cpu_quant.runtime_patches.memory import anon_rss_bytes

    t0 = time.perf_counter()
    llm = LLM(model=model, max_model_len=PROMPT_LEN + decode_tokens + 16, dtype="bfloat16",
              kv_cache_memory_bytes=KV_BYTES, enforce_eager=eager, seed=0,
              enable_prefix_caching=False)
    start = time.perf_counter() - t0
    rss = anon_rss_bytes(tree=True)
    vocab = llm.llm_engine.vllm_config.model_config.get_vocab_size()
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    _timed(llm, prompt(DECODE_PROMPT_LEN), 8)  # warm-up
    decode, prefill = [], []
    for _ in range(3):
        p = prompt(DECODE_PROMPT_LEN)
        one = _timed(llm, p, 1)
        many = _timed(llm, p, decode_tokens)
        decode.append((decode_tokens - 1) / max(many - one, 1e-9))
        prefill.append(PROMPT_LEN / _timed(llm, prompt(PROMPT_LEN), 1))
    sys.stdout.flush()
    sys.stderr.flush()
    log = log_path.read_text(errors="replace")
    result = {"start_seconds": start, "rss_anon_bytes": rss, "decode_tok_s": max(decode),
              "prefill_tok_s": max(prefill), "decode_all": decode, "prefill_all": prefill,
              "knobs": {arm: text in log for arm, text in KNOBS.items()}}
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out)


# -- artifacts ------------------------------------------------------------------------------------
def _random_qwen(dst: Path) -> Path:
    import shutil

    import torch
    import transformers

    from cpu_quant.models.demo import demo_model_path

    if (dst / "config.json").is_file():
        return dst
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    config = transformers.Qwen2Config(**QWEN05B)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp)
    # any tokenizer will do for random ids; vLLM only needs one to start
    demo = demo_model_path()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, tmp / name)
    os.replace(tmp, dst)
    return dst


def _quantized(src: Path, dst: Path, layout) -> Path:
    from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint

    if not (dst / "config.json").is_file():
        quantize_checkpoint(src, dst, QuantSettings(method="rtn", calib="none",
                                                    scale_search=False), layout,
                            overwrite=True, progress=True)
    return dst


def build_artifacts(model: str, workdir: Path) -> dict[str, Path]:
    from cpu_quant.models.demo import demo_model_path
    from cpu_quant.quantize.gptq_cpu_export import GPTQLayout
    from cpu_quant.quantize.tinygemm_pack import CpuInt4Layout

    src = demo_model_path() if model == "demo" else _random_qwen(workdir / "qwen05b-bf16")
    return {"bf16": src,
            "gptq": _quantized(src, workdir / f"{model}-gptq-rtn", GPTQLayout()),
            "cpu_int4": _quantized(src, workdir / f"{model}-cpu_int4-rtn", CpuInt4Layout())}


# -- the suite ------------------------------------------------------------------------------------
def omp_bind() -> str:
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def _arm(name: str, path: Path, decode_tokens: int, eager: bool) -> Arm:
    def command(ctx: PassContext) -> Command:
        env = {"VLLM_CACHE_ROOT": str(ctx.workdir.parent.parent / f"vllm-cache-{name}"),
               "VLLM_CPU_OMP_THREADS_BIND": omp_bind(), "VLLM_LOGGING_LEVEL": "INFO"}
        argv = [sys.executable, "-m", "benchmarks.runtime_bench", "one-pass", str(path),
                str(ctx.workdir / "pass.json"), str(decode_tokens)] + (["--eager"] if eager else [])
        return Command(argv, env=env, cwd=str(REPO), timeout=PASS_TIMEOUT_S)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        data = json.loads((ctx.workdir / "pass.json").read_text())
        if name in KNOBS and not data["knobs"][name]:
            raise HarnessError(f"{name}: the log lacks {KNOBS[name]!r}; the arm did not run its "
                               "kernel")
        return {m.name: float(data[m.name]) for m in METRICS}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        data = json.loads((ctx.workdir / "pass.json").read_text())
        return {"decode_all": data["decode_all"], "prefill_all": data["prefill_all"]}

    return Arm(name, {"model": str(path)}, command, collect, extras=extras)


def build_suite(model: str, artifacts: dict[str, Path], decode_tokens: int, eager: bool) -> Suite:
    return Suite(
        name=f"runtime-{model}",
        description=(f"vLLM CPU decode (batch 1) and prefill ({PROMPT_LEN} tokens) speed and "
                     f"RssAnon, bf16 vs GPTQ vs cpu_int4, on {model}"),
        metrics=METRICS, arms=[_arm(n, p, decode_tokens, eager) for n, p in artifacts.items()],
        baseline="bf16",
        settings={"model": model, "decode_tokens": decode_tokens, "prompt_len": PROMPT_LEN,
                  "kv_cache_memory_bytes": KV_BYTES, "enforce_eager": eager,
                  "VLLM_CPU_OMP_THREADS_BIND": omp_bind(),
                  "quantized_arms": "RTN data-free, no scale search (speed only)"},
        inputs=dict(artifacts),
        notes=["knob check: the cpu_int4 arm's log must hold the tinygemm layout line and the "
               "gptq arm's vLLM's CPUWNA16LinearKernel line (pass.json.log in each pass dir)"],
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["one-pass"]:
        one_pass(argv[1], Path(argv[2]), int(argv[3]), "--eager" in argv[4:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="demo,qwen05b")
    parser.add_argument("--passes", type=int, default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    passes = args.passes if args.passes is not None else (1 if args.smoke else 3)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    root = Path(args.workdir or f"/tmp/cpu-quant-bench/runtime-{stamp}")
    failed = 0
    for model in args.models.split(","):
        if model not in ("demo", "qwen05b"):
            parser.error(f"unknown model {model!r} (demo, qwen05b)")
        workdir = root / model
        workdir.mkdir(parents=True, exist_ok=True)
        artifacts = build_artifacts(model, root)
        try:
            result, path = run_suite(build_suite(model, artifacts, args.decode_tokens, args.eager),
                                     passes, args.smoke, Path(args.out), workdir)
        except HarnessError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{model}: {path}", file=sys.stderr)
        failed += result["failed_passes"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
