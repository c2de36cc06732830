"""Suite ``fidelity``: every method's artifact, evaluated against the bf16 source by one code path.

Each arm builds its artifact once (the harness' build step, recorded with its exit status,
time and peak RssAnon), then every pass runs ``cpu-quant eval ARTIFACT --reference SRC`` on the
held-out split of the built-in corpus (``cpu_quant.eval.fidelity``: never calibration text)
and reads its JSON. GPTQModel's artifact is a v1 GPTQ checkpoint (``checkpoint_format:
"gptq"``, ``qzeros`` words ``0x77777777``, fp16 scales) that ``cpu_quant.eval.dequantized``
reads like ours, so all arms go through the same dequantizer and the same evaluation.

The arms are the rows of ``ARMS`` (add a method by adding one row):

=========================  =======================================================================
``rtn``                    round-to-nearest, absmax scales, data-free (``--calib none``)
``rtn+search``             RTN with the weighted scale search (importance from calibration E[x²])
``gptq``                   GPTQ as cpu-quant runs it by default (smoothing folded in, act-order
                           with static groups, so ``g_idx`` stays trivial), head bf16
``gptq-natural-order``     GPTQ sweeping the columns in natural order (``--no-act-order``)
``gptq+head``              GPTQ with the output head quantized too, in groups of 32, the MLP's
                           down projections in groups of 64, and activation smoothing folded
                           into the weights first (cpu-quant's default)
``gptq+head-plain``        the default without smoothing, with the head and the down projections
                           in the run's group (``--no-smooth --head-group 128 --down-group
                           128``: the default before all three)
``gptq+head-down128``      the default with the down projections in the run's group
                           (``--down-group 128``)
``gptq+head-nosmooth``     the default without smoothing (``--no-smooth``)
``gptq+head-g128``         the default with the head in the run's group (``--head-group 128``)
``gptq+head+w4a8-hess``    the default with GPTQ's Hessians from int8-per-token activations
                           (``--w4a8-hessians``, as vLLM's W4A8 kernel sees them)
``tinygemm-asym``          ``cpu-quant tinygemm`` (asymmetric ``cpu_int4``), when the CLI has it
``gptqmodel``              GPTQModel 7.6.0, group 128 with cpu-quant's group-64 ``dynamic`` rules
``gptqmodel-g128-native``  GPTQModel 7.6.0, plain group 128 (a partial last group on K = 576)
``gptqmodel+head``         ``gptqmodel`` with the head quantized (``lm_head=True``) as cpu-quant's
                           default quantizes it: 4 bits, symmetric, groups of 32, by a ``dynamic``
                           rule (``quantize.head_dynamic``); on an untied copy of the source
=========================  =======================================================================

The ``gptq`` arms without ``+head`` and the first two peers keep the head bf16 (the comparison
with GPTQModel); the ``+head`` arms are what a user deploys, and ``gptqmodel+head`` is the peer
to compare them with. GPTQModel 7.6.0 refuses ``lm_head=True`` on a model whose head is tied to
its embedding (``looper/module_looper.py``, NotImplementedError), so that arm quantizes an untied
copy written to the run's ``inputs/`` (``quantize.untied_copy``: ``lm_head.weight`` a copy of
the embedding, ``tie_word_embeddings: false``; the same function) and is scored against the
tied source like every arm. Without its rule GPTQModel would make the head 8-bit (its own
default for a head), which the evaluator refuses. Calibration
is 128 × 512 tokens (smoke: 4 × 64) and evaluation ``EVAL_REAL`` (smoke: ``EVAL_SMOKE``).

``--artifact ARM=PATH`` evaluates an artifact built elsewhere (e.g. the last pass of the
``quantize`` suite) instead of building it: admitted only if its ``quantization_report.json``
(cpu-quant) or ``gptqmodel_run.json`` (GPTQModel: same calibration windows by sha256, same
groups, head and symmetry) matches the arm.

Every pass records the digest of the weights it scored (``records[].artifacts["artifact"]``,
also in ``provenance.artifacts`` as ``ARM/pass-N/artifact``): ``provenance.artifact_digest``
over the artifact's tensor files and ``config.json`` only, so it equals the digest the
``quantize`` suite recorded for the same weights, whichever run wrote their report.

Metrics: ``kl_mean`` (nats, lower), ``ppl_delta`` (quantized − reference perplexity, lower),
``top1_agreement`` (higher), ``greedy_prefix_fraction`` (higher), ``greedy_exact`` (prompts
reproduced exactly, higher), all with bf16/float activations (what ``cpu_gemm_wna16`` and
tinygemm compute); and ``kl_mean_w4a8``, ``top1_agreement_w4a8``: the same with every linear's
input quantized to int8 per token (``eval --w4a8``: vLLM's AMX W4A8 kernel, emulated). The
evaluation is deterministic, so the spread over passes is
expected to be 0: a non-zero spread would flag non-determinism. Extras per pass: perplexities,
bits per weight (``quantize.gptq_artifact_bits`` for every GPTQ artifact alike) and, once per
arm, the per-layer weight SNR of the dequantized artifact against the source.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..harness import Arm, Command, Metric, PassContext, RunRecord, Suite
from ..peers import gptqmodel_env
from . import quantize as q

# 16 x 512 scored positions per pass keep 8 arms x 3 passes within an hour on 2 cores
EVAL_REAL = {"windows": 16, "seqlen": 512, "prompts": 12, "new_tokens": 32}
EVAL_SMOKE = {"windows": 2, "seqlen": 64, "prompts": 2, "new_tokens": 4}

METRICS = [
    Metric("kl_mean", "nats", "lower"),
    Metric("ppl_delta", "ppl", "lower", ratio=False),
    Metric("top1_agreement", "fraction", "higher"),
    Metric("greedy_prefix_fraction", "fraction", "higher"),
    Metric("greedy_exact", "prompts", "higher"),
    Metric("kl_mean_w4a8", "nats", "lower"),
    Metric("top1_agreement_w4a8", "fraction", "higher"),
]
W4A8 = {"kl_mean_w4a8": "kl_mean", "top1_agreement_w4a8": "top1_agreement"}


@dataclass(frozen=True)
class FidelityArm:
    name: str
    description: str
    tool: str  # "cpu-quant" or "gptqmodel"
    subcommand: str = "gptq"  # cpu-quant only
    flags: tuple[str, ...] = ()  # cpu-quant only
    matched_groups: bool = True  # gptqmodel only: apply cpu-quant's group-64 dynamic rules
    head: bool = False  # gptqmodel only: quantize the head (lm_head=True) by head_dynamic's rule


NO_HEAD = "--no-lm-head"
ARMS: tuple[FidelityArm, ...] = (
    FidelityArm("rtn", "RTN, absmax scales, data-free", "cpu-quant",
                flags=("--method", "rtn", "--calib", "none", "--no-scale-search", NO_HEAD)),
    FidelityArm("rtn+search", "RTN + weighted scale search", "cpu-quant",
                flags=("--method", "rtn", NO_HEAD)),
    FidelityArm("gptq", "GPTQ, act-order + static groups (the default)", "cpu-quant",
                flags=("--method", "gptq", NO_HEAD)),
    FidelityArm("gptq-natural-order", "GPTQ, natural column order", "cpu-quant",
                flags=("--method", "gptq", "--no-act-order", NO_HEAD)),
    FidelityArm("gptq+head", "GPTQ, head quantized in groups of 32, smoothing folded in",
                "cpu-quant", flags=("--method", "gptq")),
    FidelityArm("gptq+head-plain", "GPTQ, head and down projections quantized in the run's "
                "group, no smoothing", "cpu-quant",
                flags=("--method", "gptq", "--no-smooth", "--head-group", "128",
                       "--down-group", "128")),
    FidelityArm("gptq+head-down128", "GPTQ, head in groups of 32, down projections in the "
                "run's group, smoothing folded in", "cpu-quant",
                flags=("--method", "gptq", "--down-group", "128")),
    FidelityArm("gptq+head-nosmooth", "GPTQ, head quantized in groups of 32, no smoothing",
                "cpu-quant", flags=("--method", "gptq", "--no-smooth")),
    FidelityArm("gptq+head-g128", "GPTQ, head quantized in the run's group, smoothing folded in",
                "cpu-quant", flags=("--method", "gptq", "--head-group", "128")),
    FidelityArm("gptq+head+w4a8-hess", "GPTQ, head quantized, Hessians of int8 activations",
                "cpu-quant", flags=("--method", "gptq", "--w4a8-hessians")),
    FidelityArm("tinygemm-asym", "tinygemm cpu_int4, asymmetric", "cpu-quant",
                subcommand="tinygemm", flags=(NO_HEAD,)),
    FidelityArm("gptqmodel", "GPTQModel 7.6.0, groups matched to cpu-quant", "gptqmodel"),
    FidelityArm("gptqmodel-g128-native", "GPTQModel 7.6.0, plain group 128", "gptqmodel",
                matched_groups=False),
    FidelityArm("gptqmodel+head", "GPTQModel 7.6.0, groups matched, head 4-bit in groups of 32",
                "gptqmodel", head=True),
)


def cli_commands() -> set[str]:
    from cpu_quant.cli import main

    return set(main.commands)


def eval_argv(artifact: Path, src: Path, ev: dict, out: Path) -> list[str]:
    return [*q.CLI, "eval", str(artifact), "--reference", str(src),
            "--windows", str(ev["windows"]), "--seqlen", str(ev["seqlen"]),
            "--prompts", str(ev["prompts"]), "--new-tokens", str(ev["new_tokens"]),
            "--w4a8", "--output-json", str(out)]


def read_fidelity(path: Path) -> dict:
    """The ``weights`` variant of an ``eval --output-json`` file."""
    return json.loads(path.read_text())["fidelity"]["weights"]


def artifact_bits(path: Path) -> float | None:
    try:
        return q.gptq_artifact_bits(path)["bits_per_weight"]
    except ValueError:  # not GPTQ: trust the tool's own report when it has one
        report = path / "quantization_report.json"
        return json.loads(report.read_text()).get("bits_per_weight") if report.is_file() else None


@functools.cache
def per_layer_weight_snr(artifact: str, source: str) -> dict[str, float]:
    """Weight SNR (dB) per decoder layer: 10·log10(Σ‖W‖² / Σ‖W − Ŵ‖²) over its quantized linears.

    Unweighted by activations, so it is a view of the weights, not of the outputs (GPTQ trades
    weight error for output error); the KL above is the measure that matters.
    """
    import re

    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.core.smoothing_factors import HEAD, load_factors, smoothed_source
    from cpu_quant.formats import format_for_quant_method

    qck, src = open_checkpoint(artifact), open_checkpoint(source)
    factors = load_factors(artifact)
    if factors is not None:  # the run quantized the source folded with these (gptq's default)
        src = smoothed_source(src, factors, artifact)
    qcfg = qck.config.get("quantization_config") or {}
    fmt = format_for_quant_method(qcfg["quant_method"])
    marker = fmt.marker
    sig: dict[str, float] = {}
    err: dict[str, float] = {}
    for name in qck.names:
        if not name.endswith("." + marker):
            continue
        module = name[: -len(marker) - 1]
        m = re.search(r"\.layers\.(\d+)\.", module)
        key = m.group(1) if m else module
        w_hat = fmt.dequantize(fmt.read_tensors(qck, module), qcfg).float()
        src_name = f"{module}.weight"
        if src_name not in src.files and module == "lm_head":
            src_name = "model.embed_tokens.weight"  # tied head
        folded_head = module == "lm_head" and factors is not None and HEAD in src.changed
        w = (src.head_tensor(src_name, HEAD) if folded_head else src.tensor(src_name)).float()
        sig[key] = sig.get(key, 0.0) + float((w * w).sum())
        err[key] = err.get(key, 0.0) + float(((w - w_hat) ** 2).sum())
    qck.close()
    src.close()
    return {k: round(10 * math.log10(sig[k] / err[k]), 3) if err[k] > 0 else math.inf
            for k in sorted(sig, key=lambda s: (not s.isdigit(), int(s) if s.isdigit() else 0))}


def collect_eval(ctx: PassContext, run: RunRecord) -> dict[str, float]:
    doc = json.loads((ctx.workdir / "fidelity.json").read_text())["fidelity"]
    w4a8 = doc["w4a8_emulated"]
    return {m.name: float(w4a8[W4A8[m.name]] if m.name in W4A8 else doc["weights"][m.name])
            for m in METRICS}


ArtifactOf = Callable[[PassContext], Path]


def artifact_resolver(prebuilt: Path | None) -> ArtifactOf:
    """Where an arm's artifact is: given on the command line, or made by its build step."""
    if prebuilt is not None:
        return lambda ctx: prebuilt
    return lambda ctx: ctx.build_dir / "artifact"


