"""The benchmark harness: runs a suite's arms as measured subprocesses and writes one result.

Rules it enforces (``shared/MEASURING.md``), each pinned by ``tests/test_bench_harness.py``:

* **Interleaving.** Every pass runs every arm once, in the suite's order rotated left by the
  pass index (pass 0: A B C, pass 1: B C A, pass 2: C A B, ...), so no arm always goes first.
* **Passes.** At least ``MIN_PASSES`` (3) unless ``smoke``; a smoke run is labelled as such and
  gives no verdicts.
* **Median and spread.** Per arm and metric: the values of the passes that succeeded, their
  median, and the spread ``max - min``.
* **Direction.** Every ``Metric`` declares ``better``: ``"higher"`` (rates, agreement) or
  ``"lower"`` (time, memory, divergence). "best" is the max for the former, the min for the
  latter; "worst" the opposite.
* **Verdict.** Against the suite's baseline arm: ``"no difference"`` when the medians differ by
  no more than the larger of the two spreads; otherwise which arm is better. Ratios
  ``arm / baseline`` are taken per pass (same pass = same machine conditions) and reported
  with their median and range. A suite whose arms fall into groups (one model each, say)
  names each arm's own baseline in ``baseline_of``.
* **Failures.** A pass whose command exits non-zero, times out, or whose output cannot be read
  is recorded with its exit status, error and the tail of its stderr, and counted; it is never
  dropped, and ``python -m benchmarks`` exits non-zero when any pass failed.
* **Provenance.** Every result carries ``provenance.collect(...)`` (git SHA, package versions,
  artifact paths and sha256, settings, threads, CPU model and flags), validated before writing.

Result file (JSON, ``<out>/<suite>[-smoke]-<UTC time>.json``, written atomically; while the
run goes on, ``<same name>.partial.json`` holds every pass recorded so far, with
``"complete": false``, and is removed when the full result is written)::

    {"suite", "complete", "description", "smoke", "passes", "baseline", "baseline_of",
     "metrics": [{name, unit, better, ratio}],
     "arms": {name: settings}, "skipped_arms": [{"arm", "reason"}], "notes": [...],
     "builds": {arm: RunRecord}, "records": [PassRecord, ...],
     "summary": {arm: {metric: Stats}}, "comparisons": {arm: {metric: Comparison}},
     "inputs": {label: digest}, "provenance": {...}}

Each arm's pass runs one subprocess (``Command``) whose wall time and peak ``RssAnon`` summed
over its process tree (``rss.TreeRssSampler``) the harness measures; the arm's ``collect``
turns the finished run into metric values (reading the files the command wrote).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cpu_quant.core.process import dies_with_this_process

from . import provenance
from .rss import DEFAULT_INTERVAL, TreeRssSampler

MIN_PASSES = 3
STDERR_TAIL = 4000
STDOUT_TAIL = 1000
BETTER = ("higher", "lower")
NO_DIFFERENCE = "no difference"
INSUFFICIENT = "insufficient passes"


class HarnessError(ValueError):
    """A benchmark asked for something the measuring rules forbid."""


# -- metrics ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    better: str  # "higher" for rates and agreement, "lower" for time, memory and error
    ratio: bool = True  # False for values that can be 0 or change sign (deltas): no B/A

    def __post_init__(self) -> None:
        if self.better not in BETTER:
            raise HarnessError(f"metric {self.name}: better must be 'higher' or 'lower'")

    def best(self, values: Sequence[float]) -> float:
        return max(values) if self.better == "higher" else min(values)

    def worst(self, values: Sequence[float]) -> float:
        return min(values) if self.better == "higher" else max(values)

    def is_better(self, a: float, b: float) -> bool:
        """True when ``a`` is strictly better than ``b``."""
        return a > b if self.better == "higher" else a < b


WALL_SECONDS = Metric("wall_seconds", "s", "lower")
# user + system CPU time of the process tree: steadier than wall time on a shared machine
CPU_SECONDS = Metric("cpu_seconds", "s", "lower")
PEAK_RSS_ANON = Metric("peak_rss_anon_bytes", "B", "lower")


# -- one measured subprocess ----------------------------------------------------------------
@dataclass
class Command:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the harness' environment
    cwd: str | None = None
    timeout: float | None = None


@dataclass
class RunRecord:
    argv: list[str]
    exit_status: int | None  # None: killed on timeout
    wall_seconds: float
    rss: dict
    stdout_tail: str
    stderr_tail: str
    cpu_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


def _read_tail(path: Path, n: int) -> str:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - n))
        text = fh.read().decode("utf-8", errors="replace")
    return text if size <= n else "..." + text


def run_measured(cmd: Command, rss_interval: float = DEFAULT_INTERVAL,
                 log_dir: Path | None = None) -> RunRecord:
    """Run ``cmd``; wall time, peak RssAnon of its process tree, exit status, output tails.

    The command's stdout and stderr go to ``log_dir/{stdout,stderr}.log`` (a temporary
    directory when None), so a long run can be followed with ``tail -f`` and a chatty tool
    cannot fill the harness' memory; the record keeps their tails.
    """
    import resource
    import tempfile

    env = {**os.environ, **cmd.env}
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as tmp:
        logs = Path(log_dir) if log_dir is not None else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        out_path, err_path = logs / "stdout.log", logs / "stderr.log"
        with open(out_path, "w") as out_fh, open(err_path, "w") as err_fh:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            # its own session (a timeout ends the whole tree) that dies with the harness: a
            # stopped benchmark leaves no build or measured run behind
            proc = subprocess.Popen(cmd.argv, cwd=cmd.cwd, env=env, stdout=out_fh,
                                    stderr=err_fh, start_new_session=True,
                                    preexec_fn=dies_with_this_process())
            sampler = TreeRssSampler(proc.pid, rss_interval).start()
            try:
                status: int | None = proc.wait(timeout=cmd.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # its own session: ends the whole tree it started
                proc.wait()
                status = None
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for tree, this run only
            sampler.stop()
        err = _read_tail(err_path, STDERR_TAIL)
        if status is None:
            err += f"\n[harness] killed after the {cmd.timeout} s timeout"
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return RunRecord(list(cmd.argv), status, round(wall, 3), sampler.as_dict(),
                         _read_tail(out_path, STDOUT_TAIL), err, round(cpu, 3))


# -- arms and suites --------------------------------------------------------------------------
@dataclass
class PassContext:
    arm: str
    pass_index: int
    position: int  # place of the arm within its pass (0 = first)
    workdir: Path  # private to this arm and pass
    build_dir: Path | None  # where the arm's one-off build put its output, if it has one
    smoke: bool


@dataclass
class Arm:
    name: str
    settings: dict
    command: Callable[[PassContext], Command]
    # metric values from a finished, successful run; raise to fail the pass
    collect: Callable[[PassContext, RunRecord], dict[str, float]]
    # one-off step before the passes (e.g. build the artifact that every pass evaluates)
    build: Callable[[Path], Command] | None = None
    # files to hash into the record after a successful pass: label -> path
    artifacts: Callable[[PassContext], dict[str, Path]] | None = None
    # informative values that are not compared (bits per weight, per-layer errors, ...)
    extras: Callable[[PassContext, RunRecord], dict] | None = None


@dataclass
class SkippedArm:
    arm: str
    reason: str


@dataclass
class Suite:
    name: str
    description: str
    metrics: list[Metric]
    arms: list[Arm]
    settings: dict
    baseline: str | None = None
    # arm -> the arm it is compared with, where not ``baseline`` (an arm mapped to itself is a
    # baseline: it gets no comparison)
    baseline_of: dict[str, str] = field(default_factory=dict)
    skipped: list[SkippedArm] = field(default_factory=list)
    inputs: dict[str, Path] = field(default_factory=dict)  # hashed into provenance
    peers: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    keep_artifacts: str = "last"  # "last": delete a pass's workdir once a later pass succeeded

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise HarnessError(f"suite {self.name} has no arm {name!r}")


@dataclass
class PassRecord:
    arm: str
    pass_index: int
    position: int
    ok: bool
    exit_status: int | None
    error: str | None
    wall_seconds: float | None
    cpu_seconds: float | None
    rss: dict
    metrics: dict[str, float]
    extras: dict
    artifacts: dict[str, dict]
    stderr_tail: str
    argv: list[str]


# -- the rules, as small pure functions --------------------------------------------------------
def check_passes(passes: int, smoke: bool) -> None:
    if passes < 1:
        raise HarnessError("--passes must be at least 1")
    if not smoke and passes < MIN_PASSES:
        raise HarnessError(f"a measurement needs at least {MIN_PASSES} passes (got {passes}); "
                           "use --smoke for a one-pass check of the machinery")


def rotated_order(names: Sequence[str], pass_index: int) -> list[str]:
    """The arms' order in pass ``pass_index``: the suite order rotated left by that index."""
    if not names:
        return []
    k = pass_index % len(names)
    return list(names[k:]) + list(names[:k])


