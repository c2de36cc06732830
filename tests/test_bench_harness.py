"""Unit tests of the benchmark harness itself: the measuring rules must hold in code.

Pure and fast: the arms are tiny real subprocesses (``python -c``), no model is loaded.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import harness, provenance
from benchmarks.harness import (
    NO_DIFFERENCE,
    Arm,
    Command,
    HarnessError,
    Metric,
    SkippedArm,
    Suite,
)
from benchmarks.rss import TreeRssSampler, tree_anon_rss_bytes

REPO = Path(__file__).resolve().parents[1]

RATE = Metric("tokens_per_second", "tok/s", "higher")
TIME = Metric("seconds", "s", "lower")


# -- order rotation --------------------------------------------------------------------------
def test_two_arms_alternate_which_goes_first():
    assert harness.schedule(["A", "B"], 4) == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]


def test_every_arm_takes_every_position_once_in_n_passes():
    names = ["A", "B", "C"]
    order = harness.schedule(names, 3)
    for position in range(3):
        assert sorted(p[position] for p in order) == names
    assert all(sorted(p) == names for p in order)  # every pass runs every arm once


# -- direction -------------------------------------------------------------------------------
def test_best_is_max_for_rates_and_min_for_time():
    values = [3.0, 1.0, 2.0]
    assert RATE.best(values) == 3.0 and RATE.worst(values) == 1.0
    assert TIME.best(values) == 1.0 and TIME.worst(values) == 3.0
    assert harness.WALL_SECONDS.better == "lower"
    assert harness.PEAK_RSS_ANON.better == "lower"


def test_a_metric_must_declare_its_direction():
    with pytest.raises(HarnessError):
        Metric("speed", "tok/s", "faster")


def test_stats_use_the_direction_and_ignore_failed_passes():
    st = harness.stats(TIME, [2.0, None, 4.0, 3.0])
    assert (st.n, st.failed, st.median, st.spread, st.best, st.worst) == (3, 1, 3.0, 2.0, 2.0, 4.0)
    st = harness.stats(RATE, [2.0, None, 4.0, 3.0])
    assert (st.best, st.worst) == (4.0, 2.0)


# -- verdict -------------------------------------------------------------------------------
def test_no_difference_when_medians_differ_by_less_than_the_spread():
    a = [10.0, 11.0, 12.0]  # spread 2
    b = [10.5, 11.5, 12.5]  # median differs by 0.5
    assert harness.verdict(TIME, a, b, "A", "B") == NO_DIFFERENCE


def test_a_real_difference_names_the_better_arm_by_direction():
    slow = [10.0, 10.2, 10.1]
    fast = [5.0, 5.1, 5.2]
    assert harness.verdict(TIME, slow, fast, "slow", "fast").startswith("fast better")
    assert harness.verdict(RATE, slow, fast, "slow", "fast").startswith("slow better")


def test_identical_deterministic_values_are_no_difference():
    assert harness.verdict(TIME, [0.2] * 3, [0.2] * 3) == NO_DIFFERENCE


def test_fewer_than_three_passes_give_no_verdict():
    assert harness.verdict(TIME, [1.0, 1.0], [5.0, 5.0]).startswith(harness.INSUFFICIENT)


def test_ratios_are_paired_by_pass_and_skip_failures():
    assert harness.paired_ratios([2.0, None, 4.0], [1.0, 3.0, 8.0]) == [0.5, 2.0]
    cmp_ = harness.compare(TIME, [2.0, 2.0, 2.0], [1.0, 1.0, 1.0], "base", "arm")
    assert cmp_["ratio_median"] == 0.5 and cmp_["verdict"].startswith("arm better")
    delta = Metric("delta", "x", "lower", ratio=False)
    assert harness.compare(delta, [1.0] * 3, [2.0] * 3, "b", "a")["ratio_median"] is None


def test_passes_below_three_are_refused_unless_smoke():
    with pytest.raises(HarnessError):
        harness.check_passes(2, smoke=False)
    harness.check_passes(3, smoke=False)
    harness.check_passes(1, smoke=True)


# -- running a suite: interleaving and failure recording ------------------------------------
def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _value_arm(name: str, value: float, fail_on_pass: int | None = None, exit_status: int = 3,
               bad_output_on_pass: int | None = None) -> Arm:
    """An arm whose command writes ``value`` to a file, or fails on the given pass."""

    def command(ctx) -> Command:
        out = ctx.workdir / "value.json"
        if ctx.pass_index == fail_on_pass:
            return Command(_py(f"import sys; sys.stderr.write('boom in {name}'); "
                               f"sys.exit({exit_status})"))
        text = "not json" if ctx.pass_index == bad_output_on_pass else json.dumps({"v": value})
        return Command(_py(f"open({str(out)!r}, 'w').write({text!r})"))

    def collect(ctx, run) -> dict[str, float]:
        return {"seconds": json.loads((ctx.workdir / "value.json").read_text())["v"]}

    return Arm(name, {"value": value}, command, collect)


def _suite(arms: list[Arm], **kw) -> Suite:
    return Suite("unit", "harness unit test", [TIME], arms, {"purpose": "unit test"},
                 baseline=arms[0].name, **kw)


def _run(suite: Suite, tmp_path: Path, passes: int = 3, smoke: bool = False):
    return harness.run_suite(suite, passes, smoke, tmp_path / "out", tmp_path / "work",
                             log=lambda s: None)


def test_a_partial_record_names_the_machine_from_its_first_pass(tmp_path):
    seen = []
    arm = _value_arm("A", 1.0)
    collect = arm.collect

    def peek(ctx, run):  # what a reader of a cut-off run finds after each pass
        seen.extend(json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.partial.json"))
        return collect(ctx, run)

    _run(_suite([Arm("A", arm.settings, arm.command, peek)]), tmp_path)
    assert seen and all(s["complete"] is False for s in seen)
    assert seen[-1]["machine"]["cpu"] == provenance.cpu_info()
    assert len(seen[-1]["records"]) == 2


def test_run_suite_interleaves_with_rotation_and_writes_the_result(tmp_path):
    suite = _suite([_value_arm("A", 2.0), _value_arm("B", 1.0)])
    result, path = _run(suite, tmp_path)
    assert json.loads(path.read_text())["suite"] == "unit" and result["complete"]
    assert not list(path.parent.glob("*.partial.json"))  # the running record is cleaned up
    ran = [(r["pass_index"], r["position"], r["arm"]) for r in result["records"]]
    assert ran == [(0, 0, "A"), (0, 1, "B"), (1, 0, "B"), (1, 1, "A"), (2, 0, "A"), (2, 1, "B")]
    assert result["summary"]["B"]["seconds"]["median"] == 1.0
    assert result["comparisons"]["B"]["seconds"]["ratio_median"] == 0.5
    assert result["comparisons"]["B"]["seconds"]["verdict"].startswith("B better")
    # wall time and peak RssAnon are measured for every pass by the harness itself
    assert all(r["wall_seconds"] > 0 and r["rss"]["samples"] >= 1 for r in result["records"])
    assert all(r["cpu_seconds"] is not None and r["cpu_seconds"] >= 0 for r in result["records"])


def test_arms_in_groups_are_compared_with_their_own_baseline():
    summary = {arm: {"seconds": harness.stats(TIME, [v] * 3)}
               for arm, v in {"x:a": 2.0, "x:b": 1.0, "y:a": 4.0, "y:b": 4.0}.items()}
    groups = {"x:a": "x:a", "x:b": "x:a", "y:a": "y:a", "y:b": "y:a"}
    got = harness.compare_all([TIME], summary, None, 3, groups)
    assert set(got) == {"x:b", "y:b"}  # a group's baseline is not compared with itself
    assert got["x:b"]["seconds"]["ratio_median"] == 0.5
    assert got["y:b"]["seconds"]["verdict"] == harness.NO_DIFFERENCE
    # without groups: everything against the one baseline, as before
    assert set(harness.compare_all([TIME], summary, "x:a", 3)) == {"x:b", "y:a", "y:b"}


def test_cpu_seconds_count_the_child_tree_not_the_harness():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    run = harness.run_measured(Command(_py(burn)))
    assert run.ok and 0.45 <= run.cpu_seconds <= run.wall_seconds + 0.5


def test_a_stopped_harness_leaves_no_run_behind(tmp_path):
    """A benchmark stopped by SIGTERM (or killed) takes the run it measures with it: the
    measured command is in its own session, so only the harness's own request ends it."""
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "child.pid"
    child = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(120)"
    driver = ("from benchmarks import harness\n"
              f"harness.run_measured(harness.Command({_py(child)!r}))")
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    measured = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while True:
        try:
            stat = Path(f"/proc/{measured}/stat").read_text().rsplit(")", 1)[-1].split()
        except FileNotFoundError:
            break  # gone
        if stat[0] == "Z":  # a zombie: dead, waiting to be reaped
            break
        assert time.monotonic() < deadline, "the measured run outlived the harness"
        time.sleep(0.05)