def eval_extras(src: Path, artifact_of: ArtifactOf):
    def extras(ctx: PassContext, run: RunRecord) -> dict:
        fid = read_fidelity(ctx.workdir / "fidelity.json")
        artifact = artifact_of(ctx)
        out = {"ppl_reference": fid["ppl_reference"], "ppl_quantized": fid["ppl_quantized"],
               "tokens": fid["tokens"], "bits_per_weight": artifact_bits(artifact),
               "eval_seconds": run.wall_seconds}
        if ctx.pass_index == 0:
            out["per_layer_weight_snr_db"] = per_layer_weight_snr(str(artifact), str(src))
            out["greedy_examples"] = fid.get("greedy_examples", [])[:2]
        return out
    return extras


def eval_command(src: Path, ev: dict, timeout: float, artifact_of: ArtifactOf,
                  verify: Callable[[Path], None]):
    def command(ctx: PassContext) -> Command:
        # before spending an evaluation: the artifact must be this arm's (a prebuilt one too)
        verify(artifact_of(ctx))
        argv = eval_argv(artifact_of(ctx), src, ev, ctx.workdir / "fidelity.json")
        return Command(argv, timeout=timeout)
    return command


def cpu_quant_fidelity_arm(spec: FidelityArm, src: Path, settings: dict, ev: dict,
                           timeout: float, prebuilt: Path | None = None) -> Arm:
    artifact_of = artifact_resolver(prebuilt)

    def build_cmd(bdir: Path) -> Command:
        argv = q.cpu_quant_gptq_argv(src, bdir / "artifact", settings, list(spec.flags))
        argv[len(q.CLI)] = spec.subcommand
        return Command(argv, timeout=timeout)

    def verify(artifact: Path) -> None:
        q.check_cpu_quant_report(artifact, settings, list(spec.flags))

    return Arm(spec.name, {"description": spec.description, "tool": "cpu-quant",
                           "command": spec.subcommand, "flags": list(spec.flags), **settings,
                           "eval": ev, "prebuilt": str(prebuilt) if prebuilt else None},
               eval_command(src, ev, timeout, artifact_of, verify), collect_eval,
               build=None if prebuilt else build_cmd,
               artifacts=lambda ctx: {"artifact": artifact_of(ctx)},
               extras=eval_extras(src, artifact_of))


