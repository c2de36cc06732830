"""The ``README.md`` model card written into every artifact: how it was made, what it costs in
bits, how faithful it measured, how to serve it, and the licence carried from the source.

``write_model_card(directory, report, source, format_name)`` reads nothing but its arguments and
the source's ``README.md`` front matter and ``config.json`` (for the licence and base model);
it writes atomically (a temporary file renamed into place), so a reader never sees half a card.
The CLI calls it after a run for each output in ``report["outputs"]``, and again after the
fidelity check has updated ``quantization_report.json``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from .formats import get_format


def _front_matter(readme: Path) -> dict[str, str]:
    """The ``key: value`` lines of a README's YAML front matter (no YAML parser needed)."""
    try:
        text = readme.read_text(errors="replace")
    except OSError:
        return {}
    m = re.match(r"^---\s*\n(.*?)\n---\s*\n", text, re.S)
    if not m:
        return {}
    out = {}
    for line in m.group(1).splitlines():
        kv = re.match(r"^([A-Za-z_][\w-]*):\s*(.+?)\s*$", line)
        if kv:
            out[kv.group(1)] = kv.group(2).strip("'\"")
    return out


def source_licence(source: Path) -> tuple[str | None, str | None]:
    """``(licence, where it was found)`` from the source's README front matter or config."""
    meta = _front_matter(Path(source) / "README.md")
    if meta.get("license"):
        return meta["license"], "README.md front matter"
    try:
        config = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    for key in ("license", "licence"):
        if isinstance(config.get(key), str):
            return config[key], "config.json"
    return None, None


def _base_model(source: Path) -> str:
    from .hub import repo_id_of

    meta = _front_matter(Path(source) / "README.md")
    return meta.get("base_model") or repo_id_of(Path(source)) or Path(source).name


def _fidelity_lines(fidelity: dict | None) -> list[str]:
    if not fidelity:
        return ["Not measured (the run used `--no-eval`). Measure it with "
                "`cpu-quant eval DIR --reference SRC`."]
    w = fidelity.get("weights", fidelity)
    settings = w.get("settings", {})
    rows = [
        "Against the bf16 source on held-out text (never the calibration text), "
        f"{w.get('tokens')} tokens in {settings.get('windows')} windows of {settings.get('seqlen')}, "
        f"{w.get('greedy_prompts')} greedy prompts; ± is one standard error.",
        "",
        "| metric | value |", "|---|---|",
        f"| KL(bf16 ‖ quant), mean | {_pm(w, 'kl_mean', 'kl_stderr', 4)} |",
        f"| KL median / p99 / max | {_num(w.get('kl_median', float('nan')), 4)} / "
        f"{_num(w.get('kl_p99', float('nan')), 4)} / {_num(w.get('kl_max', float('nan')), 3)} |",
        f"| perplexity (bf16 → quant) | {_pm(w, 'ppl_reference', 'ppl_reference_stderr', 2)} → "
        f"{_pm(w, 'ppl_quantized', 'ppl_quantized_stderr', 2)} |",
        f"| same top-1 | {_pm(w, 'top1_agreement', 'top1_stderr', 3)} |",
        f"| greedy reproduction | {w.get('greedy_prefix_fraction', float('nan')):.3f} "
        f"({w.get('greedy_exact')} of {w.get('greedy_prompts')} exact) |",
    ]
    if "w4a8_emulated" in fidelity:
        a = fidelity["w4a8_emulated"]
        rows.append(f"| KL with int8 activations (W4A8, emulated) | {_pm(a, 'kl_mean', 'kl_stderr', 4)} |")
    return rows


def _num(v: float, digits: int) -> str:
    """Fixed digits, or three significant ones for a value too small for them (tiny KLs)."""
    return f"{v:.{digits}f}" if v == 0 or abs(v) >= 10 ** (2 - digits) else f"{v:.2e}"


def _pm(d: dict, key: str, err_key: str, digits: int) -> str:
    v, e = d.get(key), d.get(err_key)
    if v is None:
        return "n/a"
    if e is None or e != e:
        return _num(v, digits)
    return f"{_num(v, digits)} ± {_num(e, digits)}"


