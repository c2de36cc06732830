"""Suite ``gguf``: cpu-quant's GGUF Q4_0 file against llama.cpp's own quantizations, in llama.cpp.

Three parts, each its own harness run and result file (``gguf-<part>-<UTC time>.json``):

``fidelity``  every GGUF arm's next-token logits **taken from llama.cpp itself**
              (llama-cpp-python 0.3.36, ``benchmarks/peers/llama_cpp_fidelity.py``) on fixed
              windows of the held-out split (``EVAL``: windows x tokens, tokenized once by the
              Hugging Face tokenizer), against the reference: llama.cpp running the converter's
              bf16 GGUF of the source, so every arm shares the runtime. Metrics: mean
              KL(ref || arm) (its standard error is an extra), perplexity delta, top-1
              agreement. The row ``llama.cpp-bf16`` is the sanity check: the same bf16 GGUF
              scored against **torch** bf16 logits of the source (the runtimes' own gap).
``decode``    decode and prefill tokens/s of our Q4_0 file against llama.cpp's own Q4_0 (the
              runtime suite's measurement, ``benchmarks/peers/llama_cpp_pass.py``).
``formats``   wall time of one ``cpu-quant gptq`` run writing three formats
              (``--format gptq,cpu_int4,gguf``) against one writing ``gptq`` alone, on a
              reduced calibration (``FORMATS_CALIB``): the formats' cost is fixed, so a smaller
              calibration makes the ratio a stricter test, not a looser one.

Fidelity arms (baseline ``llama.cpp-q4_0-imatrix``, so ``kl_mean``'s ratio is ours / theirs):

=================================  ===========================================================
``cpu-quant-q4_0-g32``             ``cpu-quant gptq --group 32 --format gguf --no-lm-head``
                                   (128 x 512 calibration; token_embd Q8_0, the tied head)
``cpu-quant-q4_0-g32-embd-f16``    the same file with token_embd F16 (from the bf16 source)
``cpu-quant-q4_0-g32-embd-bf16``   the same file with token_embd BF16 (the source's own)
``llama.cpp-q4_0``                 ``llama-quantize bf16.gguf Q4_0`` (no imatrix)
``llama.cpp-q4_0-imatrix``         ``llama-quantize --imatrix`` Q4_0
``llama.cpp-iq4_nl-imatrix``       ``llama-quantize --imatrix`` IQ4_NL
``llama.cpp-q4_k_m``               ``llama-quantize`` Q4_K_M, with and without (``-imatrix``)
``llama.cpp-bf16``                 the converter's bf16 GGUF, scored against torch bf16
=================================  ===========================================================

The importance matrix is ``llama-imatrix`` over **the same calibration windows** cpu-quant
uses (128 x 512 tokens of the built-in calibration split, ``corpus.token_windows``), decoded
to text and written to ``calibration.txt``, with ``-c 512 --chunks 128``. llama.cpp chooses
its own types for some tensors (e.g. the tied ``token_embd`` of a Q4_0 file is Q6_K); each
arm records its tensor types and bits per weight (all tensors, and the block linears only).

llama.cpp's tools (``llama-imatrix``, ``llama-quantize``) come from
``llama_cpp_env.install_tools()``, built from the same vendored source as the Python peer; on
an AMX CPU every model that llama.cpp *runs* is opened with weight repacking off
(``llama_cpp_open``, and ``--no-repack`` for ``llama-imatrix``; upstream llama.cpp #20824),
recorded as ``extra_bufts_off``.

The evaluation is deterministic, so the fidelity spread over passes is expected to be 0.
``--artifact cpu-quant-q4_0-g32=DIR`` uses a ``cpu-quant gptq --format gguf`` output made
elsewhere (its report must match the arm's settings).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..harness import (
    CPU_SECONDS,
    WALL_SECONDS,
    Arm,
    Command,
    Metric,
    PassContext,
    RunRecord,
    Suite,
)
from ..peers import llama_cpp_env
from . import quantize as q

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).resolve().parents[1] / "peers"
FIDELITY_SCRIPT = PEERS / "llama_cpp_fidelity.py"
CALIB = {"samples": 128, "seqlen": 512, "group": 32, "batch_size": 8, "calib": "austen"}
CALIB_SMOKE = {"samples": 4, "seqlen": 64, "group": 32, "batch_size": 4, "calib": "austen"}
EVAL = {"windows": 16, "seqlen": 512}
EVAL_SMOKE = {"windows": 2, "seqlen": 64}
FORMATS_CALIB = {"samples": 16, "seqlen": 512, "group": 32, "batch_size": 8, "calib": "austen"}
DECODE = {"decode_tokens": 64, "prompt_len": 512}
DECODE_SMOKE = {"decode_tokens": 8, "prompt_len": 32}
OURS = "cpu-quant-q4_0-g32"
BASELINE = "llama.cpp-q4_0-imatrix"
# llama-quantize type names -> (arm name, with imatrix)
LLAMA_ARMS = (("Q4_0", "llama.cpp-q4_0", False), ("Q4_0", "llama.cpp-q4_0-imatrix", True),
              ("IQ4_NL", "llama.cpp-iq4_nl-imatrix", True), ("Q4_K_M", "llama.cpp-q4_k_m", False),
              ("Q4_K_M", "llama.cpp-q4_k_m-imatrix", True))
EMBEDDING_VARIANTS = (("F16", f"{OURS}-embd-f16"), ("BF16", f"{OURS}-embd-bf16"))
PARTS = ("fidelity", "decode", "formats")
# llama-imatrix runs the model: weight repacking off on AMX (upstream llama.cpp #20824)
NO_REPACK = ("--no-repack",)

FIDELITY_METRICS = [
    Metric("kl_mean", "nats", "lower"),
    Metric("ppl_delta", "ppl", "lower", ratio=False),
    Metric("top1_agreement", "fraction", "higher"),
]
DECODE_METRICS = [Metric("decode_tok_s", "tok/s", "higher"),
                  Metric("prefill_tok_s", "tok/s", "higher")]


# -- inputs ------------------------------------------------------------------------------------
def write_heldout_windows(src: Path, ev: dict, path: Path) -> Path:
    """Held-out token windows (never calibration text), tokenized by the HF tokenizer."""
    from transformers import AutoTokenizer

    from cpu_quant.data.corpus import load_texts, token_windows

    tok = AutoTokenizer.from_pretrained(src)
    windows = token_windows(tok, load_texts(None, "heldout"), ev["windows"], ev["seqlen"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(windows))
    return path


def write_calibration_text(src: Path, calib: dict, path: Path) -> tuple[Path, Path]:
    """cpu-quant's calibration windows, as ids (hashed) and as text for ``llama-imatrix``."""
    from transformers import AutoTokenizer

    windows = q.write_calibration_windows(src, calib, path.with_suffix(".json"))
    tok = AutoTokenizer.from_pretrained(src)
    ids = json.loads(windows.read_text())
    path.write_text("".join(tok.decode(w) for w in ids))
    return windows, path