@dataclass(frozen=True)
class PeerInputs:
    """What the GPTQModel arms are given: the calibration windows, cpu-quant's decoder groups as
    ``dynamic`` rules (``matched``) and, for an arm with ``head``, the head's rule
    (``quantize.head_dynamic``) and the untied copy of the source it quantizes."""
    windows: Path
    matched: dict
    head_rule: dict | None = None
    untied: Path | None = None

    def dynamic(self, spec: FidelityArm) -> dict | None:
        """The arm's rules, the head's first (the order cpu-quant writes them in)."""
        if spec.head and (self.head_rule is None or self.untied is None):
            raise ValueError(f"{spec.name}: the head's rule and the untied source are needed")
        rules = {**(self.head_rule if spec.head else {}),
                 **(self.matched if spec.matched_groups else {})}
        return rules or None

    def model(self, spec: FidelityArm, src: Path) -> Path:
        """The checkpoint GPTQModel quantizes for the arm."""
        return self.untied if spec.head and self.untied is not None else src


def check_gptqmodel_artifact(artifact: Path, windows: Path, settings: dict,
                             dynamic: dict | None, head: bool = False) -> None:
    """A GPTQModel artifact belongs to this arm: same windows (by hash), groups and head; a
    quantized head is checked in the tensors too (``check_gptqmodel_head``)."""
    from ..provenance import artifact_digest

    run = json.loads((artifact / "gptqmodel_run.json").read_text())
    spec = run["spec"]
    problems = []
    if artifact_digest(spec["windows"])["sha256"] != artifact_digest(windows)["sha256"]:
        problems.append("calibration windows differ")
    for key, want in (("group_size", settings["group"]), ("lm_head", head),
                      ("desc_act", False), ("sym", True), ("dynamic", dynamic)):
        if spec.get(key) != want:
            problems.append(f"{key} is {spec.get(key)!r}, the arm wants {want!r}")
    if head and not problems:
        problems += check_gptqmodel_head(artifact, dynamic or {}, settings["group"])
    if problems:
        raise ValueError(f"{artifact} is not this arm's artifact: " + "; ".join(problems))


