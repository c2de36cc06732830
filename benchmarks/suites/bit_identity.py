"""Suite ``bit_identity``: does this checkout write the same bytes as a reference revision?

The byte-identity acceptance of a refactoring (issue 42): on the demo model, one arm per
command (:data:`benchmarks.bit_identity.COMMANDS`),

``gptq``         ``cpu-quant gptq SRC DST --calib austen --no-eval`` (every other setting the
                 default; the calibration pinned to the Austen corpus, the default before the
                 mix, so that references from before and after that change run the same text)
``formats``      ``cpu-quant gptq SRC DST --calib austen --format gptq,cpu_int4,gguf --no-eval``
``tinygemm``     ``cpu-quant tinygemm SRC DST --calib austen --no-eval``
``phone-8da4w``  ``cpu-quant export-phone SRC DST --backend xnnpack --scheme 8da4w``

Each arm's **build** runs its command from the reference revision (``--reference REV``,
default ``HEAD``: ``git archive`` of it, unpacked once into the work directory); each **pass**
runs it from this checkout. Both go through the worker ``benchmarks/bit_identity.py``, which
records the sha256 of every tensor written (and of every GGUF and ExecuTorch file). Metric:
``differing``, the tensors and files that differ from the reference's or exist on one side
only (0: the same bytes). Extras: the counts, the combined digest and the first differing
names.

Smoke mode: the tiny smoke model and a calibration of 4 x 64 tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .. import bit_identity as worker
from ..harness import Arm, Command, HarnessError, Metric, PassContext, RunRecord, Suite
from .quantize import TIMEOUT_REAL, TIMEOUT_SMOKE, SuiteOptions, select, source_model

REPO = Path(__file__).resolve().parents[2]
DIFFERING = Metric("differing", "tensors", "lower", ratio=False)
SHOWN = 20  # differing names kept per pass


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()


def reference_tree(rev: str, workdir: Path) -> tuple[str, Path]:
    """The revision's commit and its files, unpacked (once) under ``workdir``."""
    try:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise HarnessError(f"--reference {rev!r} is not a commit of {REPO}") from None
    tree = workdir / f"reference-{sha[:12]}"
    if not (tree / "cpu_quant" / "__init__.py").is_file():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.Popen(["git", "archive", sha], cwd=REPO, stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise HarnessError(f"git archive {sha} failed")
    return sha, tree


def _worker(arm: str, tree: Path, src: Path, out: Path, smoke: bool, timeout: float) -> Command:
    return Command([sys.executable, "-m", "benchmarks.bit_identity", "--arm", arm, "--tree",
                    str(tree), "--src", str(src), "--out", str(out), "--json",
                    str(out / "digests.json"), *(["--smoke"] if smoke else [])],
                   cwd=str(REPO), timeout=timeout)


def _digests(directory: Path) -> dict:
    return json.loads((directory / "digests.json").read_text())


def reusable(bdir: Path, arm: str, tree: Path, src: Path, smoke: bool) -> bool:
    """Does ``bdir`` hold a finished build of this arm's command from this reference tree (the
    tree's directory names the revision)? Then its digests are reused: a build is the
    reference revision's output, the same whichever run made it."""
    path = bdir / "digests.json"
    if not path.is_file():
        return False
    done = json.loads(path.read_text())
    return (done.get("exit_status") == 0 and done.get("tree") == str(tree.resolve())
            and done.get("argv") == worker.command(arm, src.resolve(), bdir.resolve(), smoke,
                                                   tree))


def make_arm(name: str, ref_tree: Path, src: Path, smoke: bool) -> Arm:
    timeout = TIMEOUT_SMOKE if smoke else TIMEOUT_REAL

    def build(bdir: Path) -> Command:
        if reusable(bdir, name, ref_tree, src, smoke):
            return Command([sys.executable, "-c", "print('the reference digests of an earlier "
                            "build of the same command and revision, reused')"], timeout=60)
        return _worker(name, ref_tree, src, bdir, smoke, timeout)

    def command(ctx: PassContext) -> Command:
        return _worker(name, REPO, src, ctx.workdir, smoke, timeout)

    def diff(ctx: PassContext) -> dict:
        assert ctx.build_dir is not None
        return worker.differences(_digests(ctx.build_dir)["digests"],
                                  _digests(ctx.workdir)["digests"])

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        return {"differing": float(sum(len(v) for v in diff(ctx).values()))}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        assert ctx.build_dir is not None
        ref, now = _digests(ctx.build_dir), _digests(ctx.workdir)
        return {"digests": len(now["digests"]), "reference_digests": len(ref["digests"]),
                "digest": now["digest"], "reference_digest": ref["digest"],
                "command": now["argv"][3:],
                **{k: v[:SHOWN] for k, v in diff(ctx).items()}}

    return Arm(name, {"command": worker.COMMANDS[name], "smoke": smoke}, command, collect,
               build=build, extras=extras)


def build(opts: SuiteOptions) -> Suite:
    src = source_model(opts)
    rev = opts.reference or "HEAD"
    sha, tree = reference_tree(rev, opts.workdir)
    arms = select([make_arm(name, tree, src, opts.smoke) for name in worker.COMMANDS], opts.arms)
    return Suite(name="bit_identity", description="the bytes this checkout writes against a "
                 "reference revision's, per command", metrics=[DIFFERING], arms=arms,
                 settings={"source": str(src), "reference": rev, "reference_sha": sha,
                           "threads": os.cpu_count()},
                 baseline=None, inputs={"source": src})


def reference_of(doc: dict) -> dict:
    """``reference`` and ``reference_sha`` of a result file: from its settings (a complete file's
    provenance, a partial file's own), or, in a partial file written before partial files held
    them, from the reference tree its builds ran from (``reference-<sha>``)."""
    settings = (doc.get("provenance") or {}).get("settings") or doc.get("settings")
    if settings:
        return settings
    for build in doc.get("builds", {}).values():
        argv = build.get("argv") or []
        if "--tree" in argv:
            sha = Path(argv[argv.index("--tree") + 1]).name.removeprefix("reference-")
            return {"reference": sha, "reference_sha": sha}
    raise ValueError("the result file names no reference revision")


def _arm_cells(arm: str, doc: dict) -> list[str]:
    records = [r for r in doc["records"] if r["arm"] == arm]
    ok = [r for r in records if r["ok"]]
    if not records:
        return [f"`{arm}`", "—", "—", "not run (the run stopped before this arm's pass)"]
    if not ok:
        return [f"`{arm}`", "—", "—", f"failed ({len(records)} passes)"]
    first = ok[0]["extras"]
    same = all(r["metrics"]["differing"] == 0 for r in ok)
    verdict = "yes" if same else "no: " + ", ".join(
        f"`{n}`" for n in (first["differing"] + first["only_in_reference"]
                           + first["only_in_run"])[:3])
    return [f"`{arm}`", f"`cpu-quant {' '.join(first['command'][:1] + first['command'][3:])}`",
            str(first["digests"]), f"{verdict} ({len(ok)} of {len(records)} passes)"]


def render_legacy(results: Path, docs: Path) -> str:
    """Comparisons written by the earlier standalone script: two directories' tensors."""
    from ..render import machine

    lines = ["| comparison | tensors | differing | note | machine | result file |",
             "|---|---|---|---|---|---|"]
    for path in sorted(results.glob("bit-identity-*.json")):
        doc = json.loads(path.read_text())
        meta = machine({"provenance": doc["provenance"]})
        lines.append(f"| {doc['label']} | {doc['tensors_a']} | {len(doc['differing'])} | "
                     f"{' '.join(doc['notes'])} | {meta['cpu']} ({meta['isa']}) | "
                     f"[{path.name}]({os.path.relpath(path, docs)}) |")
    return "\n".join(lines)


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's comparison of every arm, and the
    comparisons of the earlier script's result files."""
    from ..render import machine, newest, partial_note

    path = newest(results, "bit_identity-2*.json")
    legacy = render_legacy(results, docs)
    if path is None:
        return ("No run of this suite is committed yet (command: `python -m benchmarks run "
                "bit_identity --reference REV`). Comparisons made with the earlier script "
                "(`cpu-quant` run from two checkouts, the outputs compared tensor by tensor):"
                "\n\n" + legacy)
    doc = json.loads(path.read_text())
    meta = machine(doc)
    s = reference_of(doc)
    lines = ["| arm | command | tensors and files | same bytes as the reference |",
             "|---|---|---|---|"]
    lines += ["| " + " | ".join(_arm_cells(arm, doc)) + " |" for arm in doc["arms"]]
    return "\n".join(lines + [
        "", f"Reference: git {s['reference_sha'][:7]} (`--reference {s['reference']}`); this "
        f"checkout: git {meta['sha'][:7]}{partial_note(doc)}. Machine: {meta['cpu']} "
        f"({meta['isa']}), "
        f"{meta['cores']} cores. Command: `python -m benchmarks run bit_identity --reference "
        f"{s['reference']}`. Result file: [{path.name}]({os.path.relpath(path, docs)}).", "",
        "Earlier comparisons (the standalone script's result files):", "", legacy])