def torch_reference_logits(src: Path, windows_path: Path, out: Path) -> Path:
    """float32 logits [windows, tokens, vocab] of the source in torch bf16 (the sanity row)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    if out.is_file():
        return out
    windows = json.loads(windows_path.read_text())
    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16).eval()
    tmp = out.with_name(out.name + ".partial.npy")
    arr = None
    with torch.no_grad():
        for i, w in enumerate(windows):
            logits = model(torch.tensor([w])).logits[0].float().numpy()
            if arr is None:
                arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32,
                                                shape=(len(windows), *logits.shape))
            arr[i] = logits
    assert arr is not None
    arr.flush()
    del arr
    os.replace(tmp, out)
    return out


def _run_step(label: str, argv: list[str], log_dir: Path, steps: list[dict],
              env: dict | None = None) -> None:
    """A preparation step shared by several arms; its argv, exit status and time are recorded."""
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_dir / f"{label}.log", "w") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})})
    steps.append({"step": label, "argv": argv, "exit_status": proc.returncode,
                  "wall_seconds": round(time.perf_counter() - t0, 1),
                  "log": str(log_dir / f"{label}.log")})
    print(f"[gguf] {label}: exit {proc.returncode} in {steps[-1]['wall_seconds']} s",
          file=sys.stderr, flush=True)
    if proc.returncode:
        tail = (log_dir / f"{label}.log").read_text()[-1500:]
        raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{tail}")


# -- reading a GGUF file ---------------------------------------------------------------------
def gguf_bits(path: Path) -> dict:
    """Bits per weight of a GGUF file (all tensors; block linears only) and its tensor types."""
    import gguf

    reader = gguf.GGUFReader(path)
    types: dict[str, int] = {}
    total_bits = total_n = lin_bits = lin_n = 0
    embd = None
    for t in reader.tensors:
        n = int(t.n_elements)
        bits = int(t.n_bytes) * 8
        name = gguf.GGMLQuantizationType(t.tensor_type).name
        types[name] = types.get(name, 0) + 1
        total_bits, total_n = total_bits + bits, total_n + n
        if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
            lin_bits, lin_n = lin_bits + bits, lin_n + n
        if t.name == "token_embd.weight":
            embd = name
    return {"bits_per_weight_linears": round(lin_bits / max(lin_n, 1), 4),
            "bits_per_weight_all": round(total_bits / max(total_n, 1), 4),
            "tensor_types": types, "token_embd_type": embd,
            "output_tensor": any(t.name == "output.weight" for t in reader.tensors),
            "file_bytes": path.stat().st_size}


_REPLACE_EMBEDDING = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[5])
from benchmarks.suites.gguf import replace_embedding
replace_embedding(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
"""


