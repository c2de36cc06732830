"""Data-parallel GPTQ over torch.distributed (``quantize/distributed.py``, ``cli/launcher.py``).

The ranks are real processes on loopback (gloo over 127.0.0.1), started the three ways a user
starts them: ``torchrun --standalone`` (``python -m torch.distributed.run``), ``cpu-quant gptq
--nproc``, and by hand with torch's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``.
What they must do:

* write the artifact a single process writes, bit for bit, whatever the threads of either
  (no tolerance: the Hessians are the same sums in the same order, the GPTQ rows the same
  computation, the factors the same at any thread count), for 2, 3 and 4 ranks;
* stop every rank with one line and nothing that looks like an output when a rank dies or
  hangs, keeping the finished layers for ``--resume`` (which may use another number of
  ranks);
* refuse, before any work, ranks started with different options or sources.

The pure pieces (row shares, code packing) are checked in-process; everything that starts
processes is in the end-to-end tier (each run pays its processes' start-up, tens of seconds
on a shared 2-core machine).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.bit_identity import compare, differences, output_digests
from cpu_quant.core.grid import GroupQuant
from cpu_quant.models.tiny import make_tiny_model
from cpu_quant.quantize import schedule
from cpu_quant.quantize.distributed import _pack_codes, _unpack_codes, rank_pieces
from cpu_quant.quantize.gptq import GridSpec
from cpu_quant.quantize.schedule import ROW_ALIGN, LocalRows, Piece, QuantJob, quantize_linears

from .conftest import CLI, REPO
from .helpers.processes import children, kill_and_list_survivors

# A small calibration the tiny model takes in seconds: 8 windows of 64 tokens in 4 batches (a
# rank needs at least one batch), from a short text so the tokenizer has little to read.
TINY_CALIB = ["--samples", "8", "--seqlen", "64", "--batch-size", "2", "--group", "32",
              "--no-eval", "--threads", "1"]
# the main job's three formats from one run: the ranks must write every tensor and GGUF byte
FORMATS = ["--format", "gptq,cpu_int4,gguf"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


# -- in-process: the row shares and the packed codes -----------------------------------------
@pytest.mark.parametrize("rows", [1, 63, 64, 576, 960, 1000, 3072, 4100, 49152])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_pieces_cover_every_row_once_in_order(rows, world):
    pieces = rank_pieces(0, rows, world)
    assert [p.r0 for p in pieces][0] == 0 and pieces[-1].r1 == rows
    assert all(a.r1 == b.r0 for a, b in zip(pieces, pieces[1:], strict=False))
    assert all(p.r1 - p.r0 <= schedule.ROW_BLOCK for p in pieces)
    assert [p.owner for p in pieces] == sorted(p.owner for p in pieces)
    # every piece starts where a rank's range or a single process's block starts
    assert all(p.r0 % ROW_ALIGN == 0 for p in pieces)
    # no piece crosses a single process's block boundary
    assert all(p.r0 // schedule.ROW_BLOCK == (p.r1 - 1) // schedule.ROW_BLOCK for p in pieces)
    # near-equal shares: within two alignment steps of rows / world
    shares = [sum(p.r1 - p.r0 for p in pieces if p.owner == r) for r in range(world)]
    assert max(shares) - min(shares) <= 2 * ROW_ALIGN or rows < world * ROW_ALIGN


def test_packed_codes_round_trip():
    gen = torch.Generator().manual_seed(1)
    for k in (64, 65, 576):
        codes = torch.randint(0, 16, (7, k), generator=gen, dtype=torch.uint8)
        packed = _pack_codes(codes)
        assert packed.shape == (7, (k + 1) // 2) and packed.dtype == torch.uint8
        assert torch.equal(_unpack_codes(packed, k), codes)


class RankCuts(LocalRows):
    """Every piece this process's, cut where a distributed run of ``world`` ranks cuts."""

    def __init__(self, world: int) -> None:
        self.world = world

    def cut(self, stack: int, rows: int) -> list[Piece]:
        return [Piece(p.stack, p.r0, p.r1, 0) for p in rank_pieces(stack, rows, self.world)]


