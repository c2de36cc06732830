"""Interruption, resume, full disks and locks."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from cpu_quant.models.tiny import make_tiny_model

from .conftest import CLI, REPO, SMALL_CALIB, run_cli
from .hostile.generate import invoke


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_layers(staging: Path, proc: subprocess.Popen, layers: int, timeout: float = 1500) -> int:
    state = staging / "cpu_quant_state.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before layer {layers}: {proc.stderr.read()[-2000:]}")
        try:
            done = json.loads(state.read_text())["completed_layers"]
        except (OSError, ValueError, KeyError):
            done = 0
        if done >= layers:
            return done
        time.sleep(0.2)
    raise AssertionError("timed out waiting for a completed layer")


def _deep_tiny_model(demo_src: Path, dst: Path, layers: int = 12) -> Path:
    """The tiny Llama made deeper, so that a signal sent after a layer arrives before the end."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_tiny_model("llama", dst, demo_src)
    config = AutoConfig.from_pretrained(dst)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(dst)
    return dst


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical(demo_src, tmp_path):
    """A real run killed after two layers resumes to the uninterrupted run's artifact, bit for
    bit. The killed run keeps its activations on disk (--offload-activations: one file per
    calibration batch per generation, never the in-memory checkpoint) and the resume holds them
    in memory: where activations live is not part of the fingerprint and changes nothing."""
    src = _deep_tiny_model(demo_src, tmp_path / "deep")
    common = ["--group", "32", *SMALL_CALIB, "--no-eval"]
    run_cli("gptq", str(src), str(tmp_path / "whole"), *common)
    dst = tmp_path / "resumed"
    staging = tmp_path / ".resumed.partial"
    args = ["gptq", str(src), str(dst), *common]
    proc = _start(*args, "--offload-activations")
    _wait_for_layers(staging, proc, 2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if dst.exists():
        pytest.fail("the run finished before SIGKILL reached it; make the model deeper")
    done = json.loads((staging / "cpu_quant_state.json").read_text())["completed_layers"]
    assert 2 <= done < 12
    gen = staging / "activations" / f"gen-{done:05d}"
    assert sorted(p.name for p in gen.iterdir()) == ["batch-00000.safetensors", "batch-00001.safetensors"]
    assert not list(staging.glob("cpu_quant_hidden*"))
    assert not (staging / "activations" / f"gen-{done - 1:05d}").exists()
    # a resume with other settings is refused, and leaves the partial run alone
    refused = run_cli(*args[:-1], "--samples", "8", "--no-eval", "--resume", check=False)
    assert refused.returncode != 0 and "cannot resume" in refused.stderr
    run_cli(*args, "--resume")
    expected, got = _tensors(tmp_path / "whole"), _tensors(dst)
    assert sorted(expected) == sorted(got)
    for name, tensor in expected.items():
        assert torch.equal(tensor, got[name]), name
    report = json.loads((dst / "quantization_report.json").read_text())
    assert len(report["layer_seconds"]) == 12 and len(report["tensors"]) == 12 * 7 + 1
    assert not staging.exists() and not (dst / "activations").exists()


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_offloaded_run_equals_in_memory_run(tiny_llama, tmp_path):
    common = ["--group", "32", "--samples", "6", "--seqlen", "64", "--batch-size", "2", "--no-eval"]
    run_cli("gptq", str(tiny_llama), str(tmp_path / "mem"), *common)
    run_cli("gptq", str(tiny_llama), str(tmp_path / "disk"), *common, "--offload-activations")
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # offloading pins lower (time for memory)
        pins = {k: json.loads((tmp_path / k / "quantization_report.json").read_text())
                ["provenance"]["malloc_mmap_threshold"] for k in ("mem", "disk")}
        assert pins == {"mem": 16 << 20, "disk": 4 << 20}
    mem, disk = _tensors(tmp_path / "mem"), _tensors(tmp_path / "disk")
    assert sorted(mem) == sorted(disk) and "lm_head.qweight" in disk
    for name, tensor in mem.items():
        assert torch.equal(tensor, disk[name]), name
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == \
        sorted(p.name for p in (tmp_path / "mem").iterdir())


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_ctrl_c_during_the_layers_stops_and_resumes(demo_src, tmp_path):
    src = _deep_tiny_model(demo_src, tmp_path / "deep")
    dst = tmp_path / "out"
    args = ["gptq", str(src), str(dst), "--group", "32", "--samples", "32", "--seqlen", "256", "--no-eval"]
    proc = _start(*args)
    _wait_for_layers(tmp_path / ".out.partial", proc, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    if proc.returncode == 0:
        pytest.fail("the run finished before Ctrl-C reached it; make the model deeper")
    assert proc.returncode == 130, err[-2000:]
    assert "--resume" in err and "Traceback" not in err
    assert not dst.exists() and (tmp_path / ".out.partial" / "cpu_quant_state.json").is_file()
    run_cli(*args, "--resume")
    assert (dst / "config.json").is_file()


def _wait_until_stopped(proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until ``proc`` has stopped itself (the SIGSTOP testing hook, signals.kill_point)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the hook: {proc.stderr.read()[-2000:]}")
        if Path(f"/proc/{proc.pid}/stat").read_text().rsplit(") ", 1)[1].startswith("T"):
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for the run to reach the hook")


@pytest.mark.slow  # a real multi-second run: the end-to-end tier keeps the unit tier under 10 minutes
def test_sigterm_during_the_head_stops_within_seconds_and_resumes(demo_src, tmp_path):
    # a 262144-row head on a 2-layer model: its quantization takes ~6 s, the layers well under 1 s
    src = make_tiny_model("llama", tmp_path / "wide", demo_src, vocab=262144)
    dst = tmp_path / "out"
    args = ["gptq", str(src), str(dst), "--group", "32", "--samples", "2", "--seqlen", "32",
            "--batch-size", "1", "--no-eval"]
    proc = subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, CPU_QUANT_KILL_AT="head:1:SIGSTOP"))
    _wait_until_stopped(proc)  # at the start of the head's quantization
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(1.0)  # well inside the head
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    latency = time.monotonic() - t0
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    [line] = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert "during the output head; layers 1-2 of 2 are saved" in line and "--resume" in line
    assert latency < 5.0, f"{latency:.1f} s from SIGTERM to exit"  # one row block at most
    assert not dst.exists()
    state = json.loads((tmp_path / ".out.partial" / "cpu_quant_state.json").read_text())
    assert state["completed_layers"] == 2
    run_cli(*args, "--resume")
    assert run_cli("verify", str(dst), check=False).returncode == 0


@pytest.mark.e2e
def test_a_stop_before_the_first_layer_keeps_nothing(tiny_llama, tmp_path):
    dst = tmp_path / "out"
    proc = subprocess.Popen([*CLI, "gptq", str(tiny_llama), str(dst), "--group", "32",
                             "--samples", "2", "--seqlen", "32", "--no-eval"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, CPU_QUANT_KILL_AT="calibration:1:SIGINT"))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "nothing was saved" in err
    assert not dst.exists() and not (tmp_path / ".out.partial").exists()


TINY_RTN = ["--method", "rtn", "--calib", "none", "--group", "32", "--no-eval"]


@pytest.mark.e2e
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_just_after_the_commit_finishes_the_card_and_says_dst_is_complete(
        tiny_llama, tmp_path, sig):
    """A stop that arrives just after DST was renamed into place (while the commit's signals
    are deferred) does not claim that nothing was written: the model card and report.html
    are finished, and the one line says DST is complete; exit status 130."""
    dst = tmp_path / "out"
    proc = subprocess.run([*CLI, "gptq", str(tiny_llama), str(dst), *TINY_RTN],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, CPU_QUANT_KILL_AT=f"committed:1:{sig}"))
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(("error:", "interrupted:"))]
    assert len(lines) == 1 and f"after {dst} was written: it is complete" in lines[0], lines
    assert "not written" not in proc.stderr
    assert (dst / "config.json").is_file() and (dst / "README.md").is_file()
    assert (dst / "report.html").is_file()
    assert "| method | rtn |" in (dst / "README.md").read_text()