def test_failed_passes_are_recorded_with_status_and_stderr_never_dropped(tmp_path):
    suite = _suite([_value_arm("A", 2.0), _value_arm("B", 1.0, fail_on_pass=1, exit_status=7)])
    result, path = _run(suite, tmp_path)
    assert len(result["records"]) == 6 and result["failed_passes"] == 1
    failed = [r for r in result["records"] if not r["ok"]]
    assert failed[0]["arm"] == "B" and failed[0]["pass_index"] == 1
    assert failed[0]["exit_status"] == 7 and "boom in B" in failed[0]["stderr_tail"]
    st = result["summary"]["B"]["seconds"]
    assert st["n"] == 2 and st["failed"] == 1 and st["values"] == [1.0, None, 1.0]
    assert "insufficient passes" in result["comparisons"]["B"]["seconds"]["verdict"]
    on_disk = json.loads(path.read_text())
    assert on_disk["failed_passes"] == 1 and not on_disk["records"][2]["ok"]  # pass 1 runs B first


def test_unreadable_output_and_timeouts_are_failures_too(tmp_path):
    slow = Arm("slow", {}, lambda ctx: Command(_py("import time; time.sleep(30)"), timeout=0.5),
               lambda ctx, run: {"seconds": 1.0})
    suite = _suite([_value_arm("A", 2.0, bad_output_on_pass=0), slow])
    result, _ = _run(suite, tmp_path, passes=1, smoke=True)
    by_arm = {r["arm"]: r for r in result["records"]}
    assert not by_arm["A"]["ok"] and "output unreadable" in by_arm["A"]["error"]
    assert not by_arm["slow"]["ok"] and by_arm["slow"]["exit_status"] is None
    assert "timeout" in by_arm["slow"]["stderr_tail"]


