"""``python -m benchmarks``: run a suite, or draw the plots of its result files.

    python -m benchmarks run SUITE [--passes N] [--smoke] [--out DIR] [--workdir DIR]
                                   [--arms A,B] [--source CKPT] [--artifact ARM=DIR]
                                   [--reference REV]
    python -m benchmarks plot RESULT.json [RESULT.json ...] [--out DIR]
    python -m benchmarks tables RESULT.json [RESULT.json ...]
    python -m benchmarks render [--check]

Suites are the modules of ``benchmarks/suites/`` (each one's docstring says what it measures;
``python -m benchmarks run NAME`` with an unknown NAME lists them); the top-level modules of
``benchmarks/`` are the workers their passes run, the harness, and the renderer.
``render`` rewrites the results pages' tables that suites render from their newest result
files (``benchmarks/render.py``).

``run`` exits 0 when every pass succeeded, 1 when any pass failed (the result file is written
either way, failures included), 2 on a usage error. Suites are modules under
``benchmarks/suites/`` exposing ``build(SuiteOptions) -> Suite`` (or a list of suites, its
parts, each run and written in turn); their results go to
``benchmarks/results/`` and their work files (artifacts) to
``$XDG_CACHE_HOME/cpu-quant/bench-work/<suite>-<time>/`` unless ``--workdir`` says otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from cpu_quant.core.errors import CpuQuantError

from .harness import HarnessError, check_passes, run_suite
from .peers import gptqmodel_env

RESULTS = Path(__file__).resolve().parent / "results"


def _load_suite(name: str):
    try:
        return importlib.import_module(f"benchmarks.suites.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"benchmarks.suites.{name}":
            known = sorted(p.stem for p in (Path(__file__).parent / "suites").glob("*.py")
                           if not p.stem.startswith("_"))
            raise HarnessError(f"unknown suite {name!r}; known: {', '.join(known)}") from None
        raise


def _arm_path(text: str) -> tuple[str, Path]:
    arm, sep, path = text.partition("=")
    if not sep or not Path(path).is_dir():
        raise HarnessError(f"--artifact wants ARM=DIR with an existing DIR, got {text!r}")
    return arm, Path(path)


def cmd_run(args: argparse.Namespace) -> int:
    from .suites.quantize import SuiteOptions

    passes = args.passes if args.passes is not None else (1 if args.smoke else 3)
    check_passes(passes, args.smoke)  # before any work: a refused run must cost nothing
    module = _load_suite(args.suite)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    workdir = Path(args.workdir).resolve() if args.workdir else (
        gptqmodel_env.cache_root() / "bench-work" / f"{args.suite}-{stamp}")
    workdir.mkdir(parents=True, exist_ok=True)
    opts = SuiteOptions(smoke=args.smoke, workdir=workdir,
                        source=Path(args.source).resolve() if args.source else None,
                        arms=args.arms.split(",") if args.arms else None,
                        prebuilt=dict(_arm_path(a) for a in args.artifact),
                        reference=args.reference)
    built = module.build(opts)
    failed = 0
    for suite in built if isinstance(built, list) else [built]:  # a suite of parts: one run each
        result, _ = run_suite(suite, passes, args.smoke, Path(args.out), workdir)
        failed += result["failed_passes"]
    return 1 if failed else 0


def cmd_plot(args: argparse.Namespace) -> int:
    for path in plot_results([Path(p) for p in args.results], Path(args.out)):
        print(path)
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from .render import main as render_main

    return render_main(["--check"] if args.check else [])


def cmd_tables(args: argparse.Namespace) -> int:
    for p in args.results:
        print(markdown_table(Path(p), Path(args.relative_to)))
        print()
    return 0


# -- presenting results ------------------------------------------------------------------------
def _cell(st: dict, unit: str) -> str:
    if st["median"] is None:
        return f"failed ({st['failed']})"
    scale, suffix = (2**20, " MiB") if unit == "B" else (1, "")
    med, lo, hi = (st[k] / scale for k in ("median", "min", "max"))
    fmt = (lambda v: f"{v:.0f}") if unit == "B" else (lambda v: f"{v:.4g}")
    text = f"{fmt(med)}{suffix}"
    if st["n"] > 1:
        text += f" [{fmt(lo)}–{fmt(hi)}]"
    if st["failed"]:
        text += f" ({st['failed']} failed)"
    return text


def markdown_table(path: Path, relative_to: Path) -> str:
    """One markdown table per result: median [min–max] per arm and metric, ratio, verdict."""
    import json
    import os

    r = json.loads(path.read_text())
    link = os.path.relpath(path.resolve(), relative_to.resolve())
    metrics = r["metrics"]
    head = ["arm"] + [f"{m['name']} ({m['unit']}, {m['better']} better)" for m in metrics]
    lines = [f"Result file: [{path.name}]({link}) — {r['passes']} pass(es)"
             f"{', SMOKE' if r['smoke'] else ''}, baseline `{r['baseline']}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, per in r["summary"].items():
        cells = [f"`{arm}`"]
        for m in metrics:
            cell = _cell(per[m["name"]], m["unit"])
            cmp_ = r["comparisons"].get(arm, {}).get(m["name"])
            if cmp_ and cmp_["ratio_median"] is not None:
                cell += (f"<br>×{cmp_['ratio_median']:.3g} [{cmp_['ratio_min']:.3g}–"
                         f"{cmp_['ratio_max']:.3g}]")
                if r.get("baseline_of"):
                    cell += f" vs `{r['baseline_of'][arm]}`"
            if cmp_:
                cell += f"<br>{cmp_['verdict']}"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    for s in r["skipped_arms"]:
        lines.append(f"\nSkipped: `{s['arm']}`: {s['reason']}")
    return "\n".join(lines)


def _colors(arms: list[str]) -> list[str]:
    return ["#c44" if "gptqmodel" in a else "#48c" for a in arms]  # peer red, ours blue


def _plot_fidelity(r: dict, out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    arms = list(r["summary"])
    first = {a: next((rec for rec in r["records"] if rec["arm"] == a and rec["ok"]), None)
             for a in arms}
    bits = [first[a]["extras"].get("bits_per_weight") if first[a] else None for a in arms]
    labels = [f"{a}\n{b:.3f} bpw" if b else a for a, b in zip(arms, bits, strict=True)]
    fig, axes = plt.subplots(1, 3, figsize=(15, 0.6 * len(arms) + 1.6), sharey=True)
    panels = [("kl_mean", "KL(bf16 ‖ quant), nats (lower is better)"),
              ("top1_agreement", "top-1 agreement (higher is better)"),
              ("greedy_prefix_fraction", "greedy prefix reproduced (higher is better)")]
    for ax, (metric, title) in zip(axes, panels, strict=True):
        vals = [r["summary"][a][metric]["median"] or 0 for a in arms]
        ax.barh(range(len(arms)), vals, color=_colors(arms))
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
        if metric != "kl_mean":  # agreements sit near 1: show the differences
            ax.set_xlim(max(0.0, min(vals) - 0.1), 1.02)
        ax.set_title(title, fontsize=9)
        ax.set_yticks(range(len(arms)), labels, fontsize=8)
        ax.invert_yaxis()
    source = Path(r["provenance"]["settings"]["source"]).name
    fig.suptitle(f"Fidelity vs the bf16 source on held-out text ({source})", fontsize=10)
    fig.tight_layout()
    paths = [out / "fidelity_per_method.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for a in arms:
        snr = first[a]["extras"].get("per_layer_weight_snr_db") if first[a] else None
        if not snr:
            continue
        layers = sorted((int(k), v) for k, v in snr.items() if k.isdigit())
        ax.plot([x for x, _ in layers], [v for _, v in layers], marker=".", label=a,
                linestyle="--" if "gptqmodel" in a else "-")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("weight SNR, dB (higher = closer to bf16)")
    ax.set_title("Per-layer weight error of each artifact (unweighted; same dequantizer for all)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    paths.append(out / "per_layer_weight_snr.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _plot_quantize(r: dict, out: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    arms = list(r["summary"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.6 * len(arms) + 1.8))
    panels = [("wall_seconds", "wall time, s (lower is better)", 1),
              ("peak_rss_anon_bytes", "peak RssAnon of the process tree, MiB (lower is better)",
               2**20)]
    for ax, (metric, title, scale) in zip(axes, panels, strict=True):
        st = [r["summary"][a][metric] for a in arms]
        med = [(s["median"] or 0) / scale for s in st]
        err = [[(s["median"] - s["min"]) / scale if s["median"] else 0 for s in st],
               [(s["max"] - s["median"]) / scale if s["median"] else 0 for s in st]]
        ax.barh(range(len(arms)), med, xerr=err, capsize=4,
                color=_colors(arms))
        for i, v in enumerate(med):
            ax.text(v, i, f" {v:.0f}", va="bottom", fontsize=8)
        ax.set_yticks(range(len(arms)), arms, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
    fig.suptitle(f"Quantizing {r['provenance']['settings']['source'].split('/')[-1]}: median and "
                 f"range over {r['passes']} interleaved passes", fontsize=10)
    fig.tight_layout()
    path = out / "quantize_time_memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_results(results: list[Path], out: Path) -> list[Path]:
    """PNG plots for ``fidelity`` and ``quantize`` result files (matplotlib, Agg)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    loaded = [json.loads(p.read_text()) for p in results]
    fidelity = [r for r in loaded if r["suite"] == "fidelity"]
    if fidelity:
        paths += _plot_fidelity(_merge_fidelity(fidelity), out)
    for r in loaded:
        if r["suite"] == "quantize":
            paths += _plot_quantize(r, out)
    return paths