def replace_embedding(ours: Path, source: Path, out: Path, type_name: str) -> None:
    """Copy of ``ours`` with ``token_embd`` re-encoded as ``type_name`` from the bf16 source.

    Every other tensor and every metadata key is copied byte for byte (gguf-py's
    ``gguf_new_metadata`` pattern), so the arm differs from ``ours`` in the embedding only.
    """
    import gguf

    from cpu_quant.io.checkpoint import open_checkpoint

    qtype = gguf.GGMLQuantizationType[type_name]
    ckpt = open_checkpoint(source)
    embd = ckpt.tensor("model.embed_tokens.weight").float().contiguous().numpy()
    ckpt.close()
    new = gguf.quants.quantize(embd, qtype)
    reader = gguf.GGUFReader(ours)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    writer.add_string("cpu_quant.bench_token_embd_type", type_name)
    datas = []
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            datas.append(new)
            writer.add_tensor_info(t.name, new.shape, new.dtype, new.nbytes, raw_dtype=qtype)
        else:
            datas.append(t.data)
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                                   raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for d in datas:
        writer.write_tensor_data(d)
    writer.close()
    os.replace(tmp, out)


# -- arms ------------------------------------------------------------------------------------
def _fidelity_arm(name: str, settings: dict, model_of, ref: Path, windows: Path, timeout: float,
                  build=None, verify=None) -> Arm:
    def command(ctx: PassContext) -> Command:
        if verify is not None:  # before spending an evaluation: the file must be this arm's
            verify()
        env = llama_cpp_env.ready_env()
        assert env is not None
        return Command([str(env.python), str(FIDELITY_SCRIPT), "compare", str(model_of()),
                        str(windows), str(ref), str(ctx.workdir / "fidelity.json")],
                       timeout=timeout)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        fid = json.loads((ctx.workdir / "fidelity.json").read_text())
        return {m.name: float(fid[m.name]) for m in FIDELITY_METRICS}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        fid = json.loads((ctx.workdir / "fidelity.json").read_text())
        keep = ("kl_se", "kl_se_windows", "kl_median", "kl_p99", "kl_max", "ppl_reference",
                "ppl_model", "positions", "extra_bufts_off", "n_threads", "llama_cpp_python")
        out = {k: fid[k] for k in keep}
        out.update(gguf_bits(model_of()))
        if ctx.pass_index == 0:
            out["kl_per_window"] = fid["kl_per_window"]
        return out

    return Arm(name, {**settings, "reference": str(ref)}, command, collect, build=build,
               artifacts=lambda ctx: {"gguf": model_of()}, extras=extras)