def test_a_failed_build_fails_every_pass_of_its_arm(tmp_path):
    arm = _value_arm("B", 1.0)
    arm.build = lambda bdir: Command(_py("import sys; sys.stderr.write('no build'); sys.exit(5)"))
    result, _ = _run(_suite([_value_arm("A", 2.0), arm]), tmp_path)
    b = [r for r in result["records"] if r["arm"] == "B"]
    assert len(b) == 3 and all(not r["ok"] and r["exit_status"] == 5 for r in b)
    assert "no build" in b[0]["stderr_tail"] and result["builds"]["B"]["exit_status"] == 5


def test_skipping_an_arm_is_only_allowed_in_smoke_and_is_recorded(tmp_path):
    suite = _suite([_value_arm("A", 2.0)], skipped=[SkippedArm("peer", "venv absent")])
    with pytest.raises(HarnessError):
        _run(suite, tmp_path)
    result, _ = _run(suite, tmp_path, passes=1, smoke=True)
    assert result["skipped_arms"] == [{"arm": "peer", "reason": "venv absent"}]


# -- provenance --------------------------------------------------------------------------
def test_provenance_is_complete(tmp_path):
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "model.safetensors").write_bytes(b"weights")
    prov = provenance.collect({"group": 128}, {"artifact": art}, {"peer": {"path": "x"}})
    provenance.validate(prov)
    assert set(provenance.REQUIRED) <= set(prov)
    assert provenance.SHA_RE.match(prov["git"]["sha"])
    assert prov["packages"]["torch"] and prov["packages"]["transformers"]
    assert prov["artifacts"]["artifact"]["sha256"] and prov["artifacts"]["artifact"]["bytes"] == 7
    assert prov["threads"]["torch_threads"] >= 1 and prov["cpu"]["flags"]
    assert prov["settings"] == {"group": 128}