def schedule(names: Sequence[str], passes: int) -> list[list[str]]:
    return [rotated_order(names, p) for p in range(passes)]


def spread(values: Sequence[float]) -> float:
    return max(values) - min(values) if values else math.nan


@dataclass
class Stats:
    n: int
    failed: int
    values: list[float | None]  # per pass, None where the pass failed
    median: float | None
    spread: float | None
    min: float | None
    max: float | None
    best: float | None
    worst: float | None


def stats(metric: Metric, per_pass: Sequence[float | None]) -> Stats:
    good = [v for v in per_pass if v is not None]
    failed = len(per_pass) - len(good)
    if not good:
        return Stats(0, failed, list(per_pass), None, None, None, None, None, None)
    return Stats(len(good), failed, list(per_pass), statistics.median(good), spread(good),
                 min(good), max(good), metric.best(good), metric.worst(good))


def verdict(metric: Metric, baseline: Sequence[float], other: Sequence[float],
            baseline_name: str = "baseline", other_name: str = "arm",
            min_passes: int = MIN_PASSES) -> str:
    """``"no difference"`` when the medians differ by no more than the larger spread."""
    if len(baseline) < min_passes or len(other) < min_passes:
        return f"{INSUFFICIENT} ({len(other)} and {len(baseline)} < {min_passes})"
    m_base, m_other = statistics.median(baseline), statistics.median(other)
    if abs(m_other - m_base) <= max(spread(baseline), spread(other)):
        return NO_DIFFERENCE
    winner = other_name if metric.is_better(m_other, m_base) else baseline_name
    return f"{winner} better ({metric.better} is better)"