def _our_gguf(directory: Path) -> Path:
    from cpu_quant.formats.gguf import gguf_file_in

    found = gguf_file_in(directory)
    if found is None:
        raise FileNotFoundError(f"{directory} holds no .gguf file")
    return found


def _check_ours(directory: Path, calib: dict, flags: list[str]) -> None:
    """The GGUF's report (beside it) says the arm's settings reached the pipeline."""
    report = next(directory.glob("*.quantization_report.json"), None)
    if report is None:
        raise ValueError(f"{directory}: no quantization report beside the GGUF")
    q.check_cpu_quant_report(report, calib, flags)


def build(opts: q.SuiteOptions) -> list[Suite]:
    smoke = opts.smoke
    calib = dict(CALIB_SMOKE if smoke else CALIB)
    ev = dict(EVAL_SMOKE if smoke else EVAL)
    dec = dict(DECODE_SMOKE if smoke else DECODE)
    fmt_calib = dict(CALIB_SMOKE if smoke else FORMATS_CALIB)
    timeout = q.TIMEOUT_SMOKE if smoke else q.TIMEOUT_REAL
    wanted = set(opts.arms or [])
    prebuilt = {k: Path(v).resolve() for k, v in (opts.prebuilt or {}).items()}
    if set(prebuilt) - {OURS}:
        raise ValueError(f"--artifact: only {OURS} can be given prebuilt")
    src = q.source_model(opts)
    env = llama_cpp_env.install()
    tools = llama_cpp_env.install_tools()
    inputs = opts.workdir / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    steps: list[dict] = []
    shape = f"{ev['windows']}x{ev['seqlen']}"
    windows = write_heldout_windows(src, ev, inputs / f"heldout_windows-{shape}.json")
    cshape = f"{calib['samples']}x{calib['seqlen']}"
    calib_windows, calib_txt = write_calibration_text(src, calib,
                                                      inputs / f"calibration-{cshape}.txt")
    llama_cpp_env.gguf_files(env, src, inputs, [])  # the converter's bf16 GGUF only
    bf16 = inputs / f"{src.name}-bf16.gguf"
    ref = inputs / f"reference-llama.cpp-bf16-{shape}.npy"
    if not ref.is_file():
        _run_step("reference-logits", [str(env.python), str(FIDELITY_SCRIPT), "save", str(bf16),
                                       str(windows), str(ref)], inputs, steps)
    t0 = time.perf_counter()
    torch_ref = torch_reference_logits(src, windows, inputs / f"reference-torch-bf16-{shape}.npy")
    steps.append({"step": "torch-reference-logits", "wall_seconds":
                  round(time.perf_counter() - t0, 1), "exit_status": 0})
    imatrix = inputs / f"imatrix-{cshape}.gguf"
    if not imatrix.is_file():
        _run_step("imatrix", [str(tools.path / "bin" / "llama-imatrix"), "-m", str(bf16),
                              "-f", str(calib_txt), "-o", str(imatrix),
                              "-c", str(calib["seqlen"]), "--chunks", str(calib["samples"]),
                              "-t", str(len(os.sched_getaffinity(0))), *NO_REPACK],
                  inputs, steps)

    fidelity_arms: list[Arm] = []
    ours_flags = ["--format", "gguf", "--no-lm-head"]
    if OURS in prebuilt:
        ours_dir = prebuilt[OURS]
        _check_ours(ours_dir, calib, ours_flags)  # before any other work
        ours_build = None
    else:
        ours_dir = opts.workdir / "build" / OURS / "artifact"

        def ours_build(bdir: Path) -> Command:
            return Command(q.cpu_quant_gptq_argv(src, bdir / "artifact", calib, ours_flags),
                           timeout=timeout)

    def ours_gguf() -> Path:
        return _our_gguf(ours_dir)

    settings_ours = {"tool": "cpu-quant", "command": "gptq", "flags": ours_flags, **calib,
                     "token_embd": "Q8_0", "prebuilt": str(ours_dir) if OURS in prebuilt else None}
    fidelity_arms.append(_fidelity_arm(OURS, settings_ours, ours_gguf, ref, windows, timeout,
                                       ours_build,
                                       lambda: _check_ours(ours_dir, calib, ours_flags)))
    for type_name, name in EMBEDDING_VARIANTS:
        out = opts.workdir / "build" / name / f"{src.name}-Q4_0-embd-{type_name.lower()}.gguf"

        def variant_build(bdir: Path, out=out, type_name=type_name) -> Command:
            return Command([sys.executable, "-c", _REPLACE_EMBEDDING, str(ours_gguf()), str(src),
                            str(out), type_name, str(REPO)], timeout=timeout)

        fidelity_arms.append(_fidelity_arm(
            name, {**settings_ours, "token_embd": type_name,
                   "derived_from": OURS + ": token_embd re-encoded from the bf16 source"},
            lambda out=out: out, ref, windows, timeout, variant_build))
    quantize_bin = tools.path / "bin" / "llama-quantize"
    for type_name, name, with_imatrix in LLAMA_ARMS:
        out = opts.workdir / "build" / name / f"{src.name}-{name}.gguf"

        def llama_build(bdir: Path, out=out, type_name=type_name, with_imatrix=with_imatrix
                        ) -> Command:
            argv = [str(quantize_bin)]
            if with_imatrix:
                argv += ["--imatrix", str(imatrix)]
            return Command(argv + [str(bf16), str(out), type_name,
                                   str(len(os.sched_getaffinity(0)))], timeout=timeout)

        fidelity_arms.append(_fidelity_arm(
            name, {"tool": "llama-quantize (llama.cpp vendored in llama-cpp-python "
                   f"{llama_cpp_env.VERSION})", "type": type_name,
                   "imatrix": str(imatrix) if with_imatrix else None},
            lambda out=out: out, ref, windows, timeout, llama_build))
    fidelity_arms.append(_fidelity_arm(
        "llama.cpp-bf16", {"tool": "convert_hf_to_gguf.py --outtype bf16", "sanity": True,
                           "note": "scored against torch bf16 logits, not llama.cpp's"},
        lambda: bf16, torch_ref, windows, timeout))
    llama_files = {name: opts.workdir / "build" / name / f"{src.name}-{name}.gguf"
                   for _, name, _ in LLAMA_ARMS}

    peers = {"llama-cpp-python": env.describe(), "llama.cpp-tools": tools.describe()}
    common = {"source": str(src), "calibration": calib, "eval": ev, "prep_steps": steps}
    inputs_hashed = {"source_model": src, "heldout_windows": windows,
                     "calibration_windows": calib_windows, "calibration_text": calib_txt,
                     "imatrix": imatrix, "bf16_gguf": bf16}
    notes = ["Machine shared with other jobs (2 cores); load average at start "
             f"{[round(x, 2) for x in os.getloadavg()]}; each pass records loadavg_after.",
             "Reference for every arm but llama.cpp-bf16: llama.cpp on the converter's bf16 "
             "GGUF; llama.cpp-bf16 is scored against torch bf16 (the runtimes' own gap).",
             "imatrix: llama-imatrix over cpu-quant's calibration windows decoded to text."]
    fidelity = Suite(
        name="gguf-fidelity",
        description="KL, perplexity delta and top-1 agreement in llama.cpp on held-out text: "
                    "cpu-quant's GGUF Q4_0 vs llama.cpp's own 4-bit types",
        metrics=FIDELITY_METRICS, arms=fidelity_arms, settings=dict(common),
        baseline=BASELINE, inputs=dict(inputs_hashed), peers=peers, notes=list(notes))

    def decode_arm(name: str, model_of) -> Arm:
        def command(ctx: PassContext) -> Command:
            return Command([str(env.python), str(PEERS / "llama_cpp_pass.py"), str(model_of()),
                            str(ctx.workdir / "pass.json"), str(dec["decode_tokens"]),
                            str(dec["prompt_len"])], timeout=1800)

        def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
            r = json.loads((ctx.workdir / "pass.json").read_text())
            return {"decode_tok_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"]}

        def extras(ctx: PassContext, run: RunRecord) -> dict:
            r = json.loads((ctx.workdir / "pass.json").read_text())
            return {k: r[k] for k in ("decode_all", "prefill_all", "start_seconds",
                                      "rss_anon_bytes", "n_threads", "extra_bufts_off")}

        return Arm(name, {"model": "see artifacts", **dec}, command, collect,
                   artifacts=lambda ctx: {"gguf": model_of()}, extras=extras)

    decode = Suite(
        name="gguf-decode",
        description="llama.cpp decode/prefill tokens/s: cpu-quant's Q4_0 file vs llama.cpp's "
                    "own Q4_0 (same process settings)",
        metrics=DECODE_METRICS,
        arms=[decode_arm("decode-llama.cpp-q4_0", lambda: llama_files["llama.cpp-q4_0"]),
              decode_arm(f"decode-{OURS}", ours_gguf)],
        settings={"source": str(src), **dec}, baseline="decode-llama.cpp-q4_0",
        peers=peers, notes=list(notes[:1]))

    def formats_arm(name: str, formats: str) -> Arm:
        flags = ["--format", formats, "--no-lm-head"]

        def command(ctx: PassContext) -> Command:
            return Command(q.cpu_quant_gptq_argv(src, ctx.workdir / "artifact", fmt_calib,
                                                 flags), timeout=timeout)

        def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
            art = ctx.workdir / "artifact"
            wanted_dirs = formats.split(",")
            if len(wanted_dirs) > 1:
                missing = [f for f in wanted_dirs if not (art / f).is_dir()]
                if missing:
                    raise ValueError(f"formats not written: {missing}")
            return {}

        return Arm(name, {"tool": "cpu-quant", "flags": flags, **fmt_calib}, command, collect,
                   artifacts=lambda ctx: {"artifact": ctx.workdir / "artifact"})

    formats = Suite(
        name="gguf-formats",
        description="wall time of one cpu-quant run writing gptq,cpu_int4,gguf vs gptq alone "
                    f"(reduced calibration {fmt_calib['samples']} x {fmt_calib['seqlen']})",
        metrics=[WALL_SECONDS, CPU_SECONDS],
        arms=[formats_arm("formats-gptq", "gptq"),
              formats_arm("formats-gptq+cpu_int4+gguf", "gptq,cpu_int4,gguf")],
        settings={"source": str(src), "calibration": fmt_calib},
        baseline="formats-gptq", peers=peers, notes=list(notes[:1]))

    suites = {"fidelity": fidelity, "decode": decode, "formats": formats}
    if wanted:
        for part, suite in suites.items():
            if part not in wanted:
                suite.arms = [a for a in suite.arms if a.name in wanted]
        unknown = wanted - set(PARTS) - {a.name for s in suites.values() for a in s.arms}
        if unknown:
            raise ValueError(f"unknown arm(s) or part(s): {', '.join(sorted(unknown))}")
    if smoke:
        for s in suites.values():
            s.description += " (SMOKE)"
    return [s for s in suites.values() if s.arms]

