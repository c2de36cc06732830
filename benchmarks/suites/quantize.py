"""Suite ``quantize``: wall time and peak RssAnon of quantizing the demo model.

Arms (interleaved by the harness, each pass a fresh process):

``cpu-quant-gptq``  ``cpu-quant gptq SRC DST --method gptq --group 128 --samples 128 --seqlen 512
                    --calib austen --no-lm-head --no-eval``
``cpu-quant-rtn``   the same with ``--method rtn`` (the scale search weighted by calibration E[x²])
``gptqmodel``       GPTQModel 7.6.0 (own venv, ``peers/gptqmodel_env.py``) on **exactly the same
                    token windows** (``cpu_quant.data.corpus.token_windows`` over the built-in
                    calibration split, written to ``calibration_windows.json`` and hashed into
                    the provenance): 4 bits, group 128, sym, ``desc_act`` off, ``lm_head`` off,
                    same batch size; every other knob at GPTQModel's default.

The baseline is ``gptqmodel``: ratios are ours / GPTQModel's, per pass.

**Groups that do not divide.** SmolLM2's hidden size is 576 = 4·128 + 64. GPTQModel 7.6.0 with
``group_size=128`` does not refuse: it quantizes ``ceil(576/128) = 5`` groups per row, the last
one only 64 columns wide (``g_idx = k // 128``, ``scales`` [5, N]). cpu-quant instead uses
group 64 on those modules (recorded in ``dynamic``), because vLLM's CPU kernels need the group
to divide the in-features. To compare like with like, the ``gptqmodel`` arm gets the very
``dynamic`` rules cpu-quant's plan writes (``cpu_quant.quantize.plan``), so both produce the
same groups and the same bits per weight. GPTQModel's own group-128 behaviour is measured as
a separate arm of the ``fidelity`` suite (``gptqmodel-g128-native``).

**Threads.** GPTQModel 7.6.0 crashes on a 2-CPU machine ("Virtual pool 'model_loader:cpu'
requests 2 workers but parent 'cpu' only has 1": it sizes its CPU pool as
``(cpu_count + 1) // 2`` but always asks 2 loader workers); the arm sets
``GPTQMODEL_CPU_WORKERS=2`` (its documented override), recorded in the arm's settings.

Metrics: ``wall_seconds`` (the whole process, imports included, as a user waits for it),
``cpu_seconds`` (user + system time of the process tree, steadier than wall time when the
machine is shared) and ``peak_rss_anon_bytes`` (summed over the process tree), all
lower-is-better. Each pass also
records, as extras, the tool's own phase times and the bits per weight of its artifact.

Smoke mode (CI) runs a tiny random Llama (hidden 64, so the same group-64 fallback applies)
with the demo tokenizer, 4 × 64 calibration tokens; the GPTQModel arm is skipped (visibly)
only when its venv is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..harness import (
    CPU_SECONDS,
    PEAK_RSS_ANON,
    WALL_SECONDS,
    Arm,
    Command,
    PassContext,
    RunRecord,
    SkippedArm,
    Suite,
)
from ..peers import gptqmodel_env
from ..render import harness_block

CLI = [sys.executable, "-m", "cpu_quant.cli"]
REAL = {"samples": 128, "seqlen": 512, "group": 128, "batch_size": 8, "calib": "austen"}
SMOKE = {"samples": 4, "seqlen": 64, "group": 128, "batch_size": 4, "calib": "austen"}
TIMEOUT_REAL = 3 * 3600
TIMEOUT_SMOKE = 600
# GPTQModel 7.6.0 sizes its CPU pool as (cpu_count+1)//2 but always asks for 2 loader workers
GPTQMODEL_ENV = {"GPTQMODEL_CPU_WORKERS": "2"}
SMOKE_MODEL_VERSION = 2


@dataclass
class SuiteOptions:
    smoke: bool
    workdir: Path
    source: Path | None = None  # None: the demo model (or the tiny smoke model)
    arms: list[str] | None = None  # None: every arm
    install_peers: bool = True  # real runs install GPTQModel's venv when it is missing
    prebuilt: dict[str, Path] | None = None  # arm -> artifact made elsewhere (fidelity only)
    reference: str | None = None  # a git revision to compare with (bit_identity)


# -- inputs shared by the suites -------------------------------------------------------------
def smoke_model(cache: Path) -> Path:
    """A tiny random Llama with the demo tokenizer (hidden 64: group 128 falls back to 64)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cpu_quant.models.demo import demo_model_path

    target = cache / f"bench-smoke-llama-v{SMOKE_MODEL_VERSION}"
    if (target / "config.json").is_file():
        return target
    demo = demo_model_path()
    tok = AutoTokenizer.from_pretrained(demo)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                      vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    return target