def _source_text(source: str) -> str:
    from .hub import repo_id_of

    repo = repo_id_of(Path(source))
    return f"`{repo}` (Hub cache, revision {Path(source).name})" if repo else f"`{source}`"


def _command(report: dict) -> str:
    cmd = report.get("command_line")
    if not cmd:
        return "(not recorded)"
    return cmd if isinstance(cmd, str) else shlex.join(cmd)


# Every QuantSettings field that can change a weight -> the card row that states it. A field
# missing from both tables still gets a row of its own (:func:`_setting_rows`), so a new
# setting never goes unstated.
SETTING_ROWS = {
    "method": "method", "scale_search": "method",
    "symmetric": "grid", "positive_scales": "grid",
    "group_size": "group size", "strict_group": "group size",
    "down_group": "MLP down projections",
    "quantize_head": "output head", "head_group": "output head",
    "smooth": "activation smoothing",
    "calib": "calibration", "samples": "calibration", "seqlen": "calibration",
    "batch_size": "calibration",  # the order of the Hessians' float32 sums
    "image_samples": "calibration", "images": "calibration",
    "act_order": "act-order (static groups)",
    "damp": "damping",
    "w4a8_hessians": "Hessians",
    "expert_min_tokens": "experts",
}
# QuantSettings fields that cannot change a weight, and why
NOT_WEIGHTS = {
    "offload_activations": "the activations wait on disk between layers: the same artifact",
}


def _used_groups(report: dict, match) -> list[int]:
    """The groups the run gave the tensors whose names ``match`` accepts (its report)."""
    return sorted({t["group_size"] for t in report.get("tensors") or []
                   if isinstance(t, dict) and match(str(t.get("name", "")))})


def _groups_text(used: list[int], requested) -> str:
    if used:
        return "groups of " + ", ".join("one scale per row" if g == -1 else str(g) for g in used)
    return f"groups of {requested}" if requested is not None else "as the group size"


def _experts_text(experts: dict | None, min_tokens, method) -> str:
    """A mixture-of-experts run's experts: how they were calibrated, how many fell back."""
    if not experts:
        return "none (a dense model)"
    if method != "gptq":
        return "round-to-nearest, as every linear; the router kept bf16"
    need = ("the widest input of their linears" if min_tokens is None
            else f"{min_tokens}")
    return (f"each calibrated on the tokens routed to it; {experts['experts_fallback']} of "
            f"{experts['experts']} received fewer than {need} and took round-to-nearest "
            "with the weighted scale search; the router kept bf16")


def _setting_rows(report: dict) -> list[str]:
    """The card's settings table: every setting that changed the weights, with the values the
    run used (the groups from its tensors, the smoothing from its record)."""
    from .core.naming import DOWN_LEAF, HEAD_NAME

    s = report.get("settings", {})
    from .data.mix import describe_calibration

    calib = describe_calibration(s.get("calib"))
    calibration = ("none (data-free)" if calib == "none" else
                   f"{calib}: {s.get('samples')} windows × {s.get('seqlen')} tokens "
                   f"({report.get('calibration_tokens', 0)} tokens) in batches of "
                   f"{s.get('batch_size')}")
    if s.get("image_samples"):
        calibration += (f"; {s['image_samples']} of the windows begin with an image ("
                        f"{s.get('images') or 'the built-in images'})")
    group = s.get("group_size")
    others = _used_groups(report, lambda n: n != HEAD_NAME and not n.endswith(DOWN_LEAF))
    head = _groups_text(_used_groups(report, lambda n: n == HEAD_NAME), s.get("head_group"))
    smoothing = report.get("smoothing")
    strengths = ", ".join(f"{a} in {n}" for a, n in ((smoothing or {}).get("alpha_counts")
                                                     or {}).items())
    rows = {
        "method": f"{s.get('method')}{'' if s.get('scale_search', True) else ' (no scale search)'}",
        "grid": ("symmetric" if s.get("symmetric", True)
                 else "asymmetric (scale and zero per group)")
        + (", scales >= 0" if s.get("positive_scales") else ""),
        "group size": f"{group}"
        + (f" (used: {', '.join(map(str, others))})" if others and others != [group] else "")
        + (", strict (a module it does not divide is refused)" if s.get("strict_group") else ""),
        "MLP down projections": _groups_text(
            _used_groups(report, lambda n: n.endswith(DOWN_LEAF)), s.get("down_group")),
        "output head": f"quantized, {head}" if report.get("head_quantized") else "bf16",
        "activation smoothing": (f"folded into the weights before quantization (strength per "
                                 f"fold: {strengths or 'recorded in the report'})"
                                 if smoothing else "none"),
        "calibration": calibration,
        "act-order (static groups)": f"{s.get('act_order')}",
        "damping": f"{s.get('damp')}",
        "Hessians": ("from the int8-per-token activations of vLLM's W4A8 kernel"
                     if s.get("w4a8_hessians") else "from the bf16 activations"),
        "experts": _experts_text(report.get("experts"), s.get("expert_min_tokens"),
                                 s.get("method")),
    }
    for key, value in s.items():  # a setting neither table knows: stated as it is
        if key not in SETTING_ROWS and key not in NOT_WEIGHTS:
            rows[key] = json.dumps(value)
    return [f"| {label} | {value} |" for label, value in rows.items()]