def test_rows_cut_as_ranks_cut_them_quantize_bit_identically(monkeypatch):
    """The premise of sharing a sweep's rows out: each row's codes and scales do not depend on
    which other rows share its matrix, for the cuts the ranks make (the single process's row
    blocks included: ROW_BLOCK is lowered so the tall job spans three)."""
    from cpu_quant.formats import get_format
    from cpu_quant.quantize.plan import plan_linear
    from cpu_quant.quantize.settings import QuantSettings

    monkeypatch.setattr(schedule, "ROW_BLOCK", 128)
    limits = get_format("gptq").limits
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(256, 64, generator=gen) * torch.rand(64, generator=gen) * 3
    shared = 2 * x.t() @ x / 256
    jobs = [QuantJob(torch.randn(n, 64, generator=gen).to(torch.bfloat16),
                     plan_linear(name, 64, n, 32, False, limits), shared)
            for name, n in {"q": 192, "k": 64, "v": 64, "tall": 301}.items()]
    for grid in (GridSpec(), GridSpec(symmetric=False)):
        settings = QuantSettings(method="gptq", group_size=32)
        alone = quantize_linears(jobs, settings, grid)
        for world in (3, 4):  # (2 cuts these stacks where the blocks already are)
            cut = quantize_linears(jobs, settings, grid, RankCuts(world))
            for (a, ra), (b, rb) in zip(alone, cut, strict=True):
                assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
                assert (a.zeros is None) == grid.symmetric
                assert grid.symmetric or torch.equal(a.zeros, b.zeros)
                assert ra == rb


def test_group_quant_shapes_survive_the_exchange_dtypes():
    """What a rank receives into has the shapes and dtypes a sweep produces (codes uint8,
    scales float32), so the broadcast copies bytes, never converts them."""
    from cpu_quant.quantize.gptq import quantize_gptq

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=gen)
    x = torch.randn(256, 128, generator=gen)
    gq, _ = quantize_gptq(w, 2 * x.t() @ x / 256, 64, GridSpec(), act_order=True)
    assert gq.codes.dtype == torch.uint8 and gq.scales.dtype == torch.float32
    assert gq.codes.is_contiguous() and gq.scales.is_contiguous()
    assert isinstance(gq, GroupQuant) and gq.scales.shape == (64, 2)


# -- real ranks ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(key, None)
    env.update(extra)
    return env


def _run(argv: list[str], timeout: int = 900, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=_env(**env))


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def tiny(demo_src, tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("dist") / "tiny", demo_src)


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory) -> Path:
    from cpu_quant.data.corpus import builtin_split

    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(builtin_split("calibration"))[:20000])
    return path


@pytest.fixture(scope="module")
def one_process(tiny, calib_text, tmp_path_factory) -> Path:
    """The single process's artifacts of the tiny model (one thread): ``DIR/gptq``,
    ``DIR/cpu_int4``, ``DIR/gguf``."""
    dst = tmp_path_factory.mktemp("solo") / "out"
    proc = _run([*CLI, "gptq", str(tiny), str(dst), "--calib", str(calib_text), *TINY_CALIB,
                 *FORMATS])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dst


def _same(a: Path, b: Path) -> None:
    got = compare(a, b)
    assert got["identical"], {k: v for k, v in got.items() if v}


def _same_formats(a: Path, b: Path) -> None:
    """Every tensor of both safetensors formats and every byte of the GGUF file equal."""
    ours, theirs = output_digests(a), output_digests(b)
    assert any(k.endswith(".gguf") for k in ours) and any(k.startswith("cpu_int4/") for k in ours)
    assert not any(differences(ours, theirs).values()), differences(ours, theirs)