def check_gptqmodel_head(artifact: Path, dynamic: dict, group: int) -> list[str]:
    """What is wrong with the head GPTQModel saved, against the rule the arm gave it (rule 3:
    a head left bf16, or made 8-bit by GPTQModel's own default, must not pass as 4-bit).

    Read from what is on disk: ``config.json`` (``lm_head: true``, the head untied, the rule in
    its ``dynamic``) and the head's tensors, whose shapes give its bits and its group
    (``qweight`` [K·bits/32, N], ``scales`` [K/g, N], K the hidden size)."""
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.core.naming import HEAD_NAME, group_for_module

    want_group = group_for_module(dynamic, HEAD_NAME, group)
    ckpt = open_checkpoint(artifact)
    try:
        qcfg = ckpt.config.get("quantization_config") or {}
        problems = []
        if qcfg.get("lm_head") is not True:
            problems.append(f"the saved config has lm_head {qcfg.get('lm_head')!r}")
        if ckpt.config.get("tie_word_embeddings") is not False:
            problems.append("the saved config does not untie the head")
        saved = qcfg.get("dynamic") or {}
        if any(saved.get(k) != v for k, v in dynamic.items()):
            problems.append(f"the saved dynamic rules {saved!r} are not the arm's {dynamic!r}")
        if f"{HEAD_NAME}.weight" in ckpt.names or f"{HEAD_NAME}.qweight" not in ckpt.names:
            return problems + [f"the head is not stored quantized ({HEAD_NAME}.qweight missing "
                               f"or {HEAD_NAME}.weight present)"]
        hidden = ckpt.shape("model.norm.weight")[0]
        rows, vocab = ckpt.shape(f"{HEAD_NAME}.qweight")
        groups = ckpt.shape(f"{HEAD_NAME}.scales")[0]
        bits, head_group = rows * 32 / hidden, hidden / groups
        if (bits, head_group) != (4, want_group):
            problems.append(f"the head is stored at {bits:g} bits in groups of {head_group:g}, "
                            f"the arm wants 4 bits in groups of {want_group}")
        return problems
    finally:
        ckpt.close()


