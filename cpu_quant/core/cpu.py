"""This machine's CPU, read from ``/proc/cpuinfo`` (or a recorded copy, so that recorded machines
can be tested): x86 ``flags`` (``amx_tile``/``amx_bf16``/``amx_int8``, ``avx512f``,
``avx512_bf16``, ``avx512_vnni``, ``avx2``), ARM ``Features`` (``asimd`` = NEON, ``sve``,
``sve2``) with ``CPU part``, RISC-V ``isa`` (``rv64imafdcv_...``: the single letters after
``rv64`` and the ``_``-separated extensions); logical cores = ``processor`` entries;
``/proc/meminfo``'s ``MemTotal``; and whether vLLM is installed (``importlib.util.find_spec``;
vLLM is never imported here). The probe decides from these facts, and the serving kernels
(``formats.kernels``) choose theirs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CpuQuantError

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


@functools.cache
def local_cpu() -> CpuFacts:
    """This machine's CPU facts (``/proc/cpuinfo``), read once per process; an unreadable file
    gives a machine with no recognised extensions (the table's last row)."""
    try:
        return parse_cpuinfo(Path("/proc/cpuinfo").read_text())
    except (OSError, CpuQuantError):
        return CpuFacts(arch=platform.machine() or "unknown", model="", cores=os.cpu_count() or 1,
                        flags=[])