@pytest.mark.e2e
def test_a_second_sigint_still_exits_with_status_130(tiny_llama, tmp_path):
    """Ctrl-C pressed again and again while a stopped run cleans up and exits: the status is
    130 every time, never a death by SIGINT, and no traceback."""
    dst, stamp = tmp_path / "out", tmp_path / "stamp"
    proc = subprocess.Popen([*CLI, "gptq", str(tiny_llama), str(dst), "--group", "32",
                             "--samples", "2", "--seqlen", "32", "--no-eval"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, CPU_QUANT_KILL_AT="layer-start:1:SIGINT",
                                     CPU_QUANT_KILL_STAMP=str(stamp)))
    deadline = time.monotonic() + 600
    while not stamp.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    while proc.poll() is None and time.monotonic() < deadline:  # the first SIGINT was sent
        proc.send_signal(signal.SIGINT)
        time.sleep(0.005)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]


@pytest.mark.e2e
def test_stdout_on_a_full_device_is_one_error_line(tmp_path):
    """`cpu-quant ... > /dev/full`: one line on stderr and a non-zero exit, no traceback."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    for args in (["probe"], ["probe", "--json"], ["--help"]):
        with open("/dev/full", "w") as full:
            proc = subprocess.run([*CLI, *args], stdout=full, stderr=subprocess.PIPE, text=True,
                                  timeout=300)
        assert proc.returncode != 0, args
        assert proc.stderr.strip().splitlines() == [
            "error: cannot write to standard output: No space left on device"], proc.stderr


def test_a_deleted_working_directory_is_one_error_line(tmp_path):
    """Run from a directory that was deleted (torch cannot even load there): one line."""
    gone = tmp_path / "gone"
    gone.mkdir()
    script = 'cd "$1" && rmdir "$1" && shift && exec "$@"'
    proc = subprocess.run(["sh", "-c", script, "sh", str(gone), *CLI, "gptq", *TINY_RTN],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "error: the working directory no longer exists (it was deleted): run cpu-quant from an "
        "existing directory"], proc.stderr


def test_a_stale_lock_is_taken_over(hostile_bases, tmp_path):
    """A lock whose owner is gone (a killed run) does not block the next run (a live owner's
    lock does: the hostile-input corpus)."""
    dst = tmp_path / "out"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / ".out.lock").write_text(str(gone.pid))
    out = invoke(["convert", hostile_bases.quant / "gptq", dst, "--to", "cpu_int4"])
    assert out.exit_code == 0, out.stderr[-2000:]
    assert (dst / "config.json").is_file() and not (tmp_path / ".out.lock").exists()


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to simulate a full disk: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_full_disk_fails_cleanly(hostile_bases, small_disk):
    dst = small_disk / "out"
    out = invoke(["gptq", hostile_bases.model, dst, "--method", "rtn", "--calib", "none",
                  "--group", "32", "--no-eval"])
    assert out.exit_code != 0 and not out.traceback, out.stderr[-2000:]
    assert len(out.error_lines) == 1 and "no space left" in out.error_lines[0], out.stderr[-2000:]
    assert os.listdir(small_disk) == []


@pytest.mark.e2e
def test_unwritable_output_directory(tiny_llama, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    dst = parent / "out"
    # root ignores permission bits, so make the parent a file-backed read-only bind mount
    proc = subprocess.run(["mount", "--bind", "-o", "ro", str(parent), str(parent)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot make a read-only mount: {proc.stderr.strip()}")
    try:
        out = invoke(["gptq", tiny_llama, dst, "--no-eval"])
    finally:
        subprocess.run(["umount", str(parent)], check=False)
    assert out.exit_code != 0 and not out.traceback, out.stderr[-2000:]
    assert len(out.error_lines) == 1 and "cannot write" in out.error_lines[0], out.stderr[-1000:]
    assert not dst.exists()


def test_releasing_the_heap_after_a_layer_starts_no_process(monkeypatch):
    """The per-layer ``malloc_trim`` must not look libc up again each time:
    ``ctypes.util.find_library`` forks ``ldconfig``, and a fork of the quantizer briefly doubles
    the RssAnon summed over its process tree (the memory benchmark's one-off peaks)."""

    from cpu_quant.core.memory import release_free_heap

    release_free_heap()  # the first call may look the allocators up

    def no_fork(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[:1]}")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_fork)
    release_free_heap()
    release_free_heap()


PIN_PROBE = r"""
import ctypes, sys
import torch
from benchmarks.memory_trace import _mallinfo2
from cpu_quant.core.memory import pin_mmap_threshold

mi = _mallinfo2()
if sys.argv[1] == "pin":
    assert pin_mmap_threshold(4 << 20)
big = torch.empty(24 << 20, dtype=torch.uint8)  # mapped; freeing it moves glibc's threshold
big[::4096] = 1
del big
before = mi().hblkhd
block = torch.empty(6 << 20, dtype=torch.uint8)
print(mi().hblkhd - before >= (6 << 20))
"""


@pytest.mark.parametrize("mode", ["pin", "default"])
def test_pinned_mmap_threshold_keeps_large_blocks_off_the_heap(mode):
    """glibc's default moves its mmap threshold up to the size of the last freed mapped block, so
    after a 24 MiB tensor is freed, a 6 MiB one lands on the heap (where, layer after layer, the
    heap fragments and grows: docs/reliability.md). Pinned at 4 MiB, as the pipeline does with
    --offload-activations (16 MiB otherwise), the 6 MiB block is still mapped on its own. The
    unpinned run shows the probe can tell them apart."""
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's malloc only")
    env = dict(os.environ)
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    out = subprocess.run([sys.executable, "-c", PIN_PROBE, mode], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ("True" if mode == "pin" else "False")


@pytest.mark.parametrize("bad", [["--depth", "0"], ["--samples", "-1"], ["--interval", "0"],
                                 ["--depth", "two"], ["--build", "plain"],
                                 ["--model", "demo", "--build", "tiny"], ["--layers", "2"],
                                 ["--model", "Llama-3.2-1B", "--layers", "17"]])
def test_memory_trace_rejects_bad_arguments_in_one_line(bad, tmp_path):
    import sys

    out = subprocess.run([sys.executable, "-m", "benchmarks.memory_trace", *bad, "--json",
                          str(tmp_path / "trace.json")], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error:" in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "trace.json").exists()


@pytest.mark.parametrize("bad", [["--arms", "bf16,nope"], ["--arms", "kernel", "--source", "."],
                                 ["--arms", "qwen05b", "--smoke"]])
def test_tinygemm_suite_rejects_bad_arguments_before_any_work(bad, tmp_path):
    import sys

    out = subprocess.run([sys.executable, "-m", "benchmarks", "run", "tinygemm", *bad,
                          "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error:" in out.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()
    assert not any((tmp_path / "work").rglob("*.safetensors"))  # no model was built


def test_resume_point_file_reads_back_through_safetensors(tmp_path):
    """The resume point's writer (tensor memory straight to the file, no serialised copy) makes
    a file that safetensors reads back exactly: dtypes, shapes, views, an empty tensor."""
    from safetensors.torch import load_file

    from cpu_quant.core.io.safetensors_writer import write_safetensors

    torch.manual_seed(0)
    slab = torch.randn(6, 5, 7).to(torch.bfloat16)
    tensors = {"batch.0": slab[:3], "batch.1": slab[3:], "odd": torch.randn(3, 7)[:, ::2],
               "half": torch.randn(11).half(), "empty": torch.zeros(0, 4)}
    path = tmp_path / "h.safetensors"
    write_safetensors(path, tensors)
    back = load_file(path)
    assert sorted(back) == sorted(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_resume_point_raises_its_write_error_in_the_main_thread():
    """A failed background write (a full disk) is raised by the next wait, or at the end of the
    run's block; while another error is on its way out, the write is only let finish."""
    from cpu_quant.quantize.resume import ResumePoint

    def full_disk():
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        with ResumePoint() as point:
            point.write(full_disk)
    point = ResumePoint()
    point.write(full_disk)
    with pytest.raises(OSError, match="No space left"):
        point.write(lambda: None)  # the next write waits for the last one first
    with pytest.raises(KeyError):
        with ResumePoint() as point:
            point.write(full_disk)
            raise KeyError("the layer's own error wins")