@pytest.mark.parametrize("breakage", [
    lambda p: p.pop("cpu"),
    lambda p: p["git"].update(sha=None),
    lambda p: p["packages"].update(torch=None),
    lambda p: p["artifacts"]["artifact"].update(sha256=""),
    lambda p: p["cpu"].update(flags=None),
    lambda p: p["threads"].update(torch_threads=None),
    lambda p: p.update(settings={}),
])
def test_incomplete_provenance_is_refused(tmp_path, breakage):
    f = tmp_path / "a.bin"
    f.write_bytes(b"x")
    prov = provenance.collect({"k": 1}, {"artifact": f})
    breakage(prov)
    with pytest.raises(provenance.ProvenanceError):
        provenance.validate(prov)


def test_every_result_carries_validated_provenance(tmp_path):
    result, _ = _run(_suite([_value_arm("A", 2.0)]), tmp_path, passes=1, smoke=True)
    provenance.validate(result["provenance"])
    assert result["provenance"]["settings"]["passes"] == 1
    assert result["provenance"]["settings"]["arms"] == {"A": {"value": 2.0}}


# -- memory of a process tree -----------------------------------------------------------------
def test_rss_sampler_sums_anonymous_memory_over_the_process_tree():
    # the measured process allocates nothing; its child holds ~200 MiB of anonymous memory
    grandchild = "b = bytearray(200 * 2**20); import time; time.sleep(1.5)"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}])"
    run = harness.run_measured(Command(_py(code)), rss_interval=0.05)
    assert run.ok
    assert run.rss["peak_rss_anon_bytes"] > 190 * 2**20
    # ... counted once: two small interpreters add tens of MiB, not another 200 (no double sum)
    assert run.rss["peak_rss_anon_bytes"] < 300 * 2**20
    assert run.rss["peak_processes"] >= 2 and run.rss["sample_errors"] == 0
    # the peak is located in time: after the child allocated, before it exited
    assert 0 < run.rss["peak_at_seconds"] <= run.wall_seconds


def test_rss_of_a_finished_tree_is_zero_and_sampler_stops():
    import os

    assert tree_anon_rss_bytes(os.getpid()) > 0
    sampler = TreeRssSampler(os.getpid(), 0.01).start()
    assert sampler.stop() > 0 and sampler.samples >= 1


# -- runtime_patches_bench: arms and their connected knobs ------------------------------------
def test_runtime_bench_baseline_is_patches_off_where_stock_vllm_cannot_load(tmp_path):
    from benchmarks import runtime_patches_bench as rb

    for method, expected in (("gptq", ["stock", "patched"]), ("cpu_int4", ["patches-off", "patched"])):
        model = tmp_path / method
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": method}}))
        plan = rb.arm_plan(model)
        assert list(plan) == expected  # the first arm is the baseline
        assert rb.build_suite(method, model).baseline == expected[0]
    off_plugins, off_switches = rb.arm_plan(tmp_path / "cpu_int4")["patches-off"]
    assert off_plugins == "cpu_quant"
    assert off_switches == {"CPU_QUANT_PATCH_KV_BUDGET": "0", "CPU_QUANT_PATCH_RELEASE_MEMORY": "0",
                            "CPU_QUANT_PATCH_AOT_CACHE": "0"}

    on = {"plugin_lines": 6, "patch_status": {p: ["applied"] for p in rb.PATCHES}}
    off = {"plugin_lines": 4, "patch_status": {p: ["off"] for p in rb.PATCHES}}
    none = {"plugin_lines": 0, "patch_status": {p: [] for p in rb.PATCHES}}
    rb._check_connected("patched", on)
    rb._check_connected("patches-off", off)
    rb._check_connected("stock", none)
    for arm, start in (("patched", off), ("patches-off", on), ("stock", on), ("patched", none)):
        with pytest.raises(HarnessError):
            rb._check_connected(arm, start)


