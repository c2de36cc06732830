"""The ``determinism`` suite's arms and its results-page table (``benchmarks/suites/determinism.py``).

The suite's runs are real ``cpu-quant gptq`` commands; here its arms are built (not run) and its
table is computed from records of known digests."""

from __future__ import annotations

from pathlib import Path

from benchmarks.harness import PassContext
from benchmarks.suites import determinism
from benchmarks.suites.quantize import SuiteOptions


def _record(arm: str, p: int, dtype: str, modules: dict[str, str]) -> dict:
    whole = "|".join(f"{k}={v}" for k, v in sorted(modules.items()))
    return {"arm": arm, "pass_index": p, "ok": True,
            "extras": {"tensors_sha256": whole, "module_sha256": modules, "compute_dtype": dtype}}


def test_each_arm_is_compared_with_the_reference_of_its_dtype() -> None:
    same = {"model.layers.0.mlp.down_proj": "a", "model.layers.1.mlp.down_proj": "b", "lm_head": "c"}
    other = dict(same, **{"model.layers.1.mlp.down_proj": "x", "lm_head": "y"})
    fp32 = {k: v + "32" for k, v in same.items()}
    records = [_record("threads-1", 0, "bfloat16", same), _record("threads-2", 0, "bfloat16", same),
               _record("isa-avx512", 0, "bfloat16", other), _record("fp32", 0, "float32", fp32),
               _record("fp32-threads-2", 0, "float32", fp32),
               _record("threads-1", 1, "bfloat16", same), _record("threads-2", 1, "bfloat16", other)]
    rows = {(r["arm"], r["pass"]): r for r in determinism.compare_records({"records": records})}
    assert rows["threads-2", 0]["identical"] and rows["threads-2", 0]["differing"] == 0
    assert rows["isa-avx512", 0]["differing"] == 2
    # by layer, the head last
    assert rows["isa-avx512", 0]["first_differing"] == "model.layers.1.mlp.down_proj"
    assert rows["fp32-threads-2", 0]["reference"] == "fp32" and rows["fp32-threads-2", 0]["identical"]
    assert not rows["threads-2", 1]["same_as_first_pass"]
    table = determinism.table({"records": records})
    assert "| threads-2 | bfloat16 | 2 | threads-1 | no (1 of 2) | 2 of 3 " in table
    assert "| isa-avx512 | bfloat16 | 1 | threads-1 | no (0 of 1) | 2 of 3 " in table
    assert "| fp32 | float32 | 1 | fp32 | (the reference) | 0 | one pass |" in table


def test_the_arms_run_the_command_with_their_threads_ranks_and_limits(tmp_path: Path) -> None:
    opts = SuiteOptions(smoke=False, workdir=tmp_path, source=tmp_path, arms=None, prebuilt={})
    suite = determinism.build(opts)
    assert [a.name for a in suite.arms] == list(determinism.ARMS)
    cmds = {a.name: a.command(PassContext(a.name, 0, i, tmp_path / a.name, None, False))
            for i, a in enumerate(suite.arms)}
    argv = cmds["ranks-2"].argv
    assert argv[argv.index("--nproc") + 1] == "2" and argv[argv.index("--threads") + 1] == "1"
    assert cmds["threads-3"].argv[cmds["threads-3"].argv.index("--threads") + 1] == "3"
    assert cmds["isa-avx2"].env == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert cmds["fp32-isa-avx2"].env["CPU_QUANT_COMPUTE_DTYPE"] == "fp32"
    assert all("--samples" in c.argv and "32" in c.argv for c in cmds.values())
    smoke = determinism.build(SuiteOptions(smoke=True, workdir=tmp_path, source=tmp_path,
                                           arms=None, prebuilt={}))
    assert [a.name for a in smoke.arms] == list(determinism.SMOKE_ARMS)
