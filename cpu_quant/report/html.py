"""``report.html``: one self-contained page a person can look at, from ``quantization_report.json``.

Inline CSS and SVG only: no script, no font, no image and no link is fetched when the page is
viewed, so it opens offline and from a mail attachment. Sections: settings; bits per weight by
tensor; weighted SNR per layer and module; damping raised and group fallbacks; the head;
fidelity with error bars and the per-position KL histogram (from the eval's ``kl_histogram``);
timings per layer and peak memory per phase; provenance.
"""

from __future__ import annotations

import json
import math
import re
from html import escape
from pathlib import Path

from ..core.errors import CpuQuantError
from ..core.io.artifact import write_text_atomic

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;
max-width:1000px;color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f4f4f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
.muted{color:#666}svg{background:#fcfcfc;border:1px solid #eee;margin:.4em 0}
.legend span{display:inline-block;margin-right:1em}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px}
code{background:#f4f4f4;padding:0 3px}
"""


def _fmt(v: object, digits: int = 4) -> str:
    if isinstance(v, float):
        return "n/a" if not math.isfinite(v) else f"{v:.{digits}f}"
    return escape(str(v))


def _table(rows: list[tuple], header: tuple | None = None) -> str:
    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{escape(str(h))}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = []
        for c in row:
            cls = ' class="n"' if isinstance(c, int | float) else ""
            cells.append(f"<td{cls}>{_fmt(c, 3) if isinstance(c, float) else escape(str(c))}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "".join(out)


class Chart:
    """A minimal SVG plot: a frame, y ticks, and the caller's marks in data coordinates."""

    def __init__(self, width: int, height: int, x_range: tuple[float, float],
                 y_range: tuple[float, float], title: str, y_label: str = "") -> None:
        self.w, self.h = width, height
        self.left, self.right, self.top, self.bottom = 56, 12, 26, 34
        self.x0, self.x1 = x_range
        self.y0, self.y1 = y_range
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1
        self.parts = [f'<text x="{width / 2}" y="16" text-anchor="middle" font-weight="bold">'
                      f"{escape(title)}</text>"]
        if y_label:
            self.parts.append(f'<text x="12" y="{height / 2}" transform="rotate(-90 12 {height / 2})" '
                              f'text-anchor="middle" font-size="11">{escape(y_label)}</text>')
        self._axes()

    def x(self, v: float) -> float:
        return self.left + (v - self.x0) / (self.x1 - self.x0) * (self.w - self.left - self.right)

    def y(self, v: float) -> float:
        return self.h - self.bottom - (v - self.y0) / (self.y1 - self.y0) * (self.h - self.top - self.bottom)

    def _axes(self) -> None:
        for i in range(5):
            v = self.y0 + (self.y1 - self.y0) * i / 4
            yy = self.y(v)
            self.parts.append(f'<line x1="{self.left}" x2="{self.w - self.right}" y1="{yy:.1f}" '
                              f'y2="{yy:.1f}" stroke="#e5e5e5"/>')
            self.parts.append(f'<text x="{self.left - 4}" y="{yy + 4:.1f}" text-anchor="end" '
                              f'font-size="10">{v:.3g}</text>')
        self.parts.append(f'<rect x="{self.left}" y="{self.top}" width="{self.w - self.left - self.right}" '
                          f'height="{self.h - self.top - self.bottom}" fill="none" stroke="#999"/>')

    def x_label(self, v: float, text: str) -> None:
        self.parts.append(f'<text x="{self.x(v):.1f}" y="{self.h - self.bottom + 14}" '
                          f'text-anchor="middle" font-size="10">{escape(text)}</text>')

    def polyline(self, points: list[tuple[float, float]], color: str) -> None:
        pts = " ".join(f"{self.x(a):.1f},{self.y(b):.1f}" for a, b in points)
        self.parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        for a, b in points:
            self.parts.append(f'<circle cx="{self.x(a):.1f}" cy="{self.y(b):.1f}" r="2" fill="{color}"/>')

    def bar(self, x0: float, x1: float, value: float, color: str, tip: str = "") -> None:
        top, base = self.y(value), self.y(max(self.y0, 0))
        self.parts.append(f'<rect x="{self.x(x0):.1f}" y="{min(top, base):.1f}" '
                          f'width="{max(self.x(x1) - self.x(x0), 1):.1f}" height="{abs(base - top):.1f}" '
                          f'fill="{color}"><title>{escape(tip)}</title></rect>')

    def error_bar(self, xc: float, lo: float, hi: float) -> None:
        xx, a, b = self.x(xc), self.y(lo), self.y(hi)
        path = f"M{xx:.1f},{a:.1f}V{b:.1f}M{xx - 6:.1f},{a:.1f}h12M{xx - 6:.1f},{b:.1f}h12"
        self.parts.append(f'<path d="{path}" stroke="#000" stroke-width="1.2"/>')

    def svg(self) -> str:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.w}" height="{self.h}" '
                f'viewBox="0 0 {self.w} {self.h}" font-family="sans-serif">' + "".join(self.parts)
                + "</svg>")