def source_model(opts: SuiteOptions) -> Path:
    if opts.source is not None:
        return opts.source
    if opts.smoke:
        return smoke_model(gptqmodel_env.cache_root())
    from cpu_quant.models.demo import demo_model_path

    return demo_model_path()


def write_calibration_windows(src: Path, settings: dict, path: Path) -> Path:
    """The exact token windows ``cpu-quant gptq --calib`` uses, for the peer to read."""
    from transformers import AutoTokenizer

    from cpu_quant.data.corpus import load_texts, token_windows

    tok = AutoTokenizer.from_pretrained(src)
    windows = token_windows(tok, load_texts(settings["calib"], "calibration"),
                            settings["samples"], settings["seqlen"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(windows))
    return path


def untied_copy(src: Path, dst: Path) -> Path:
    """``src`` with its head written out: ``lm_head.weight`` a copy of the embedding and
    ``tie_word_embeddings: false``. The same function as ``src`` (the same logits), in the
    form GPTQModel 7.6.0 agrees to quantize the head of (it refuses a tied one). A source whose
    head is already untied is returned as it is."""
    from cpu_quant.core.io.artifact import copy_tokenizer_files, write_json_atomic
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.core.io.safetensors_writer import write_safetensors
    from cpu_quant.formats.safetensors import untie_head

    ckpt = open_checkpoint(src)
    if "lm_head.weight" in ckpt.names and ckpt.config.get("tie_word_embeddings") is not True:
        ckpt.close()
        return src
    embeddings = [n for n in ckpt.names if n.endswith("embed_tokens.weight")]
    if len(embeddings) != 1:
        raise ValueError(f"{src}: cannot tell the tied embedding among {embeddings}")
    tensors = {n: ckpt.tensor(n) for n in ckpt.names}
    tensors["lm_head.weight"] = tensors[embeddings[0]].clone()
    config = dict(ckpt.config)
    untie_head(config)
    ckpt.close()
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_safetensors(staging / "model.safetensors", tensors)
    write_json_atomic(staging / "config.json", config)
    copy_tokenizer_files(src, staging)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(staging, dst)
    return dst


def matched_dynamic(src: Path, group: int) -> dict:
    """The ``dynamic`` rules cpu-quant's default calibrated run of ``--group GROUP`` gives this
    model's decoder linears (head excluded): the down projections' own group included."""
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.formats import get_format
    from cpu_quant.quantize.plan import dynamic_overrides, linear_group, plan_linear
    from cpu_quant.quantize.settings import QuantSettings

    limits = get_format("gptq").limits
    settings = QuantSettings(group_size=group)
    ckpt = open_checkpoint(src)
    plans = []
    for name in ckpt.names:
        if ".layers." in name and name.endswith("_proj.weight") and len(ckpt.shape(name)) == 2:
            out_f, in_f = ckpt.shape(name)
            module = name[: -len(".weight")]
            requested, flag = linear_group(module, settings, limits)
            plans.append(plan_linear(module, in_f, out_f, requested, False, limits, flag=flag))
    ckpt.close()
    return dynamic_overrides([p for p in plans if p.quantize or p.reason], group)


def head_dynamic(src: Path, group: int) -> dict:
    """The ``dynamic`` rule that quantizes the head as cpu-quant's default run of ``--group
    GROUP`` does: 4 bits, symmetric, in the group ``plan.head_group`` picks (``HEAD_GROUP``, 32,
    on the demo model), under the key cpu-quant writes (``+:(?:lm_head)$``).

    Bits and symmetry are stated, not left to the top level: GPTQModel 7.6.0 gives a head that
    no ``dynamic`` rule matches its own 8-bit group-32 config (``looper/module_looper.py``,
    ``lm_head_quant_config``, applied when ``dynamic_get(lm_head) is None``)."""
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.core.naming import HEAD_NAME
    from cpu_quant.formats import get_format
    from cpu_quant.quantize.plan import dynamic_overrides, head_group, plan_linear
    from cpu_quant.quantize.settings import QuantSettings

    limits = get_format("gptq").limits
    ckpt = open_checkpoint(src)
    name = f"{HEAD_NAME}.weight"
    if name not in ckpt.names:
        name = next(n for n in ckpt.names if n.endswith("embed_tokens.weight"))  # tied
    vocab, hidden = ckpt.shape(name)
    ckpt.close()
    g, flag = head_group(QuantSettings(group_size=group), hidden, limits)
    plan = plan_linear(HEAD_NAME, hidden, vocab, g, False, limits, flag=flag)
    if not plan.quantize:
        raise ValueError(f"{src}: cpu-quant keeps this head bf16 ({plan.reason})")
    # default group 0 matches no plan: the rule is written even when the head's group is GROUP
    (pattern, rule), = dynamic_overrides([plan], default_group=0).items()
    return {pattern: {"bits": 4, "group_size": rule["group_size"], "sym": True,
                      "desc_act": False}}


def gptq_artifact_bits(path: Path) -> dict:
    """Bits per weight of a GPTQ artifact from its safetensors headers, the same way for all.

    Codes count 4 bits; scales their stored width; zeros only when the config says asymmetric
    (a symmetric checkpoint's ``qzeros`` are a constant, not information). Layers kept in
    float are not counted: this is the bits per *quantized* weight.
    """
    from cpu_quant.core.io.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path)
    qcfg = ckpt.config.get("quantization_config") or {}
    if qcfg.get("quant_method") != "gptq":
        ckpt.close()
        raise ValueError(f"{path}: not a GPTQ checkpoint ({qcfg.get('quant_method')})")
    width = {"BF16": 16, "F16": 16, "F32": 32}
    n_weights = bits = 0
    scale_dtypes: set[str] = set()
    groups_per_row: dict[str, int] = {}  # "in_features/groups" -> modules, e.g. "576/9"
    for name in ckpt.names:
        if not name.endswith(".qweight"):
            continue
        module = name[: -len(".qweight")]
        kp, n = ckpt.shape(name)
        k = kp * 8
        g_rows = ckpt.shape(f"{module}.scales")[0]
        dtype = ckpt.dtype(f"{module}.scales")
        scale_dtypes.add(dtype)
        n_weights += n * k
        bits += 4 * n * k + width[dtype] * g_rows * n
        if not qcfg.get("sym", True):
            bits += 4 * g_rows * n
        key = f"{k}/{g_rows}"
        groups_per_row[key] = groups_per_row.get(key, 0) + 1
    head = any(n.startswith("lm_head.") and n.endswith(".qweight") for n in ckpt.names)
    ckpt.close()
    return {"bits_per_weight": round(bits / max(n_weights, 1), 4), "quantized_weights": n_weights,
            "head_quantized": head, "checkpoint_format": qcfg.get("checkpoint_format"),
            "sym": qcfg.get("sym"), "scales_dtypes": sorted(scale_dtypes),
            "groups_per_row": groups_per_row}


