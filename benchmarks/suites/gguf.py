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
              (``--format gptq,cpu_int4,gguf``) against one writing ``gptq`` alone, as the
              main job runs by default (``FORMATS_CALIB``: 128 x 512 calibration, group 128,
              head quantized).

Fidelity arms (baseline ``llama.cpp-q4_0-imatrix``, so ``kl_mean``'s ratio is ours / theirs):

=================================  ===========================================================
``cpu-quant-q4_0-g32``             ``cpu-quant gptq --group 32 --format gguf --no-lm-head``
                                   (``CALIB``; token_embd Q8_0, the tied head)
``cpu-quant-q4_0-g32-embd-f16``    the same file with token_embd F16 (from the bf16 source)
``llama.cpp-q4_0``                 Q4_0, no imatrix: ``llama_model_quantize`` through
                                   llama-cpp-python (``llama_cpp_env.gguf_files``, as the
                                   runtime suite; ``llama-quantize`` wraps the same function)
``llama.cpp-q4_0-imatrix``         ``llama-quantize --imatrix`` Q4_0 (the C API takes no
                                   imatrix: it is a C++ object, hence the tools)
``llama.cpp-iq4_nl-imatrix``       ``llama-quantize --imatrix`` IQ4_NL
``llama.cpp-q4_k_m``               Q4_K_M as ``llama.cpp-q4_0`` (no imatrix; with one: not measured
                                   yet, for time on the shared machine)
``llama.cpp-bf16``                 the converter's bf16 GGUF, scored against torch bf16
=================================  ===========================================================

The importance matrix is ``llama-imatrix`` (run on the source's Q8_0 GGUF, for time) over
**the same calibration windows** cpu-quant uses (``CALIB`` of the built-in calibration split,
``corpus.token_windows``), decoded to text and written to ``calibration-SxT.txt``, with
``-c T --chunks S``. llama.cpp chooses
its own types for some tensors (e.g. the tied ``token_embd`` of a Q4_0 file is Q6_K); each
arm records its tensor types and bits per weight (all tensors, and the block linears only).

llama.cpp's tools (``llama-imatrix``, ``llama-quantize``) come from
``llama_cpp_env.install_tools()``, built from the same vendored source as the Python peer; on
an AMX CPU every model that llama.cpp *runs* is opened with weight repacking off
(``llama_cpp_open``, recorded as ``extra_bufts_off``; upstream llama.cpp #20824), and every
llama.cpp tool that runs a model gets its argv from ``cpu_quant.formats.gguf.format.llama_cpp_command``
(``--no-repack``, on every CPU).

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
from dataclasses import dataclass
from pathlib import Path

from cpu_quant.formats.gguf.format import llama_cpp_command

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
# reduced from cpu-quant's default 128 x 512: on the shared machine (load ~20 on 2 cores) GPTQ
# ran at 220 s per layer, 1 h 50 for the model
CALIB = {"samples": 16, "seqlen": 256, "group": 32, "batch_size": 8, "calib": "austen"}
CALIB_SMOKE = {"samples": 4, "seqlen": 64, "group": 32, "batch_size": 4, "calib": "austen"}
EVAL = {"windows": 24, "seqlen": 256}
EVAL_SMOKE = {"windows": 3, "seqlen": 64}
# pass p scores the windows i with i % SLICES == p % SLICES: 3 passes score half of the 24
# windows (3072 positions); on the shared machine one bf16 evaluation of all 24 took 20 min
SLICES = 6
# the main job's defaults (cpu-quant gptq with no options): the run a user times
FORMATS_CALIB = {"samples": 128, "seqlen": 512, "group": 128, "batch_size": 8, "calib": "austen"}
# reduced for the shared machine: one pass of 64 decode tokens + 256-token prefills took
# over 13 min there (load ~15 on 2 cores)
DECODE = {"decode_tokens": 32, "prompt_len": 64}
DECODE_SMOKE = {"decode_tokens": 8, "prompt_len": 32}
OURS = "cpu-quant-q4_0-g32"
BASELINE = "llama.cpp-q4_0-imatrix"
# llama-quantize type names -> (arm name, with imatrix)
LLAMA_ARMS = (("Q4_0", "llama.cpp-q4_0", False), ("Q4_0", "llama.cpp-q4_0-imatrix", True),
              ("IQ4_NL", "llama.cpp-iq4_nl-imatrix", True), ("Q4_K_M", "llama.cpp-q4_k_m", False))
# BF16 is left out: this embedding is fp16-exact (docs/gguf.md), so BF16 would be F16's values
EMBEDDING_VARIANTS = (("F16", f"{OURS}-embd-f16"),)
PARTS = ("fidelity", "decode", "formats")
NOTE_ENV = "CPU_QUANT_BENCH_NOTE"  # a sentence about the run's conditions, copied to its notes

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


def _record_steps(inputs: Path, new: list[dict]) -> list[dict]:
    """Every preparation step run in this work directory, also by earlier invocations (their
    outputs are reused), kept in ``inputs/prep_steps.json``."""
    path = inputs / "prep_steps.json"
    steps = json.loads(path.read_text()) if path.is_file() else []
    steps += new
    path.write_text(json.dumps(steps, indent=1))
    return steps


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
                  "log": str(log_dir / f"{label}.log"),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    _record_steps(log_dir, steps[-1:])
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

    from cpu_quant.core.io.checkpoint import open_checkpoint

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
                        str(windows), str(ref), str(ctx.workdir / "fidelity.json"),
                        str(ctx.pass_index % SLICES), str(SLICES)], timeout=timeout)

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
    from cpu_quant.formats.gguf.reader import gguf_file_in

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


@dataclass
class _Context:
    """What the parts share: options, source, settings, the llama.cpp peer and file paths."""

    opts: q.SuiteOptions
    src: Path
    calib: dict
    ev: dict
    timeout: float
    env: object  # llama_cpp_env's PeerEnv
    ours_dir: Path
    ours_prebuilt: bool
    notes: list[str]
    arm_names: set[str]  # --arms minus part names; empty: every arm

    @property
    def build_root(self) -> Path:
        return self.opts.workdir / "build"

    def llama_file(self, name: str) -> Path:
        """An arm's llama.cpp file: imatrix arms are built by the harness, the others cached in
        ``inputs/`` by ``llama_cpp_env.gguf_files``."""
        for type_name, arm, with_imatrix in LLAMA_ARMS:
            if arm == name and not with_imatrix:
                return self.opts.workdir / "inputs" / f"{self.src.name}-{type_name.lower()}.gguf"
        return self.build_root / name / f"{self.src.name}-{name}.gguf"

    def ours_gguf(self) -> Path:
        return _our_gguf(self.ours_dir)


OURS_FLAGS = ["--format", "gguf", "--no-lm-head"]


def _fidelity_suite(c: _Context, tools_needed: bool = True) -> Suite | None:
    src, calib, ev, timeout, env = c.src, c.calib, c.ev, c.timeout, c.env
    # llama.cpp's tools only for the imatrix arms (the C API takes no imatrix)
    imatrix_arms = {name for _, name, with_imatrix in LLAMA_ARMS if with_imatrix}
    tools_needed = tools_needed and (not c.arm_names or bool(imatrix_arms & c.arm_names))
    tools = llama_cpp_env.install_tools() if tools_needed else None
    inputs = c.opts.workdir / "inputs"
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
    torch_ref = inputs / f"reference-torch-bf16-{shape}.npy"
    if not torch_ref.is_file() and (not c.arm_names or "llama.cpp-bf16" in c.arm_names):
        t0 = time.perf_counter()
        torch_reference_logits(src, windows, torch_ref)
        _record_steps(inputs, [{"step": "torch-reference-logits", "exit_status": 0,
                                "wall_seconds": round(time.perf_counter() - t0, 1)}])
    imatrix = inputs / f"imatrix-{cshape}.gguf"
    if tools is not None and not imatrix.is_file():
        # collected on the Q8_0 model: about twice as fast as bf16 here, and its activations
        # are within Q8_0 rounding of the source's
        q8 = llama_cpp_env.gguf_files(env, src, inputs, ["q8_0"])["q8_0"]
        # the tool saves every 10 chunks: only a finished file may carry the final name
        partial = imatrix.with_name(imatrix.stem + ".partial.gguf")
        _run_step("imatrix", llama_cpp_command(
            tools.path / "bin" / "llama-imatrix", q8, "-f", calib_txt, "-o", partial,
            "-c", str(calib["seqlen"]), "-b", str(calib["seqlen"]),
            "--chunks", str(calib["samples"]), "-t", str(len(os.sched_getaffinity(0))),
            "--no-ppl"), inputs, steps)
        os.replace(partial, imatrix)

    def arm(name: str, settings: dict, model_of, reference: Path = ref, build=None,
            verify=None) -> Arm:
        return _fidelity_arm(name, settings, model_of, reference, windows, timeout, build,
                             verify)

    arms: list[Arm] = []
    ours_build = None
    if not c.ours_prebuilt:
        def ours_build(bdir: Path) -> Command:
            return Command(q.cpu_quant_gptq_argv(src, bdir / "artifact", calib, OURS_FLAGS),
                           timeout=timeout)

    settings_ours = {"tool": "cpu-quant", "command": "gptq", "flags": OURS_FLAGS, **calib,
                     "token_embd": "Q8_0",
                     "prebuilt": str(c.ours_dir) if c.ours_prebuilt else None}
    arms.append(arm(OURS, settings_ours, c.ours_gguf, build=ours_build,
                    verify=lambda: _check_ours(c.ours_dir, calib, OURS_FLAGS)))
    for type_name, name in EMBEDDING_VARIANTS:
        out = c.build_root / name / f"{src.name}-Q4_0-embd-{type_name.lower()}.gguf"

        def variant_build(bdir: Path, out=out, type_name=type_name) -> Command:
            return Command([sys.executable, "-c", _REPLACE_EMBEDDING, str(c.ours_gguf()),
                            str(src), str(out), type_name, str(REPO)], timeout=timeout)

        arms.append(arm(name, {**settings_ours, "token_embd": type_name, "derived_from":
                               f"{OURS}: token_embd re-encoded from the bf16 source"},
                        lambda out=out: out, build=variant_build))
    for type_name, name, with_imatrix in LLAMA_ARMS:
        settings = {"type": type_name, "imatrix": str(imatrix) if with_imatrix else None}
        if not with_imatrix:  # the C API, as the runtime suite quantizes (cached in inputs/)
            t0 = time.perf_counter()
            path = llama_cpp_env.gguf_files(env, src, inputs, [type_name.lower()])[
                type_name.lower()]
            _record_steps(inputs, [{"step": f"llama_model_quantize {type_name}",
                                    "exit_status": 0, "path": str(path),
                                    "wall_seconds": round(time.perf_counter() - t0, 1)}])
            arms.append(arm(name, {**settings, "tool": "llama_model_quantize (llama-cpp-python "
                                   f"{llama_cpp_env.VERSION})"}, lambda path=path: path))
            continue
        if tools is None:
            continue

        def llama_build(bdir: Path, name=name, type_name=type_name) -> Command:
            return Command([str(tools.path / "bin" / "llama-quantize"), "--imatrix", str(imatrix),
                            str(bf16), str(c.llama_file(name)), type_name,
                            str(len(os.sched_getaffinity(0)))], timeout=timeout)

        arms.append(arm(name, {**settings, "tool": "llama-quantize (llama.cpp vendored in "
                               f"llama-cpp-python {llama_cpp_env.VERSION})"},
                        lambda name=name: c.llama_file(name), build=llama_build))
    arms.append(arm("llama.cpp-bf16", {"tool": "convert_hf_to_gguf.py --outtype bf16",
                                       "sanity": "scored against torch bf16 logits"},
                    lambda: bf16, reference=torch_ref))
    return Suite(
        name="gguf-fidelity",
        description="KL, perplexity delta and top-1 agreement in llama.cpp on held-out text: "
                    "cpu-quant's GGUF Q4_0 vs llama.cpp's own 4-bit types",
        metrics=FIDELITY_METRICS, arms=arms,
        settings={"source": str(src), "calibration": calib, "eval": ev,
                  "prep_steps": _record_steps(inputs, [])},
        baseline=BASELINE if tools is not None else "llama.cpp-q4_0",
        inputs={"source_model": src, "heldout_windows": windows,
                "calibration_windows": calib_windows, "calibration_text": calib_txt,
                "bf16_gguf": bf16, **({"imatrix": imatrix} if tools is not None else {})},
        peers={"llama-cpp-python": env.describe(),
               **({"llama.cpp-tools": tools.describe()} if tools is not None else {})},
        notes=c.notes + [
            "Reference of every arm but llama.cpp-bf16: llama.cpp on the converter's bf16 GGUF; "
            "llama.cpp-bf16 is scored against torch bf16 (the runtimes' own gap).",
            f"Pass p scores windows i with i % {SLICES} == p % {SLICES} (its own slice of the "
            "held-out windows): the spread over passes is the spread over text.",
            "imatrix: llama-imatrix on the source's Q8_0 GGUF over cpu-quant's calibration "
            "windows decoded to text."])


def _decode_suite(c: _Context) -> Suite:
    dec = dict(DECODE_SMOKE if c.opts.smoke else DECODE)

    def decode_arm(name: str, model_of) -> Arm:
        def command(ctx: PassContext) -> Command:
            return Command([str(c.env.python), str(PEERS / "llama_cpp_pass.py"), str(model_of()),
                            str(ctx.workdir / "pass.json"), str(dec["decode_tokens"]),
                            str(dec["prompt_len"])], timeout=1800)

        def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
            r = json.loads((ctx.workdir / "pass.json").read_text())
            return {"decode_tok_s": r["decode_tok_s"], "prefill_tok_s": r["prefill_tok_s"]}

        def extras(ctx: PassContext, run: RunRecord) -> dict:
            r = json.loads((ctx.workdir / "pass.json").read_text())
            return {k: r.get(k) for k in ("decode_all", "prefill_all", "decode_invalid_samples",
                                          "start_seconds", "rss_anon_bytes", "n_threads",
                                          "extra_bufts_off")}

        return Arm(name, dict(dec), command, collect,
                   artifacts=lambda ctx: {"gguf": model_of()}, extras=extras)

    theirs = "llama.cpp-q4_0"
    return Suite(
        name="gguf-decode",
        description="llama.cpp decode/prefill tokens/s: cpu-quant's Q4_0 file vs llama.cpp's "
                    "own Q4_0, same process settings",
        metrics=DECODE_METRICS,
        arms=[decode_arm(f"decode-{theirs}", lambda: c.llama_file(theirs)),
              decode_arm(f"decode-{OURS}", c.ours_gguf)],
        settings={"source": str(c.src), **dec,
                  "files": "the gguf-fidelity part's (same --workdir)"},
        baseline=f"decode-{theirs}", peers={"llama-cpp-python": c.env.describe()},
        notes=list(c.notes))


def _formats_suite(c: _Context) -> Suite:
    calib = dict(CALIB_SMOKE if c.opts.smoke else FORMATS_CALIB)

    def formats_arm(name: str, formats: str) -> Arm:
        flags = ["--format", formats]

        def command(ctx: PassContext) -> Command:
            return Command(q.cpu_quant_gptq_argv(c.src, ctx.workdir / "artifact", calib, flags),
                           timeout=c.timeout)

        def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
            many = formats.split(",")
            missing = [f for f in many if len(many) > 1 and not (ctx.workdir / "artifact" / f)
                       .is_dir()]
            if missing:  # the knob reached the pipeline: every asked format is on disk
                raise ValueError(f"formats not written: {missing}")
            return {}

        return Arm(name, {"tool": "cpu-quant", "flags": flags, **calib}, command, collect,
                   artifacts=lambda ctx: {"artifact": ctx.workdir / "artifact"})

    return Suite(
        name="gguf-formats",
        description="wall time of one cpu-quant run writing gptq,cpu_int4,gguf vs gptq alone "
                    f"(calibration {calib['samples']} x {calib['seqlen']}, group "
                    f"{calib['group']}, head quantized)",
        metrics=[WALL_SECONDS, CPU_SECONDS],
        arms=[formats_arm("formats-gptq", "gptq"),
              formats_arm("formats-gptq+cpu_int4+gguf", "gptq,cpu_int4,gguf")],
        settings={"source": str(c.src), "calibration": calib}, baseline="formats-gptq",
        notes=list(c.notes))


def build(opts: q.SuiteOptions) -> list[Suite]:
    """The wanted parts (``--arms`` takes part names and arm names), each a ``Suite``."""
    wanted = set(opts.arms or [])
    parts = [p for p in PARTS if not wanted or p in wanted] or list(PARTS)
    prebuilt = {k: Path(v).resolve() for k, v in (opts.prebuilt or {}).items()}
    if set(prebuilt) - {OURS}:
        raise ValueError(f"--artifact: only {OURS} can be given prebuilt")
    calib = dict(CALIB_SMOKE if opts.smoke else CALIB)
    src = q.source_model(opts)
    (opts.workdir / "inputs").mkdir(parents=True, exist_ok=True)
    ours_dir = prebuilt.get(OURS, opts.workdir / "build" / OURS / "artifact")
    if OURS in prebuilt:
        _check_ours(ours_dir, calib, OURS_FLAGS)  # before any other work
    c = _Context(opts, src, calib, dict(EVAL_SMOKE if opts.smoke else EVAL),
                 q.TIMEOUT_SMOKE if opts.smoke else q.TIMEOUT_REAL,
                 llama_cpp_env.install() if parts != ["formats"] else None,
                 ours_dir, OURS in prebuilt,
                 [f"Machine shared with other jobs (2 cores); load average at start "
                  f"{[round(x, 2) for x in os.getloadavg()]}; each pass records "
                  "loadavg_after, the provenance the load at the end."]
                 + ([os.environ[NOTE_ENV]] if os.environ.get(NOTE_ENV) else []),
                 wanted - set(PARTS))
    builders = {"fidelity": _fidelity_suite, "decode": _decode_suite, "formats": _formats_suite}
    suites = [builders[p](c) for p in parts]
    arm_names = wanted - set(PARTS)
    if arm_names:
        known = {a.name for s in suites for a in s.arms}
        if arm_names - known:
            raise ValueError(f"unknown arm(s): {', '.join(sorted(arm_names - known))}")
        for s in suites:
            s.arms = [a for a in s.arms if a.name in arm_names] or s.arms
    if opts.smoke:
        for s in suites:
            s.description += " (SMOKE)"
    return suites


# -- the results page ------------------------------------------------------------------------
FIDELITY_ORDER = [OURS, *(name for _, name in EMBEDDING_VARIANTS),
                  *(name for _, name, _ in LLAMA_ARMS), "llama.cpp-bf16"]


def _first_extras(arm: str, doc: dict) -> dict:
    return next((r["extras"] for r in doc["records"] if r["arm"] == arm and r["ok"]), {})


def _bits(arm: str, doc: dict) -> str:
    x = _first_extras(arm, doc)
    if "bits_per_weight_linears" not in x:
        return "—"
    return f"{x['bits_per_weight_linears']:.3g} / {x['bits_per_weight_all']:.3g}"


def _kl_se(arm: str, doc: dict) -> str:
    se = [r["extras"]["kl_se"] for r in doc["records"]
          if r["arm"] == arm and r["ok"] and "kl_se" in r["extras"]]
    return "—" if not se else f"{min(se):.4f}–{max(se):.4f}" if len(se) > 1 else f"{se[0]:.4f}"


def render(results: Path, docs: Path) -> str:
    """The results page's block: the fidelity part per CPU class (each arm's newest run with
    the same calibration and evaluation), then the decode and formats parts' newest runs."""
    from dataclasses import asdict

    from ..render import harness_block, merged_block

    fidelity = merged_block(
        results, docs, "gguf-fidelity-2*.json", "python -m benchmarks run gguf --arms fidelity",
        ("calibration", "eval"), [asdict(m) for m in FIDELITY_METRICS],
        {"kl_mean": ".4f", "ppl_delta": "+.2f", "top1_agreement": ".3f"}, FIDELITY_ORDER,
        {"kl_mean": "KL (nats)", "ppl_delta": "ppl Δ", "top1_agreement": "top-1"},
        partial=True, extra={"KL's standard error per pass": _kl_se,
                             "bits per weight: linears / file": _bits})
    return "\n".join([
        "**fidelity** (KL against llama.cpp's bf16 GGUF of the source):", "", fidelity, "",
        "**decode** (llama.cpp, our file against its own Q4_0):", "",
        harness_block(results, docs, "gguf-decode", "python -m benchmarks run gguf --arms decode"),
        "", "**formats** (the cost of writing three formats in one run):", "",
        harness_block(results, docs, "gguf-formats",
                      "python -m benchmarks run gguf --arms formats")])