@pytest.mark.parametrize("line, counts, seconds", [
    ("308 passed, 1 skipped, 2 xfailed in 512.34s (0:08:32)",
     {"passed": 308, "skipped": 1, "xfailed": 2}, 512.34),
    ("=========== 3 failed, 40 passed, 5 warnings in 61.00s (0:01:01) ===========",
     {"failed": 3, "passed": 40, "warnings": 5}, 61.0),
])
def test_test_tiers_reads_pytests_closing_line(line, counts, seconds):
    from benchmarks.test_tiers import pytest_summary

    got = pytest_summary(f"tests/test_x.py ....\nslowest durations\n{line}\n")
    assert got == {"counts": counts, "pytest_seconds": seconds}
    assert pytest_summary("no summary here\n") is None


def test_test_tiers_reads_every_tests_seconds_from_junit_xml(tmp_path):
    """Per-test seconds come from pytest's own JUnit report, named as pytest names the test,
    longest first; no report (setup, or pytest died early) gives none."""
    import subprocess

    from benchmarks.test_tiers import test_seconds

    (tmp_path / "test_two.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\n"
        "def test_slow():\n    time.sleep(0.3)\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-o", "addopts=", f"--junit-xml={junit}", "test_two.py"],
                   cwd=tmp_path, check=True, capture_output=True)
    got = test_seconds(junit)
    assert list(got) == ["test_two.py::test_slow", "test_two.py::test_quick"]
    assert got["test_two.py::test_slow"] >= 0.3 > got["test_two.py::test_quick"]
    assert test_seconds(tmp_path / "missing.xml") == {}


def test_bit_identity_compares_every_tensor_by_name(tmp_path):
    from safetensors.torch import save_file

    from benchmarks.bit_identity import compare, differences, main, output_digests

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    t = {"x": torch.arange(6, dtype=torch.int32).reshape(2, 3), "y": torch.ones(4, dtype=torch.bfloat16)}
    save_file(t, str(a / "one.safetensors"))
    save_file({"x": t["x"]}, str(b / "p1.safetensors"))  # other sharding, same tensors
    save_file({"y": t["y"]}, str(b / "p2.safetensors"))
    assert compare(a, b)["identical"]
    save_file({"y": t["y"].view(torch.int16).to(torch.float32)}, str(b / "p2.safetensors"))
    got = compare(a, b)
    assert not got["identical"] and got["differing"] == ["y"]
    # the suite's digests: every safetensors directory under a run's output, keyed by directory
    ref, run = output_digests(tmp_path), output_digests(tmp_path)
    assert set(ref) == {"a/x", "a/y", "b/x", "b/y"} and differences(ref, run) == {
        "only_in_reference": [], "only_in_run": [], "differing": []}
    (b / "model.gguf").write_bytes(b"GGUF")
    save_file({"y": t["y"]}, str(b / "p2.safetensors"))
    run = output_digests(tmp_path)
    assert differences(ref, run) == {"only_in_reference": [], "only_in_run": ["b/model.gguf"],
                                     "differing": ["b/y"]}
    (a / "config.json").write_text("{}")
    argv = ["--arm", "gptq", "--tree", str(REPO), "--out", str(tmp_path / "o"), "--json",
            str(tmp_path / "d.json")]
    assert main([*argv, "--src", str(tmp_path / "missing")]) == 2  # no checkpoint
    assert main([*argv[:2], "--tree", str(tmp_path), *argv[4:], "--src", str(a)]) == 2