def paired_ratios(baseline: Sequence[float | None], other: Sequence[float | None]) -> list[float]:
    """``other / baseline`` for every pass where both succeeded (same pass, same conditions)."""
    pairs = zip(baseline, other, strict=True)
    return [o / b for b, o in pairs if b is not None and o is not None and b != 0]


def compare(metric: Metric, baseline: Sequence[float | None], other: Sequence[float | None],
            baseline_name: str, other_name: str, min_passes: int = MIN_PASSES) -> dict:
    ratios = paired_ratios(baseline, other) if metric.ratio else []
    b = [v for v in baseline if v is not None]
    o = [v for v in other if v is not None]
    return {
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios) if ratios else None,
        "ratio_max": max(ratios) if ratios else None,
        "ratio_passes": len(ratios),
        "verdict": verdict(metric, b, o, baseline_name, other_name, min_passes),
    }


# -- running a suite ---------------------------------------------------------------------------
def _failed(arm: str, p: int, pos: int, status: int | None, error: str, run: RunRecord | None
            ) -> PassRecord:
    return PassRecord(arm, p, pos, False, status, error,
                      run.wall_seconds if run else None, run.cpu_seconds if run else None,
                      run.rss if run else {}, {}, {}, {},
                      run.stderr_tail if run else "", run.argv if run else [])


def run_pass(arm: Arm, ctx: PassContext, metric_names: set[str], rss_interval: float
             ) -> PassRecord:
    p, pos = ctx.pass_index, ctx.position
    try:
        cmd = arm.command(ctx)
    except Exception as exc:  # a suite bug or a missing input: still a recorded failure
        return _failed(arm.name, p, pos, None, f"could not build the command: {exc}", None)
    run = run_measured(cmd, rss_interval, log_dir=ctx.workdir)
    if not run.ok:
        why = "timed out" if run.exit_status is None else f"exit status {run.exit_status}"
        return _failed(arm.name, p, pos, run.exit_status, why, run)
    try:
        metrics = dict(arm.collect(ctx, run))
        metrics.setdefault(WALL_SECONDS.name, run.wall_seconds)
        metrics.setdefault(CPU_SECONDS.name, run.cpu_seconds)
        metrics.setdefault(PEAK_RSS_ANON.name, run.rss["peak_rss_anon_bytes"])
        missing = sorted(n for n in metric_names if n not in metrics)
        if missing:
            raise HarnessError(f"the run did not yield {', '.join(missing)}")
        extras = dict(arm.extras(ctx, run)) if arm.extras else {}
        extras["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        digests = {label: provenance.artifact_digest(path)
                   for label, path in (arm.artifacts(ctx) if arm.artifacts else {}).items()}
    except Exception as exc:
        return _failed(arm.name, p, pos, run.exit_status, f"output unreadable: {exc}", run)
    kept = {k: float(v) for k, v in metrics.items() if k in metric_names}
    return PassRecord(arm.name, p, pos, True, run.exit_status, None, run.wall_seconds,
                      run.cpu_seconds, run.rss, kept, extras, digests, run.stderr_tail, run.argv)