# -- arms ----------------------------------------------------------------------------------
def cpu_quant_gptq_argv(src: Path, dst: Path, settings: dict, flags: list[str]) -> list[str]:
    return [*CLI, "gptq", str(src), str(dst), "--group", str(settings["group"]),
            "--samples", str(settings["samples"]), "--seqlen", str(settings["seqlen"]),
            "--batch-size", str(settings["batch_size"]), "--calib", settings["calib"],
            "--no-eval", "--overwrite", *flags]


def check_cpu_quant_report(dst: Path, settings: dict, flags: list[str]) -> dict:
    """Read ``quantization_report.json`` (``dst`` itself when it is the report file) and check
    the knobs reached the pipeline (rule 4)."""
    path = dst if dst.is_file() else dst / "quantization_report.json"
    report = json.loads(path.read_text())
    s = report["settings"]
    calibrated = "none" not in flags
    problems = []
    if calibrated and report["calibration_tokens"] != settings["samples"] * settings["seqlen"]:
        problems.append(f"calibration_tokens {report['calibration_tokens']} != "
                        f"{settings['samples']}x{settings['seqlen']}")
    if report["head_quantized"] == ("--no-lm-head" in flags):
        problems.append(f"head_quantized is {report['head_quantized']} with flags {flags}")
    if s["group_size"] != settings["group"]:
        problems.append(f"group {s['group_size']} != {settings['group']}")
    if s["act_order"] == ("--no-act-order" in flags):
        problems.append(f"act_order {s['act_order']} with flags {flags}")
    calib = flags[flags.index("--calib") + 1] if "--calib" in flags else settings["calib"]
    if str(s["calib"] or "austen") != calib:
        problems.append(f"calibration {s['calib']!r} != {calib!r}")
    method = flags[flags.index("--method") + 1] if "--method" in flags else "gptq"
    if s["method"] != method:
        problems.append(f"method {s['method']} != {method}")
    if s["scale_search"] == ("--no-scale-search" in flags):
        problems.append(f"scale_search {s['scale_search']} with flags {flags}")
    if s.get("w4a8_hessians", False) != ("--w4a8-hessians" in flags):
        problems.append(f"w4a8_hessians {s.get('w4a8_hessians')} with flags {flags}")
    # gptq's default folds smoothing for calibrated GPTQ on the symmetric grid of a model it
    # can fold (the plan's notes say when the model is why not)
    unfoldable = any(n.startswith("activation smoothing not folded")
                     for n in report.get("plan_notes", []))
    default_smooth = (method == "gptq" and calibrated and s.get("symmetric", True)
                      and not unfoldable)
    want_smooth = "--smooth" in flags or ("--no-smooth" not in flags and default_smooth)
    if s.get("smooth", False) != want_smooth:
        problems.append(f"smooth {s.get('smooth')} with flags {flags}")
    head_group = int(flags[flags.index("--head-group") + 1]) if "--head-group" in flags else None
    if s.get("head_group") != head_group:
        problems.append(f"head_group {s.get('head_group')} != {head_group}")
    down_group = int(flags[flags.index("--down-group") + 1]) if "--down-group" in flags else None
    if s.get("down_group") != down_group:
        problems.append(f"down_group {s.get('down_group')} != {down_group}")
    if problems:
        raise ValueError("settings did not reach the pipeline: " + "; ".join(problems))
    return report