def gptqmodel_fidelity_arm(spec: FidelityArm, src: Path, peer: PeerInputs, settings: dict,
                           ev: dict, timeout: float, prebuilt: Path | None = None) -> Arm:
    dyn = peer.dynamic(spec)
    model = peer.model(spec, src)
    artifact_of = artifact_resolver(prebuilt)

    def build_cmd(bdir: Path) -> Command:
        env = q.peer_env()
        spec_file = bdir / "spec.json"
        spec_file.write_text(json.dumps(q.gptqmodel_spec(model, bdir / "artifact", peer.windows,
                                                         settings, dyn, spec.head), indent=2))
        return Command([str(env.python), str(gptqmodel_env.RUNNER), str(spec_file)],
                       env=dict(q.GPTQMODEL_ENV), cwd=str(bdir), timeout=timeout)

    def verify(artifact: Path) -> None:
        check_gptqmodel_artifact(artifact, peer.windows, settings, dyn, spec.head)

    return Arm(spec.name, {"description": spec.description,
                           "tool": f"gptqmodel=={gptqmodel_env.GPTQMODEL_VERSION}",
                           "dynamic": dyn, "lm_head": spec.head, "quantized_model": str(model),
                           "env": q.GPTQMODEL_ENV, **settings, "eval": ev,
                           "prebuilt": str(prebuilt) if prebuilt else None},
               eval_command(src, ev, timeout, artifact_of, verify), collect_eval,
               build=None if prebuilt else build_cmd,
               artifacts=lambda ctx: {"artifact": artifact_of(ctx)},
               extras=eval_extras(src, artifact_of))


def _wanted(opts: q.SuiteOptions, spec: FidelityArm) -> bool:
    return not opts.arms or spec.name in opts.arms


def peer_inputs(opts: q.SuiteOptions, src: Path, windows: Path, group: int) -> PeerInputs:
    """The GPTQModel arms' inputs; the untied copy only when an arm that needs it will run."""
    matched = q.matched_dynamic(src, group)
    if not any(spec.head and _wanted(opts, spec) for spec in ARMS) or q.gptqmodel_skip(opts):
        return PeerInputs(windows, matched)
    return PeerInputs(windows, matched, q.head_dynamic(src, group),
                      q.untied_copy(src, opts.workdir / "inputs" / "untied_source"))