def summarize(metrics: Sequence[Metric], arm_names: Sequence[str], passes: int,
              records: Sequence[PassRecord]) -> dict[str, dict[str, Stats]]:
    out: dict[str, dict[str, Stats]] = {}
    for name in arm_names:
        per_pass: dict[int, PassRecord] = {r.pass_index: r for r in records if r.arm == name}
        out[name] = {}
        for m in metrics:
            vals = [per_pass[p].metrics.get(m.name) if p in per_pass and per_pass[p].ok else None
                    for p in range(passes)]
            out[name][m.name] = stats(m, vals)
    return out


def compare_all(metrics: Sequence[Metric], summary: dict[str, dict[str, Stats]],
                baseline: str | None, min_passes: int,
                baseline_of: dict[str, str] | None = None) -> dict[str, dict[str, dict]]:
    """Each arm against its baseline: ``baseline_of[arm]`` when given, else ``baseline``."""
    out: dict[str, dict[str, dict]] = {}
    for arm, per_metric in summary.items():
        base = (baseline_of or {}).get(arm, baseline)
        if base is None or base == arm or base not in summary:
            continue
        out[arm] = {m.name: compare(m, summary[base][m.name].values,
                                    per_metric[m.name].values, base, arm, min_passes)
                    for m in metrics}
    return out


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def write_result(out_dir: Path, name: str, doc: dict) -> Path:
    """Write ``doc`` to ``out_dir/<name>-<UTC time>.json`` atomically; return the path."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = out_dir / f"{name}-{stamp}.json"
    _write_json_atomic(path, doc)
    return path


def _cleanup_earlier(workdirs: dict[str, list[Path]], arm: str, keep: str) -> None:
    if keep != "last":
        return
    for old in workdirs[arm][:-1]:
        shutil.rmtree(old, ignore_errors=True)
    workdirs[arm] = workdirs[arm][-1:]


def run_suite(suite: Suite, passes: int, smoke: bool, out_dir: Path, workdir: Path,
              rss_interval: float = DEFAULT_INTERVAL,
              log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)
              ) -> tuple[dict, Path]:
    """Run every arm ``passes`` times, interleaved; write and return the result."""
    check_passes(passes, smoke)
    git_at_start = provenance.git_state()
    # a partial file is cited too: it names the machine it ran on from the first pass
    machine = {"cpu": provenance.cpu_info(), "threads": provenance.thread_settings()}
    if suite.skipped and not smoke:
        raise HarnessError("arms may only be skipped in a smoke run: "
                           + "; ".join(f"{s.arm}: {s.reason}" for s in suite.skipped))
    metric_names = {m.name for m in suite.metrics}
    names = [a.name for a in suite.arms]
    for s in suite.skipped:
        log(f"[{suite.name}] SKIPPED arm {s.arm}: {s.reason}")

    builds: dict[str, RunRecord] = {}
    build_dirs: dict[str, Path] = {}
    for arm in suite.arms:
        if arm.build is None:
            continue
        bdir = workdir / "build" / arm.name
        bdir.mkdir(parents=True, exist_ok=True)
        log(f"[{suite.name}] build {arm.name} ...")
        try:
            builds[arm.name] = run_measured(arm.build(bdir), rss_interval, log_dir=bdir)
        except Exception as exc:
            builds[arm.name] = RunRecord([], None, 0.0, {}, "", f"could not start: {exc}")
        build_dirs[arm.name] = bdir
        b = builds[arm.name]
        log(f"[{suite.name}] build {arm.name}: exit {b.exit_status} in {b.wall_seconds:.1f} s")

    records: list[PassRecord] = []
    workdirs: dict[str, list[Path]] = {n: [] for n in names}
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = out_dir / f"{suite.name}{'-smoke' if smoke else ''}-{stamp}.json"
    # a run cut short (a killed session, a crash) still leaves every pass it measured
    partial = path.with_name(path.stem + ".partial.json")
    for p, order in enumerate(schedule(names, passes)):
        for pos, name in enumerate(order):
            arm = suite.arm(name)
            build = builds.get(name)
            if build is not None and not build.ok:
                rec = _failed(name, p, pos, build.exit_status,
                              f"build failed (exit status {build.exit_status})", build)
            else:
                wd = workdir / f"pass-{p}" / name
                shutil.rmtree(wd, ignore_errors=True)
                wd.mkdir(parents=True)
                ctx = PassContext(name, p, pos, wd, build_dirs.get(name), smoke)
                rec = run_pass(arm, ctx, metric_names, rss_interval)
                if rec.ok:
                    workdirs[name].append(wd)
                    _cleanup_earlier(workdirs, name, suite.keep_artifacts)
            records.append(rec)
            _write_json_atomic(partial, {
                "suite": suite.name, "complete": False, "smoke": smoke, "passes": passes,
                "arms": {a.name: a.settings for a in suite.arms}, "settings": suite.settings,
                "git_at_start": git_at_start,
                "machine": machine, "builds": {k: asdict(v) for k, v in builds.items()},
                "records": [asdict(r) for r in records]})
            state = "ok" if rec.ok else f"FAILED ({rec.error})"
            log(f"[{suite.name}] pass {p + 1}/{passes} #{pos + 1} {name}: {state} "
                + " ".join(f"{k}={_fmt(v)}" for k, v in rec.metrics.items()))

    min_passes = MIN_PASSES
    summary = summarize(suite.metrics, names, passes, records)
    comparisons = compare_all(suite.metrics, summary, suite.baseline, min_passes,
                              suite.baseline_of)
    artifacts: dict[str, Path | dict] = dict(suite.inputs)
    for r in records:
        for label, digest in r.artifacts.items():
            artifacts[f"{r.arm}/pass-{r.pass_index}/{label}"] = digest
    settings = {**suite.settings, "passes": passes, "smoke": smoke,
                "rss_interval_s": rss_interval, "arms": {a.name: a.settings for a in suite.arms}}
    prov = provenance.collect(settings, artifacts, suite.peers)
    provenance.validate(prov)
    result = {
        "suite": suite.name,
        "complete": True,
        "description": suite.description,
        "smoke": smoke,
        "passes": passes,
        "baseline": suite.baseline,
        "baseline_of": dict(suite.baseline_of),
        "metrics": [asdict(m) for m in suite.metrics],
        "arms": {a.name: a.settings for a in suite.arms},
        "order": schedule(names, passes),
        "skipped_arms": [asdict(s) for s in suite.skipped],
        "notes": list(suite.notes),
        "builds": {k: asdict(v) for k, v in builds.items()},
        "records": [asdict(r) for r in records],
        "failed_passes": sum(not r.ok for r in records),
        "summary": {a: {m: asdict(s) for m, s in per.items()} for a, per in summary.items()},
        "comparisons": comparisons,
        "provenance": prov,
        "git_at_start": git_at_start,
    }
    if git_at_start != prov["git"]:
        result["notes"].append("the source tree changed during the run: compare git_at_start "
                               "with provenance.git")
    _write_json_atomic(path, result)
    partial.unlink(missing_ok=True)
    log(format_table(result))
    log(f"[{suite.name}] result: {path}")
    return result, path


# -- printing ----------------------------------------------------------------------------------
def _fmt(v: float | None, unit: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if unit == "B":
        return f"{v / 2**20:.0f}MiB"
    if abs(v) >= 100:
        return f"{v:.1f}"
    return f"{v:.4g}"


def format_table(result: dict) -> str:
    lines = [f"== {result['suite']}{' (SMOKE: one pass, no verdicts)' if result['smoke'] else ''}"
             f" — {result['passes']} passes, baseline {result['baseline']}"]
    for s in result["skipped_arms"]:
        lines.append(f"   SKIPPED {s['arm']}: {s['reason']}")
    for m in result["metrics"]:
        lines.append(f"-- {m['name']} [{m['unit']}], {m['better']} is better")
        for arm, per in result["summary"].items():
            st = per[m["name"]]
            cell = (f"median {_fmt(st['median'], m['unit'])} "
                    f"[{_fmt(st['min'], m['unit'])}..{_fmt(st['max'], m['unit'])}] "
                    f"best {_fmt(st['best'], m['unit'])} n={st['n']} failed={st['failed']}")
            cmp_ = result["comparisons"].get(arm, {}).get(m["name"])
            if cmp_:
                base = result.get("baseline_of", {}).get(arm, result["baseline"])
                cell += (f" | x{_fmt(cmp_['ratio_median'])} vs {base} "
                         f"[{_fmt(cmp_['ratio_min'])}..{_fmt(cmp_['ratio_max'])}]: "
                         f"{cmp_['verdict']}")
            lines.append(f"   {arm:<24} {cell}")
    if result["failed_passes"]:
        lines.append(f"!! {result['failed_passes']} failed pass(es): see records[].stderr_tail")
    return "\n".join(lines)