def model_card_text(directory: Path, report: dict, source: Path, format_name: str) -> str:
    settings = report.get("settings", {})
    prov = report.get("provenance", {})
    licence, where = source_licence(source)
    base = _base_model(source)
    name = Path(directory).name
    serving = get_format(format_name).serving(Path(directory))
    what, serve_cmd, serve_notes = serving.runtime, serving.command, list(serving.notes)
    lines = [
        "---",
        f"license: {licence or 'unknown'}",
        f"base_model: {base}",
        "tags: [quantized, 4-bit, cpu-quant, " + format_name + "]",
        "---",
        "",
        f"# {name}",
        "",
        f"A 4-bit `{format_name}` quantization of `{base}`, made by cpu-quant "
        f"{prov.get('cpu_quant', '')} (git {str(prov.get('git_sha') or 'unknown')[:12]}).",
        "",
        "## How it was made",
        "",
        "```text",
        _command(report),
        *([report["convert_command_line"]] if report.get("convert_command_line") else []),
        "```",
        *([f"Repacked bit-exactly from `{report['converted'].get('source')}` "
           f"({report['converted'].get('source_format')})."] if report.get("converted") else []),
        "",
        "| setting | value |", "|---|---|",
        *_setting_rows(report),
        f"| source | {_source_text(prov.get('source') or str(source))} |",
        f"| torch / transformers | {prov.get('torch')} / {prov.get('transformers')} |",
        "",
        "## Size",
        "",
        f"{report.get('bits_per_weight', 0):.3f} bits per quantized weight (codes + scales"
        f"{'' if settings.get('symmetric', True) else ' + zeros'}), "
        f"{report.get('bits_per_weight_on_disk', 0):.3f} on disk.",
        "",
        "## Fidelity",
        "",
        *_fidelity_lines(report.get("fidelity")),
        "",
        "## Serving it",
        "",
        f"With {what}:",
        "",
        "```bash",
        serve_cmd,
        "```",
        *(["", *serve_notes] if serve_notes else []),
        "",
        "`quantization_report.json` beside this card holds every tensor's weighted SNR, the "
        "timings and the provenance; `cpu-quant report DIR` renders it as `report.html`.",
        "",
        "## Licence",
        "",
        (f"`{licence}`, carried from the source's {where}." if licence else
         "The source declared no licence (no `license` in its README front matter or config); "
         "the quantized weights are bound by the source model's terms: check them before "
         "redistributing."),
        "",
    ]
    return "\n".join(lines)


def write_model_card(directory: Path, report: dict, source: Path, format_name: str) -> Path:
    """Write ``directory/README.md`` atomically; returns its path. A file artifact (GGUF)
    gets the card beside it, named ``<file>.README.md``."""
    directory = Path(directory)
    path = directory / "README.md" if directory.is_dir() else directory.with_name(
        directory.name + ".README.md")
    from .core.io.artifact import write_text_atomic

    write_text_atomic(path, model_card_text(directory, report, Path(source), format_name))
    return path