def test_bit_identity_pins_austen_and_drops_the_pin_for_an_older_tree(tmp_path):
    """Every arm runs the Austen calibration: by name in a tree that knows the named
    calibrations, by default (Austen there) in one from before them."""
    from benchmarks.bit_identity import COMMANDS, PIN, command

    old = tmp_path / "old"
    (old / "cpu_quant").mkdir(parents=True)
    for arm in COMMANDS:
        new_argv = command(arm, tmp_path / "src", tmp_path / "out", False, REPO)
        old_argv = command(arm, tmp_path / "src", tmp_path / "out", False, old)
        i = new_argv.index(PIN[0])
        assert new_argv[i:i + 2] == PIN and PIN[0] not in old_argv
        assert old_argv == new_argv[:i] + new_argv[i + 2:]


def test_test_tiers_times_what_ci_and_the_readme_run():
    """The timed steps are .ci/run's commands, and the README's test command is the same
    commands joined with ``&&``: a change to one that the others miss fails here."""
    from benchmarks.test_tiers import REPO, steps

    got = steps(True)
    assert [name for name, _ in got] == ["setup", "unit", "e2e"]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.startswith(("./scripts/setup.sh", ".venv/bin/python -m pytest"))]
    assert len(ci) == 3
    assert " && ".join(ci) in (REPO / "README.md").read_text()


def test_provenance_threads_without_torch(monkeypatch):
    """The tiers' runner collects provenance in the interpreter that ran setup.sh, which has
    no torch: the thread settings must not need it."""
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    threads = provenance.thread_settings()
    assert threads["torch_threads"] is None
    assert threads["cpu_count"] == os.cpu_count()


def test_test_tiers_takes_the_provenance_from_the_venv(monkeypatch):
    """The tiers' runner may run in a Python without torch (it builds the venv): the
    provenance it writes is the venv's, with torch's version and the thread count, and it
    validates."""
    from benchmarks.test_tiers import venv_provenance

    monkeypatch.setitem(sys.modules, "torch", None)
    prov = venv_provenance({"steps": ["unit"]})
    provenance.validate(prov)
    assert prov["packages"]["torch"] and prov["threads"]["torch_threads"]
    assert prov["settings"] == {"steps": ["unit"]}