def _merge_fidelity(results: list[dict]) -> dict:
    """Several fidelity runs as one figure, their arms side by side; only runs with the same
    evaluation settings and source (the evaluation is deterministic) may be merged."""
    if len(results) == 1:
        return results[0]
    first = results[0]["provenance"]["settings"]
    for r in results[1:]:
        s = r["provenance"]["settings"]
        if (s["eval"], s["source"], r["smoke"]) != (first["eval"], first["source"],
                                                     results[0]["smoke"]):
            raise ValueError("fidelity results with different evaluation settings or sources "
                             "cannot share a plot")
    merged = dict(results[0], summary={}, records=[])
    for r in results:
        for arm, per in r["summary"].items():
            merged["summary"].setdefault(arm, per)
        merged["records"] += r["records"]
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one suite")
    run.add_argument("suite")
    run.add_argument("--passes", type=int, default=None,
                     help="passes over all arms (default 3; at least 3 unless --smoke)")
    run.add_argument("--smoke", action="store_true",
                     help="tiny settings, one pass by default, no verdicts (CI)")
    run.add_argument("--out", default=str(RESULTS), help="directory for the result JSON")
    run.add_argument("--workdir", default=None, help="directory for artifacts and inputs")
    run.add_argument("--arms", default=None,
                     help="comma-separated subset of the suite's arms (gguf: also its parts)")
    run.add_argument("--source", default=None, help="source checkpoint (default: demo model)")
    run.add_argument("--artifact", action="append", default=[], metavar="ARM=DIR",
                     help="use this already-built artifact for ARM instead of building it "
                          "(fidelity, runtime, phone, gguf; fidelity, phone and gguf check it "
                          "against the arm's settings)")
    run.add_argument("--reference", default=None, metavar="REV",
                     help="bit_identity: the git revision whose outputs each arm's are compared "
                          "with (default HEAD)")
    run.set_defaults(func=cmd_run)
    plot = sub.add_parser("plot", help="draw PNG plots from result files")
    plot.add_argument("results", nargs="+")
    plot.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "docs" / "img"))
    plot.set_defaults(func=cmd_plot)
    tables = sub.add_parser("tables", help="print markdown tables of result files")
    tables.add_argument("results", nargs="+")
    tables.add_argument("--relative-to", default=str(RESULTS.parent.parent / "docs"),
                        help="directory the links are relative to (default: docs/)")
    tables.set_defaults(func=cmd_tables)
    render = sub.add_parser("render", help="rewrite the results pages' rendered tables from the "
                                           "committed result files")
    render.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from its rendering")
    render.set_defaults(func=cmd_render)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (HarnessError, ValueError, CpuQuantError, gptqmodel_env.PeerInstallError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