_LAYER = re.compile(r"\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.experts\.\d+\.")


def _module_kind(name: str) -> tuple[int | None, str]:
    """(layer, the module's kind within it); every expert's projection is one kind."""
    m = _LAYER.search(name)
    return (int(m.group(1)), _EXPERT.sub(".experts.*.", m.group(2))) if m else (None, name)


def _bits(group: int, in_features: int, symmetric: bool) -> float:
    g = in_features if group in (-1, 0) else group
    return 4 + 16 / g + (0 if symmetric else 16 / g)


def _legend(names: list[str]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i class="sw" style="background:{PALETTE[i % len(PALETTE)]}"></i>{escape(n)}</span>'
        for i, n in enumerate(names)) + "</div>"


def snr_section(tensors: list[dict]) -> str:
    series: dict[str, list[tuple[float, float]]] = {}
    others = []
    for t in tensors:
        layer, kind = _module_kind(t["name"])
        if layer is None:
            others.append(t)
        else:
            series.setdefault(kind, []).append((layer, t["weighted_snr_db"]))
    if not series:
        return "<p class='muted'>No per-layer tensors in the report.</p>"
    vals = [v for pts in series.values() for _, v in pts]
    layers = [x for pts in series.values() for x, _ in pts]
    chart = Chart(960, 320, (min(layers), max(layers)), (math.floor(min(vals)) - 1, math.ceil(max(vals)) + 1),
                  "weighted SNR per layer and module", "dB")
    for i, (_kind, pts) in enumerate(sorted(series.items())):
        chart.polyline(sorted(pts), PALETTE[i % len(PALETTE)])
    for layer in range(min(layers), max(layers) + 1, max(1, (max(layers) - min(layers)) // 10 or 1)):
        chart.x_label(layer, str(layer))
    rows = [(kind, len(pts), min(v for _, v in pts), sorted(v for _, v in pts)[len(pts) // 2],
             max(v for _, v in pts)) for kind, pts in sorted(series.items())]
    rows += [(t["name"], 1, t["weighted_snr_db"], t["weighted_snr_db"], t["weighted_snr_db"]) for t in others]
    return (chart.svg() + _legend(sorted(series)) + "<p>The SNR is weighted by the Hessian diagonal "
            "(the calibration inputs' energy), in dB: higher is better.</p>"
            + _table(rows, ("module", "tensors", "min dB", "median dB", "max dB")))


def bits_section(report: dict) -> str:
    sym = report.get("settings", {}).get("symmetric", True)
    groups: dict[tuple[str, int], list[dict]] = {}
    for t in report.get("tensors", []):
        groups.setdefault((_module_kind(t["name"])[1], t["group_size"]), []).append(t)
    rows = []
    for (kind, g), ts in sorted(groups.items()):
        k = ts[0]["shape"][1] if len(ts[0]["shape"]) > 1 else 1
        weights = sum(math.prod(t["shape"]) for t in ts)
        rows.append((kind, len(ts), g, weights, _bits(g, k, sym)))
    head = (f"<p><b>{report.get('bits_per_weight', 0):.3f}</b> bits per quantized weight (4-bit codes, "
            f"a bf16 scale per group{'' if sym else ' and a bf16 zero'}), "
            f"<b>{report.get('bits_per_weight_on_disk', 0):.3f}</b> on disk. Tensors not listed "
            "(embedding, norms) stay bf16 (16 bits).</p>")
    return head + _table(rows, ("module", "tensors", "group", "weights", "bits/weight"))


def fallbacks_section(report: dict) -> str:
    group = report.get("settings", {}).get("group_size")
    raised = [(t["name"], "none factored" if t.get("damp") is None else t["damp"],
               t.get("gptq_fallback") or "float32")
              for t in report.get("tensors", []) if t.get("damp_raised")]
    fallback = [(t["name"], t["group_size"]) for t in report.get("tensors", [])
                if group not in (None, -1) and t["group_size"] != group]
    parts = [f"<p>Damping raised (the Cholesky factorisation failed at the requested damping) on "
             f"<b>{len(raised)}</b> tensor(s); a smaller group than {group} on <b>{len(fallback)}</b>.</p>"]
    if raised:
        # "rtn": no damping made the Hessian factor, even in float64 (gptq.prepare_hessian)
        parts.append(_table(raised, ("tensor", "damping used", "factored in")))
    if fallback:
        parts.append("<details><summary>group fallbacks</summary>"
                     + _table(fallback, ("tensor", "group")) + "</details>")
    notes = report.get("plan_notes", [])
    if notes:
        parts.append("<details><summary>plan notes</summary><ul>"
                     + "".join(f"<li>{escape(n)}</li>" for n in notes) + "</ul></details>")
    return "".join(parts)


def experts_section(experts: dict | None) -> str:
    """A mixture-of-experts run: each layer's routed tokens per expert, the experts that fell
    back from GPTQ, and what was kept (quantize/experts.py)."""
    if not experts:
        return "<p class='muted'>Not a mixture-of-experts model.</p>"
    rows = []
    for block, b in experts["blocks"].items():
        tokens = sorted(b["tokens"])
        rows.append((block, len(tokens), tokens[0], tokens[len(tokens) // 2], tokens[-1],
                     b["min_tokens"], len(b["fallback"]),
                     ", ".join(map(str, b["fallback"])) or "-"))
    return (f"<p><b>{experts['experts_fallback']}</b> of {experts['experts']} experts "
            f"({100 * experts['fallback_share']:.1f}%) fell back from GPTQ: "
            f"{escape(experts['fallback_rule'])}. Hessian: {escape(experts['hessian'])}. "
            f"Kept: {escape(experts['router'])}.</p>"
            + _table(rows, ("experts", "count", "min tokens", "median tokens", "max tokens",
                            "tokens needed", "fell back", "which")))


def head_section(report: dict) -> str:
    head = [t for t in report.get("tensors", []) if _module_kind(t["name"])[0] is None]
    rows = [("output head", "quantized" if report.get("head_quantized") else "bf16"),
            ("head seconds", report.get("head_seconds", 0.0))]
    rows += [(f"{t['name']} group / SNR dB", f"{t['group_size']} / {t['weighted_snr_db']:.2f}") for t in head]
    return _table(rows)


def vision_language_section(vl: dict | None) -> str:
    """A vision-language checkpoint: what was quantized, what was kept unquantized and why,
    and how it was calibrated."""
    if not vl:
        return ""
    rows = [(f"{k['prefix']}*", f"bf16, copied unchanged ({k['tensors']} tensors, "
             f"{k['parameters']:,} parameters)", k["why"]) for k in vl.get("kept", [])]
    return (f"<p>{escape(str(vl.get('family')))}: the language model's linears and the head "
            f"are quantized; calibration {escape(str(vl.get('calibration')))}.</p>"
            + _table(rows, ("modules", "stored", "why")))


def _err(d: dict, key: str) -> float:
    v = d.get(key)
    return v if isinstance(v, int | float) and math.isfinite(v) else 0.0


def fidelity_section(fidelity: dict | None) -> str:
    if not fidelity:
        return "<p class='muted'>Not measured (<code>--no-eval</code>); run <code>cpu-quant eval</code>.</p>"
    names = list(fidelity)
    rows = []
    for n in names:
        f = fidelity[n]
        rows.append((n, f"{_fmt(f.get('kl_mean', math.nan))} ± {_fmt(_err(f, 'kl_stderr'))}",
                     _fmt(f.get("kl_median", math.nan)), _fmt(f.get("kl_p99", math.nan)),
                     _fmt(f.get("kl_max", math.nan), 3),
                     f"{_fmt(f.get('ppl_quantized', math.nan), 2)} ± "
                     f"{_fmt(_err(f, 'ppl_quantized_stderr'), 2)}",
                     f"{f.get('ppl_delta', math.nan):+.3f} ± {_err(f, 'ppl_delta_stderr'):.3f}",
                     f"{_fmt(f.get('top1_agreement', math.nan), 3)} ± {_fmt(_err(f, 'top1_stderr'), 3)}",
                     f"{_fmt(f.get('greedy_prefix_fraction', math.nan), 3)} ({f.get('greedy_exact')} exact)"))
    first = fidelity[names[0]]
    parts = [f"<p>Against the bf16 source on held-out text: {first.get('tokens')} tokens, "
             f"{first.get('greedy_prompts')} greedy prompts; ± is one standard error (positions "
             f"treated as independent). bf16 perplexity {_fmt(first.get('ppl_reference', math.nan), 2)} "
             f"± {_fmt(_err(first, 'ppl_reference_stderr'), 2)}.</p>",
             _table(rows, ("variant", "KL mean", "KL median", "KL p99", "KL max", "perplexity",
                           "Δ perplexity", "same top-1", "greedy"))]
    hi = max(f.get("kl_mean", 0) + 2 * _err(f, "kl_stderr") for f in fidelity.values()) or 1.0
    chart = Chart(420, 240, (0, len(names)), (0, hi * 1.1), "mean KL ± 2 s.e.", "nats")
    for i, n in enumerate(names):
        f = fidelity[n]
        m, e = f.get("kl_mean", 0), _err(f, "kl_stderr")
        chart.bar(i + 0.2, i + 0.8, m, PALETTE[i], f"{n}: {m:.4f} ± {e:.4f}")
        chart.error_bar(i + 0.5, max(m - 2 * e, 0), m + 2 * e)
        chart.x_label(i + 0.5, n)
    parts.append(chart.svg())
    for i, n in enumerate(names):
        hist = fidelity[n].get("kl_histogram") or {}
        counts, edges = hist.get("counts"), hist.get("edges")
        if not counts:
            continue
        total = sum(counts) or 1
        hc = Chart(520, 240, (0, len(counts)), (0, max(counts) / total * 1.1),
                   f"per-position KL histogram ({n})", "fraction of positions")
        for j, c in enumerate(counts):
            upper = f"{edges[j + 1]:.1e}" if j + 1 < len(edges) else "∞"
            hc.bar(j + 0.05, j + 0.95, c / total, PALETTE[i], f"[{edges[j]:.1e}, {upper}): {c}")
        hc.x_label(0, "0")
        for j, edge in enumerate(edges):
            if edge > 0 and abs(math.log10(edge) - round(math.log10(edge))) < 1e-9:  # decades
                hc.x_label(j, f"1e{round(math.log10(edge))}")
        parts.append(hc.svg())
    return "".join(parts)


def timing_section(report: dict) -> str:
    secs = report.get("layer_seconds", [])
    parts = []
    if secs:
        chart = Chart(960, 240, (0, len(secs)), (0, max(secs) * 1.1), "seconds per layer", "s")
        for i, s in enumerate(secs):
            chart.bar(i + 0.1, i + 0.9, s, PALETTE[0], f"layer {i}: {s:.2f} s")
        for i in range(0, len(secs), max(1, len(secs) // 10)):
            chart.x_label(i + 0.5, str(i))
        parts.append(chart.svg())
    rows = [("total", report.get("total_seconds", 0.0), "")]
    rows += [(f"inside layers: {k}", v, "") for k, v in report.get("phase_seconds", {}).items()]
    for name, p in (report.get("phases") or {}).items():
        rows.append((f"CLI phase: {name}", p.get("seconds", 0.0), p.get("peak_rss_anon_mib", "")))
    parts.append(_table(rows, ("phase", "seconds", "peak RssAnon MiB")))
    return "".join(parts)


def render_report_html(report: dict, title: str) -> str:
    settings = report.get("settings", {})
    prov = dict(report.get("provenance", {}))
    if report.get("command_line"):
        prov["command_line"] = report["command_line"]
    sections = [
        ("Settings", _table(sorted(settings.items()), ("setting", "value"))
         + f"<p>Layout: <code>{escape(str(report.get('layout')))}</code>; calibration "
           f"{report.get('calibration_tokens', 0)} tokens.</p>"),
        ("Bits per weight", bits_section(report)),
        ("Weighted SNR", snr_section(report.get("tensors", []))),
        ("Damping and group fallbacks", fallbacks_section(report)),
        ("Experts", experts_section(report.get("experts"))),
        ("The head", head_section(report)),
        *([("Vision-language", vision_language_section(report["vision_language"]))]
          if report.get("vision_language") else []),
        ("Fidelity", fidelity_section(report.get("fidelity"))),
        ("Timings and memory", timing_section(report)),
        ("Provenance", _table(sorted((k, json.dumps(v) if isinstance(v, dict | list) else v)
                                     for k, v in prov.items()), ("field", "value"))),
    ]
    body = "".join(f"<h2>{escape(h)}</h2>{s}" for h, s in sections)
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width,initial-scale=1'>"
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{escape(title)}</h1><p class='muted'>cpu-quant quantization report, "
            f"{escape(str(prov.get('time', '')))}</p>{body}</body></html>\n")


def write_report_html(directory: Path) -> Path:
    """Render ``directory/quantization_report.json`` to ``directory/report.html`` (atomically)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CpuQuantError(f"{directory} is not a directory (give a cpu-quant artifact's)")
    src = directory / "quantization_report.json"
    try:
        report = json.loads(src.read_text())
    except FileNotFoundError:
        raise CpuQuantError(f"{directory} has no quantization_report.json (not a cpu-quant "
                            "artifact?)") from None
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json recurses
        raise CpuQuantError(f"{src}: not valid JSON") from None
    except OSError as exc:
        raise CpuQuantError(f"cannot read {src}: {exc.strerror or exc}") from None
    if not isinstance(report, dict):
        raise CpuQuantError(f"{src}: not a JSON object")
    try:
        page = render_report_html(report, directory.name)
    except (TypeError, KeyError, AttributeError, ValueError, IndexError) as exc:
        # a hand-edited or foreign report: one line naming what broke, not a traceback
        raise CpuQuantError(f"{src}: a value has an unexpected type or shape ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}); cannot render it") from None
    out = directory / "report.html"
    write_text_atomic(out, page)
    return out