def cpu_quant_arm(name: str, method: str, src: Path, settings: dict, timeout: float) -> Arm:
    flags = ["--method", method, "--no-lm-head"]

    def command(ctx: PassContext) -> Command:
        return Command(cpu_quant_gptq_argv(src, ctx.workdir / "artifact", settings, flags),
                       timeout=timeout)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        check_cpu_quant_report(ctx.workdir / "artifact", settings, flags)
        return {}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        report = json.loads((ctx.workdir / "artifact" / "quantization_report.json").read_text())
        return {"tool_total_seconds": report["total_seconds"],
                "tool_head_seconds": report["head_seconds"],
                "layer_seconds_sum": round(sum(report["layer_seconds"]), 3),
                "bits_per_weight": gptq_artifact_bits(ctx.workdir / "artifact")["bits_per_weight"]}

    return Arm(name, {"tool": "cpu-quant", "method": method, "flags": flags, **settings},
               command, collect, artifacts=lambda ctx: {"artifact": ctx.workdir / "artifact"},
               extras=extras)


def gptqmodel_spec(src: Path, dst: Path, windows: Path, settings: dict, dynamic: dict | None,
                   lm_head: bool = False) -> dict:
    return {"model": str(src), "out": str(dst), "windows": str(windows), "bits": 4,
            "group_size": settings["group"], "sym": True, "desc_act": False, "lm_head": lm_head,
            "dynamic": dynamic, "batch_size": settings["batch_size"]}


def gptqmodel_arm(name: str, src: Path, windows: Path, settings: dict, dynamic: dict | None,
                  timeout: float) -> Arm:
    def command(ctx: PassContext) -> Command:
        dst = ctx.workdir / "artifact"
        spec = ctx.workdir / "spec.json"
        spec.write_text(json.dumps(gptqmodel_spec(src, dst, windows, settings, dynamic), indent=2))
        # cwd: GPTQModel writes a logs/ directory into its working directory
        return Command([str(peer_env().python), str(gptqmodel_env.RUNNER), str(spec)],
                       env=dict(GPTQMODEL_ENV), cwd=str(ctx.workdir), timeout=timeout)

    def collect(ctx: PassContext, run: RunRecord) -> dict[str, float]:
        saved = json.loads((ctx.workdir / "artifact" / "gptqmodel_run.json").read_text())
        if saved["samples"] != settings["samples"] or saved["seqlen"] != settings["seqlen"]:
            raise ValueError(f"GPTQModel saw {saved['samples']}x{saved['seqlen']} tokens")
        q = saved["saved_quantization_config"]
        if q.get("lm_head") or q.get("desc_act") or q.get("group_size") != settings["group"]:
            raise ValueError(f"GPTQModel saved an unexpected config: {q}")
        return {}

    def extras(ctx: PassContext, run: RunRecord) -> dict:
        saved = json.loads((ctx.workdir / "artifact" / "gptqmodel_run.json").read_text())
        return {"tool_seconds": saved["seconds"],
                "bits_per_weight": gptq_artifact_bits(ctx.workdir / "artifact")["bits_per_weight"],
                "gptqmodel_meta": saved["saved_quantization_config"].get("meta", {})}

    return Arm(name, {"tool": f"gptqmodel=={gptqmodel_env.GPTQMODEL_VERSION}",
                      "venv": str(gptqmodel_env.venv_dir()), "env": GPTQMODEL_ENV,
                      "dynamic": dynamic, "other_knobs": "GPTQModel defaults", **settings},
               command, collect,
               artifacts=lambda ctx: {"artifact": ctx.workdir / "artifact"}, extras=extras)


