"""What the command line, the model card and the plugin ask the formats registry: how each
format is served, where this machine cannot serve it, which command writes it and which formats
``convert`` writes. No format name is spelled outside its package for these answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpu_quant.core.cpu import parse_cpuinfo
from cpu_quant.core.errors import CpuQuantError
from cpu_quant.formats import (
    DEFAULT_FORMAT,
    format_for_command,
    format_names,
    formats_help,
    get_format,
    repackable_format_names,
)
from cpu_quant.runtime_patches import method_modules, patch_modules

FIXTURES = Path(__file__).parent / "fixtures" / "cpuinfo"
SSE_ONLY = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: old x86\nflags\t\t: fpu sse sse2\n"


@pytest.mark.parametrize("name", format_names())
def test_every_format_says_how_its_artifact_is_served(name: str, tmp_path: Path) -> None:
    serving = get_format(name).serving(tmp_path / "artifact")
    assert serving.runtime and str(tmp_path / "artifact") in serving.command


def test_the_gguf_command_turns_off_llama_cpps_repacking_and_says_why(tmp_path: Path) -> None:
    serving = get_format("gguf").serving(tmp_path / "m-Q4_0.gguf")
    assert "--no-repack" in serving.command.split()
    assert any("AMX" in note for note in serving.notes)


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.txt")))
def test_every_recorded_machine_serves_every_format(fixture: str, tmp_path: Path) -> None:
    facts = parse_cpuinfo((FIXTURES / fixture).read_text())
    assert all(get_format(n).unservable_here(facts, tmp_path) is None for n in format_names())


def test_gptq_on_an_x86_cpu_without_avx2_names_the_repack_that_serves_it(tmp_path: Path) -> None:
    facts = parse_cpuinfo(SSE_ONLY)
    why = get_format("gptq").unservable_here(facts, tmp_path / "out")
    assert why is not None and "cpu_gemm_wna16" in why
    assert f"cpu-quant convert {tmp_path / 'out'} DST --to cpu_int4" in why
    assert get_format("cpu_int4").unservable_here(facts, tmp_path) is None


def test_commands_and_convert_take_their_formats_from_the_registry() -> None:
    assert format_for_command("tinygemm").name == "cpu_int4"
    with pytest.raises(CpuQuantError, match="no format is written by a command named 'nope'"):
        format_for_command("nope")
    assert repackable_format_names() == ["cpu_int4", "gptq"]
    assert formats_help().startswith(f"{DEFAULT_FORMAT} (")
    assert all(name in formats_help() for name in format_names())


def test_the_plugin_loads_the_modules_the_formats_name() -> None:
    assert method_modules() == [("cpu_int4", "cpu_quant.formats.cpu_int4.vllm_method")]
    assert patch_modules()[-1] == "cpu_quant.formats.gptq.vllm_kernel"
    assert all(m.startswith("cpu_quant.runtime_patches.") for m in patch_modules()[:-1])


def test_each_format_names_the_command_that_writes_it_and_the_probe_prints_it():
    """The format's own command, or ``gptq`` with ``--format`` for a non-default format; the
    probe's CPU rows name registered formats and print their command."""
    from cpu_quant.formats.base import get_format
    from cpu_quant.probe import DECISION_TABLE

    assert get_format("gptq").write_command() == "cpu-quant gptq SRC DST --group 128"
    assert get_format("cpu_int4").write_command() == "cpu-quant tinygemm SRC DST --group 128"
    assert get_format("gguf").write_command("SRC DST") == "cpu-quant gptq SRC DST --format gguf"
    for rule in DECISION_TABLE:
        assert (rule.format is None) != (rule.command is None), rule.name
        if rule.format is not None:
            assert rule.command_line() == get_format(rule.format).write_command()


def test_one_answer_to_whether_a_group_can_be_stored():
    """``Limits.group_problem``: a listed group is stored; -1 only by a format that stores rows
    as such, or where the in-features are one of its groups; verify's config check leaves -1
    to the modules (their in-features are known there)."""
    from cpu_quant.formats.base import get_format
    from cpu_quant.quantize.plan import check_group
    from cpu_quant.verify.checks import _group_problem

    tiny = get_format("cpu_int4").limits  # the tinygemm kernel: no row groups
    assert tiny.group_problem(128) is None and tiny.group_problem(-1, k=128) is None
    assert "one group per row is not stored" in tiny.group_problem(-1)
    assert "one group of 576" in tiny.group_problem(-1, k=576)
    assert "(accepted: " in tiny.group_problem(48)
    with pytest.raises(CpuQuantError, match="--group -1 is not stored by"):
        check_group("--group", -1, tiny)
    assert get_format("gptq").limits.group_problem(-1) is None  # GPTQ stores a row as a group
    spec = get_format("cpu_int4")
    assert _group_problem(spec, -1) is None and _group_problem(spec, -1, 576) is not None


def test_no_format_name_is_written_outside_its_package():
    """Outside ``cpu_quant/formats/`` the code asks the registry: no string that is a format's
    name alone (``gptq`` is also a method and a command, so only as a ``format=`` argument),
    and probe's rows that choose a format come from that format's package."""
    import ast

    from cpu_quant.core import naming  # noqa: F401  (the package imports; formats registered)
    from cpu_quant.probe import DECISION_TABLE
    from cpu_quant.quantize.settings import METHODS

    names = set(format_names())
    alone = names - set(METHODS)
    root = Path(__file__).resolve().parents[1] / "cpu_quant"
    found = []
    for path in root.rglob("*.py"):
        if "formats" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in alone:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.value!r}")
            if (isinstance(node, ast.keyword) and node.arg == "format"
                    and isinstance(node.value, ast.Constant) and node.value.value in names):
                found.append(f"{path.relative_to(root)}:{node.lineno} format={node.value.value!r}")
    assert not found, found
    by_format = {r.name: r.format for r in DECISION_TABLE}
    assert {f for f in by_format.values() if f} <= names
    assert by_format["x86-amx-speed"] == "gptq" and by_format["x86-tinygemm"] == "cpu_int4"
    orders = [r.order for r in DECISION_TABLE]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