@pytest.mark.e2e
def test_ranks_write_the_one_process_artifact(tiny, calib_text, one_process, tmp_path):
    """2 ranks by torchrun, 3 and 4 by --nproc (4 at two threads each, the single process at
    one), each writing GPTQ, cpu_int4 and GGUF from one run: the same tensors (the smoothing
    factors included, whose 2 statistics batches leave 3 and 4 ranks some without any), bit
    for bit, the same GGUF bytes, and the report records the world size, each rank's batches
    (disjoint, in order, all of them), threads and time."""
    args = ["gptq", str(tiny), "--calib", str(calib_text), *TINY_CALIB, *FORMATS]
    runs = {2: [*TORCHRUN, "--nproc-per-node", "2", "-m", "cpu_quant", *args[:2],
                str(tmp_path / "r2"), *args[2:]]}
    for n in (3, 4):
        runs[n] = [*CLI, *args[:2], str(tmp_path / f"r{n}"), *args[2:], "--nproc", str(n)]
    runs[4] += ["--threads", "2"]  # the last --threads wins
    for n, argv in runs.items():
        proc = _run(argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _same_formats(one_process, tmp_path / f"r{n}")
        report = json.loads((tmp_path / f"r{n}" / "gptq" / "quantization_report.json").read_text())
        assert report["smoothing"]["folds"]  # the default folds smoothing: split over the ranks
        dist = report["distributed"]
        assert dist["world_size"] == n and dist["backend"] == "gloo"
        assert dist["launcher"] == ("torchrun" if n == 2 else "cpu-quant --nproc")
        spans = [r["batches"] for r in dist["ranks"]]
        assert spans[0][0] == 0 and spans[-1][1] == 4
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(spans, spans[1:], strict=False))
        threads = 2 if n == 4 else 1
        assert all(r["seconds"] > 0 and r["threads"] == threads for r in dist["ranks"])
        layers = dist["ranks"][1]["layers"]
        assert [x["layer"] for x in layers] == ["0", "1", "head"]
        assert all(x["bytes_received"] > 0 for x in layers)