def peer_env() -> gptqmodel_env.PeerEnv:
    env = gptqmodel_env.ready_env()
    if env is None:
        raise RuntimeError("the GPTQModel venv is not installed "
                           "(python -m benchmarks.peers.gptqmodel_env)")
    return env


def peer_description() -> dict:
    env = gptqmodel_env.ready_env()
    return {"gptqmodel": env.describe() if env else {"installed": False,
                                                      "path": str(gptqmodel_env.venv_dir())}}


def gptqmodel_skip(opts: SuiteOptions) -> SkippedArm | None:
    """Only a smoke run may skip GPTQModel, and only when its venv is absent."""
    if opts.smoke and gptqmodel_env.ready_env() is None:
        return SkippedArm("gptqmodel", f"smoke run and no GPTQModel venv at "
                                       f"{gptqmodel_env.venv_dir()} "
                                       "(install: python -m benchmarks.peers.gptqmodel_env)")
    return None


def select(arms: list[Arm], wanted: list[str] | None) -> list[Arm]:
    if not wanted:
        return arms
    known = {a.name for a in arms}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return [a for a in arms if a.name in wanted]


def build(opts: SuiteOptions) -> Suite:
    settings = dict(SMOKE if opts.smoke else REAL)
    timeout = TIMEOUT_SMOKE if opts.smoke else TIMEOUT_REAL
    src = source_model(opts)
    inputs_dir = opts.workdir / "inputs"
    windows = write_calibration_windows(src, settings, inputs_dir / "calibration_windows.json")
    dynamic = matched_dynamic(src, settings["group"])
    arms = [cpu_quant_arm("cpu-quant-gptq", "gptq", src, settings, timeout),
            cpu_quant_arm("cpu-quant-rtn", "rtn", src, settings, timeout)]
    skipped = []
    skip = gptqmodel_skip(opts)
    if skip:
        skipped.append(skip)
    else:
        if not opts.smoke and opts.install_peers:
            gptqmodel_env.install()  # no-op when present; a real run never skips the peer
        arms.append(gptqmodel_arm("gptqmodel", src, windows, settings, dynamic, timeout))
    skipped_names = {s.arm for s in skipped}
    arms = select(arms, [w for w in opts.arms if w not in skipped_names] if opts.arms else None)
    baseline = "gptqmodel" if any(a.name == "gptqmodel" for a in arms) else None
    return Suite(
        name="quantize",
        description="Wall time and peak RssAnon (process tree) of quantizing "
                    f"{'a tiny random Llama (smoke)' if opts.smoke else 'the demo model'}: "
                    "cpu-quant vs GPTQModel 7.6.0, same settings, same calibration windows",
        metrics=[WALL_SECONDS, CPU_SECONDS, PEAK_RSS_ANON],
        arms=arms,
        settings={"source": str(src), **settings, "head": "bf16 (--no-lm-head / lm_head=False)",
                  "matched_dynamic": dynamic},
        baseline=baseline,
        skipped=skipped,
        inputs={"source_model": src, "calibration_windows": windows},
        peers=peer_description(),
        notes=[
            "GPTQModel gets cpu-quant's group-64 'dynamic' rules for modules whose in-features "
            "(576) group 128 does not divide, so both write the same groups.",
            "GPTQMODEL_CPU_WORKERS=2 works around GPTQModel 7.6.0's pool sizing crash on 2 CPUs.",
            "Every knob not named in the arm settings is at each tool's default (GPTQModel: "
            "damp_percent 0.05, act_group_aware on, offload_to_disk on; cpu-quant: damp 0.01, "
            "scale search on).",
        ],
    )


def render(results: Path, docs: Path) -> str:
    """The results page's block: the newest result file's table."""
    return harness_block(results, docs, "quantize",
                         "python -m benchmarks run quantize --arms cpu-quant-gptq,gptqmodel")