def build(opts: q.SuiteOptions) -> Suite:
    settings = dict(q.SMOKE if opts.smoke else q.REAL)
    ev = dict(EVAL_SMOKE if opts.smoke else EVAL_REAL)
    timeout = q.TIMEOUT_SMOKE if opts.smoke else q.TIMEOUT_REAL
    src = q.source_model(opts)
    windows = q.write_calibration_windows(src, settings,
                                          opts.workdir / "inputs" / "calibration_windows.json")
    if not opts.smoke and opts.install_peers:
        gptqmodel_env.install()  # no-op when present; a real run never skips the peer
    peer = peer_inputs(opts, src, windows, settings["group"])
    commands = cli_commands()
    notes = ["All arms are evaluated by `cpu-quant eval` (cpu_quant.eval.fidelity) on the "
             "held-out split; GPTQModel's v1 GPTQ checkpoints are read by the same dequantizer.",
             "rtn is data-free; every other cpu-quant arm and every GPTQModel arm calibrate on "
             "the same token windows."]
    skipped = []
    arms: list[Arm] = []
    prebuilt = {k: Path(v).resolve() for k, v in (opts.prebuilt or {}).items()}
    for spec in ARMS:
        if spec.tool == "cpu-quant":
            if spec.subcommand not in commands:
                notes.append(f"{spec.name}: not measured: cpu-quant has no "
                             f"`{spec.subcommand}` command at this commit")
                continue
            arms.append(cpu_quant_fidelity_arm(spec, src, settings, ev, timeout,
                                               prebuilt.pop(spec.name, None)))
        else:
            skip = q.gptqmodel_skip(opts)
            if skip:
                skipped.append(type(skip)(spec.name, skip.reason))
                continue
            if spec.head and peer.untied is None:
                continue  # not asked for: peer_inputs wrote no untied copy for it
            arms.append(gptqmodel_fidelity_arm(spec, src, peer, settings, ev, timeout,
                                               prebuilt.pop(spec.name, None)))
    if prebuilt:
        raise ValueError(f"--artifact names unknown arm(s): {', '.join(sorted(prebuilt))}")
    wanted = opts.arms
    arms = q.select(arms, [w for w in wanted if w not in {s.arm for s in skipped}]
                    if wanted else None)
    baseline = "gptqmodel" if any(a.name == "gptqmodel" for a in arms) else (
        arms[0].name if arms else None)
    return Suite(
        name="fidelity",
        description="KL, perplexity delta, top-1 agreement and greedy reproduction against the "
                    "bf16 source on held-out text, for each method, all through one evaluator",
        metrics=METRICS,
        arms=arms,
        settings={"source": str(src), **settings, "eval": ev, "matched_dynamic": peer.matched,
                  "head_dynamic": peer.head_rule},
        baseline=baseline,
        skipped=skipped,
        inputs={"source_model": src, "calibration_windows": windows,
                **({"untied_source": peer.untied} if peer.untied else {})},
        peers=q.peer_description(),
        notes=notes,
        keep_artifacts="last",
    )



# -- the results page ------------------------------------------------------------------------
# runs whose rows can share a table: the same calibration and evaluation
COMPARABLE = ("samples", "seqlen", "group", "batch_size", "calib", "eval")
FORMATS = {"kl_mean": ".4f", "ppl_delta": "+.3f", "top1_agreement": ".3f",
           "greedy_prefix_fraction": ".3f", "greedy_exact": ".0f", "kl_mean_w4a8": ".4f",
           "top1_agreement_w4a8": ".3f"}
LABELS = {"kl_mean": "KL (nats)", "ppl_delta": "ppl Δ", "top1_agreement": "top-1",
          "greedy_prefix_fraction": "greedy prefix", "greedy_exact": "greedy exact",
          "kl_mean_w4a8": "W4A8: KL", "top1_agreement_w4a8": "W4A8: top-1"}


def render(results: Path, docs: Path) -> str:
    """The results page's block: per CPU class, each current arm's newest comparable run."""
    from dataclasses import asdict

    from ..render import merged_block

    return merged_block(results, docs, "fidelity-2*.json",
                        "python -m benchmarks run fidelity [--arms ARM,...]", COMPARABLE,
                        [asdict(m) for m in METRICS], FORMATS, [a.name for a in ARMS], LABELS)