@pytest.mark.e2e
def test_a_killed_rank_stops_the_run_in_one_line_and_resume_finishes_it(
        tiny, calib_text, one_process, tmp_path):
    """Rank 1 is SIGKILLed after the second layer's quantization: every rank stops, one line
    says which rank and what is kept, nothing looks like an artifact; the state on disk says
    what the line says; one process then resumes the two ranks' run to the same artifact."""
    dst = tmp_path / "out"
    argv = [*CLI, "gptq", str(tiny), str(dst), "--calib", str(calib_text), *TINY_CALIB]
    proc = _run([*argv, "--nproc", "2"], CPU_QUANT_KILL_AT="layer-computed:2",
                CPU_QUANT_KILL_RANK="1")
    assert proc.returncode != 0
    errors = _errors(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "rank 1 (pid" in errors[0] and "ended" in errors[0], errors[0]
    assert not dst.exists()
    staging = tmp_path / ".out.partial"
    assert not (staging / "config.json").exists()
    saved = json.loads((staging / "cpu_quant_state.json").read_text())["completed_layers"]
    assert saved == 1 and "layer 1 of 2 is saved" in errors[0] and "--resume" in errors[0]
    proc = _run([*argv, "--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same(one_process / "gptq", dst)


@pytest.mark.e2e
def test_a_stopped_rank_stops_the_run_after_the_timeout(tiny, calib_text, tmp_path):
    """A rank that hangs (SIGSTOP at the start of the second layer) stops the run once the
    others have waited --rank-timeout seconds, in one line naming it; the launcher kills it."""
    dst = tmp_path / "out"
    proc = _run([*CLI, "gptq", str(tiny), str(dst), "--calib", str(calib_text), *TINY_CALIB,
                 "--nproc", "2", "--rank-timeout", "15"],
                CPU_QUANT_KILL_AT="layer-start:2:SIGSTOP", CPU_QUANT_KILL_RANK="1")
    assert proc.returncode != 0
    errors = _errors(proc.stderr)
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "rank 1 (pid" in errors[0] and "is stopped" in errors[0], errors[0]
    assert not dst.exists() and not (tmp_path / ".out.partial" / "config.json").exists()


def test_a_rank_whose_launcher_is_gone_ends_itself():
    """``die_with_launcher`` in a process started by ``--nproc``'s launcher: alive while its
    launcher is its parent (and the variable does not reach its own children); SIGKILLed at
    once when the launcher ended before the death signal was asked for."""
    import signal

    code = ("import os; from cpu_quant.cli.launcher import die_with_launcher; die_with_launcher(); "
            "print(os.environ.get('CPU_QUANT_LAUNCHER_PID'))")
    alive = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env=_env(CPU_QUANT_LAUNCHER_PID=str(os.getpid())))
    assert alive.returncode == 0 and alive.stdout.strip() == "None", alive.stderr[-2000:]
    orphan = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, env=_env(CPU_QUANT_LAUNCHER_PID="1"))
    assert orphan.returncode == -signal.SIGKILL, (orphan.returncode, orphan.stderr[-2000:])


@pytest.mark.e2e
def test_ranks_die_with_a_killed_launcher_and_write_nothing(tiny, calib_text, tmp_path):
    """SIGKILL to the ``--nproc 2`` launcher (which then cannot stop its ranks; they run in
    sessions of their own) once the run is writing: both ranks end within seconds, and DST
    never appears (an orphaned rank would finish the run and write it after the failure)."""
    import time

    dst = tmp_path / "out"
    launcher = subprocess.Popen([*CLI, "gptq", str(tiny), str(dst), "--calib", str(calib_text),
                                 *TINY_CALIB, "--nproc", "2"], env=_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / ".out.partial").is_dir():
            assert launcher.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.05)
        ranks = children(launcher.pid)
        assert len(ranks) == 2, ranks
        left = kill_and_list_survivors(launcher, ranks)
        assert not left, f"ranks {left} outlived their launcher"
        time.sleep(2)
        assert not dst.exists()
        assert not (tmp_path / ".out.partial" / "config.json").exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _by_hand(args0: list[str], args1: list[str], cwd0: Path, cwd1: Path
             ) -> list[subprocess.CompletedProcess]:
    """Two ranks started by hand (torch's env:// rendezvous, rank 0 hosting the store)."""
    port = str(_free_port())
    procs = []
    for rank, (args, cwd) in enumerate(((args0, cwd0), (args1, cwd1))):
        env = _env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([*CLI, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.e2e
def test_a_rank_given_another_group_is_refused_before_any_work(tiny, calib_text, tmp_path):
    dst = tmp_path / "out"
    base = ["gptq", str(tiny), str(dst), "--calib", str(calib_text), *TINY_CALIB]
    other = [a if a != "32" else "64" for a in base]  # --group 64 on rank 1
    done = _by_hand(base, other, tmp_path, tmp_path)
    assert all(p.returncode != 0 for p in done)
    errors = [e for p in done for e in _errors(p.stderr)]
    assert errors == ["error: rank 1 was started with --group 64, rank 0 with --group 32: "
                      "every rank must run the same command"], [p.stderr[-2000:] for p in done]
    assert not dst.exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.e2e
def test_a_rank_reading_another_source_is_refused_before_any_work(demo_src, calib_text,
                                                                  tmp_path):
    """The same command line, but SRC (a relative path) names different models on the two
    ranks: the fingerprints differ, and the run stops before the calibration pass."""
    for rank, seed in ((0, 0), (1, 1)):
        make_tiny_model("llama", tmp_path / f"host{rank}" / "model", demo_src, seed=seed)
    dst = tmp_path / "out"
    args = ["gptq", "model", str(dst), "--calib", str(calib_text), *TINY_CALIB]
    done = _by_hand(args, args, tmp_path / "host0", tmp_path / "host1")
    assert all(p.returncode != 0 for p in done)
    errors = [e for p in done for e in _errors(p.stderr)]
    assert len(errors) == 1 and "rank 1 differs from rank 0 in the source model" in errors[0], (
        [p.stderr[-2000:] for p in done])
    assert not dst.exists() and not (tmp_path / ".out.partial").exists()


def test_nproc_inside_a_launched_rank_must_match(tiny, tmp_path, monkeypatch):
    """--nproc under torchrun is refused unless it agrees with the launch (one line, before
    joining the run)."""
    from click.testing import CliRunner

    from cpu_quant.cli import main

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    result = CliRunner().invoke(main, ["gptq", str(tiny), str(tmp_path / "out"), "--nproc", "3"])
    assert result.exit_code == 2
    assert _errors(result.stderr) == ["error: --nproc 3 in a process started as one of 2 ranks: "
                                      "--nproc starts the ranks itself; under torchrun leave it "
                                      "out"]


@pytest.mark.e2e
def test_more_ranks_than_batches_is_refused(tiny, calib_text, tmp_path):
    proc = _run([*CLI, "gptq", str(tiny), str(tmp_path / "out"), "--calib", str(calib_text),
                 *TINY_CALIB, "--samples", "2", "--nproc", "3"])
    assert proc.returncode == 2
    assert _errors(proc.stderr) == ["error: 3 ranks need at least 3 calibration batches, there "
                                    "are 1: raise --samples or lower --batch-size"]