def test_dist_projection_reads_the_committed_distributed_run(tmp_path, demo_src):
    """The 8B projection runs on the suite's committed result (its settings are in the
    provenance), and its payload model reproduces the bytes the two ranks really received."""
    from benchmarks import dist_projection
    from benchmarks.suites.dist_projection import distributed_result

    measured = distributed_result()
    out = tmp_path / "projection.json"
    assert dist_projection.main([str(measured), "--source", str(demo_src),
                                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["measured"]["payload_check"]["exact"]
    assert [row["hosts"] for row in doc["projection"]] == [1, 4, 16]
    assert dist_projection.main([str(measured), "--source", str(tmp_path / "nowhere"),
                                 "--json", str(tmp_path / "other.json")]) == 2
    assert not (tmp_path / "other.json").exists()


def _run_smoke(suite: str, tmp_path, arms: list[str]) -> dict:
    from benchmarks.__main__ import main as bench_main

    assert bench_main(["run", suite, "--smoke", "--arms", ",".join(arms), "--out", str(tmp_path),
                       "--workdir", str(tmp_path / "work")]) == 0
    (path,) = tmp_path.glob(f"{suite}-smoke-*.json")
    doc = json.loads(path.read_text())
    provenance.validate(doc["provenance"])
    assert not doc["failed_passes"], doc["failed_passes"]
    return doc


def test_core_scaling_smoke_writes_the_pair_over_solo(tmp_path):
    """The core-scaling suite runs its real workload in pinned processes: a pair's rate is the
    sum of its two processes' and is compared with the solo rate of the same workload (one
    workload here: the other differs only in its operation)."""
    doc = _run_smoke("core_scaling", tmp_path, ["solo-gram", "pair-gram"])
    solo, = (r for r in doc["records"] if r["arm"] == "solo-gram")
    pair, = (r for r in doc["records"] if r["arm"] == "pair-gram")
    assert solo["metrics"]["rate"] > 0 and len(pair["extras"]["rates"]) == 2
    assert pair["metrics"]["rate"] == pytest.approx(sum(pair["extras"]["rates"]))
    assert doc["baseline_of"]["pair-gram"] == "solo-gram"


def test_hessian_cost_smoke_times_every_operation_and_the_products_errors(tmp_path):
    """The Hessian-cost suite times each product and factorization in its own process, and
    records each product's error against float64: the exact sums' is at float32's rounding,
    the bf16 slabs' far above it."""
    ops = ("bf16-slabs", "gram", "lapack", "blocked")
    doc = _run_smoke("hessian_cost", tmp_path, [f"{op}-128" for op in ops])
    arms = {r["arm"]: r for r in doc["records"]}
    assert set(arms) == {f"{op}-128" for op in ops}
    exact, slabs = (arms[f"{op}-128"]["extras"]["max_error_relative"] for op in ("gram", "bf16-slabs"))
    assert exact < 1e-6 < slabs, (exact, slabs)
    assert doc["baseline_of"]["gram-128"] == "bf16-slabs-128"
    assert doc["baseline_of"]["blocked-128"] == "lapack-128"
    assert all(r["metrics"]["seconds"] > 0 for r in doc["records"])


def test_dist_projection_suite_projects_from_the_committed_run(tmp_path, demo_src):
    """The projection suite's arm runs the worker on the newest committed distributed result:
    the payload model reproduces the measured bytes (its metric must be 0)."""
    from benchmarks.__main__ import main as bench_main

    assert bench_main(["run", "dist_projection", "--smoke", "--source", str(demo_src), "--out",
                       str(tmp_path), "--workdir", str(tmp_path / "work")]) == 0
    (path,) = tmp_path.glob("dist_projection-smoke-*.json")
    doc = json.loads(path.read_text())
    (rec,) = doc["records"]
    assert rec["ok"] and rec["metrics"]["payload_errors"] == 0
    assert rec["metrics"]["best_total_hours"] == min(r["total_hours"]
                                                     for r in rec["extras"]["projection"])


def test_bit_identity_reads_the_reference_of_a_complete_or_partial_file():
    from benchmarks.suites.bit_identity import reference_of

    settings = {"reference": "843b488", "reference_sha": "843b48823cea" + "0" * 28}
    assert reference_of({"provenance": {"settings": settings}}) == settings
    assert reference_of({"complete": False, "settings": settings}) == settings
    older = {"complete": False, "builds": {"gptq": {"argv": [
        "python", "-m", "benchmarks.bit_identity", "--arm", "gptq", "--tree",
        "/w/reference-843b48823cea", "--src", "/s"]}}}
    assert reference_of(older) == {"reference": "843b48823cea", "reference_sha": "843b48823cea"}
    with pytest.raises(ValueError, match="no reference"):
        reference_of({"complete": False, "builds": {}})


def test_bit_identity_reuses_a_finished_build_of_the_same_command_and_revision(tmp_path):
    from benchmarks.bit_identity import command
    from benchmarks.suites.bit_identity import reusable

    tree, other, src, bdir = (tmp_path / n for n in ("reference-aaa", "reference-bbb", "src", "b"))
    bdir.mkdir()
    assert not reusable(bdir, "gptq", tree, src, False)  # nothing built
    done = {"argv": command("gptq", src.resolve(), bdir.resolve(), False, tree),
            "tree": str(tree.resolve()), "exit_status": 0, "digests": {}, "digest": ""}
    (bdir / "digests.json").write_text(json.dumps(done))
    assert reusable(bdir, "gptq", tree, src, False)
    assert not reusable(bdir, "gptq", other, src, False)  # another revision
    assert not reusable(bdir, "formats", tree, src, False)  # another command
    assert not reusable(bdir, "gptq", tree, src, True)  # the smoke sizes
    (bdir / "digests.json").write_text(json.dumps({**done, "exit_status": 1}))
    assert not reusable(bdir, "gptq", tree, src, False)
