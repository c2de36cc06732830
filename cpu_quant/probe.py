"""Read this machine (or a recorded ``/proc/cpuinfo``) and say which weight path to build, and why.

Inputs are plain texts, so recorded machines can be tested:

* ``/proc/cpuinfo``: x86 ``flags`` (``amx_tile``/``amx_bf16``/``amx_int8``, ``avx512f``,
  ``avx512_bf16``, ``avx512_vnni``, ``avx2``), ARM ``Features`` (``asimd`` = NEON, ``sve``,
  ``sve2``) with ``CPU part``, RISC-V ``isa`` (``rv64imafdcv_...``: the single letters after
  ``rv64`` and the ``_``-separated extensions); logical cores = ``processor`` entries;
* ``/proc/meminfo``: ``MemTotal``;
* whether vLLM is installed (``importlib.util.find_spec``; vLLM is never imported here).

The decision is :data:`DECISION_TABLE`, the only table that maps hardware to a path: the
phone's rows here and each format package's rows (``Format.probe_rules``, in the package's
``serving`` module), sorted by their ``order``; rows are tried in that order and the first whose
condition holds wins. Every row carries the reason with its
evidence, and ``verified`` says whether that path has been measured on such hardware; the
others are printed as UNVERIFIED.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .core.cpu import CpuFacts, read_machine
from .core.errors import CpuQuantError
from .formats.base import ProbeRule, format_probe_rules
from .formats.kernels import KernelRule, serving_kernels

PRIORITIES = ("speed", "fidelity")
TARGETS = ("cpu", "phone")
SCHEMA = "cpu-quant.probe/1"

# -- the decision table ----------------------------------------------------------------------------
# the rows whose path is not a format's (the phone's exports); each format package declares the
# rows that choose it (``Format.probe_rules``)
PHONE_RULES: tuple[ProbeRule, ...] = (
    ProbeRule(
        order=0,
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
    ProbeRule(
        order=10,
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
)
DECISION_TABLE: tuple[ProbeRule, ...] = tuple(
    sorted((*PHONE_RULES, *format_probe_rules()), key=lambda r: r.order))


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


def _decision(rule: ProbeRule) -> Decision:
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
