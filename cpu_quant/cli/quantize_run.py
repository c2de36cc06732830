"""Shared pieces of the command line: the one-line error contract every command follows, and the
options, summary and driver shared by the commands that run the quantization pipeline."""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import asdict
from pathlib import Path

import click

from ..core.errors import CpuQuantError
from ..data.mix import DEFAULT_CALIBRATION
from ..quantize.settings import DEFAULT_RANK_TIMEOUT, METHODS, QuantSettings
from .conventions import overwrite_option, run_options


def friendly_errors(fn):
    """Turn CpuQuantError (and Ctrl-C, or SIGTERM) into a one-line message and an exit code. In
    a distributed run only one rank prints it (the others' errors are marked quiet:
    ``quantize.distributed.joined``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from ..quantize.signals import signals_held, sigterm_as_ctrl_c

        try:
            with sigterm_as_ctrl_c():
                return fn(*args, **kwargs)
        except CpuQuantError as exc:
            with signals_held():  # a second Ctrl-C does not cut the line short
                if not getattr(exc, "cpu_quant_quiet", False):
                    click.echo(f"error: {exc}", err=True)
            _exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            with signals_held():
                if not getattr(exc, "cpu_quant_quiet", False):
                    click.echo("interrupted: the output was not written; a quantization run "
                               "can be continued with --resume", err=True)
            sys.exit(130)

    return wrapper


def _exit(code: int) -> None:
    """Exit with ``code``. A rank of ``--nproc`` ends at once, without the interpreter's
    shutdown: the launcher's agent stops the other ranks with SIGTERM as soon as one fails, and
    a rank caught by it after its one line would end by that signal, which the launcher reads
    as a rank that could not report (``launcher._failed``) and says a second time."""
    from ..quantize.distributed import LAUNCHER_ENV

    # only a rank that --nproc's launcher started (under torchrun nothing repeats the line)
    if "RANK" in os.environ and os.environ.get(LAUNCHER_ENV):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


class UsageErrorLine(click.ClickException):
    """A command-line usage error (an unknown option, a value of the wrong type) shown as one
    ``error:`` line like every other bad input, not click's usage block."""

    exit_code = 2

    def __init__(self, exc: click.UsageError) -> None:
        where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        super().__init__(" ".join(exc.format_message().split()) + where)

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class OneLineUsageErrors(click.Group):
    """The ``cpu-quant`` group: a usage error, its own or a subcommand's, is one ``error:``
    line; so is output that cannot be written (stdout on a full device)."""

    def __call__(self, *args, **kwargs):
        """The process's entry point (``cpu-quant``, ``python -m cpu_quant``; click's test
        runner calls :meth:`main` instead): once the command has decided its exit status, a
        further Ctrl-C or SIGTERM (while Python joins threads at exit, say) exits with it."""
        from .conventions import exit_on_next_signal

        try:
            return super().__call__(*args, **kwargs)
        except SystemExit as exc:
            code = exc.code
            exit_on_next_signal(code if isinstance(code, int) else 0 if code is None else 1)
            raise

    def main(self, *args, **kwargs):
        try:
            try:
                return super().main(*args, **kwargs)
            finally:
                sys.stdout.flush()  # what is still buffered fails here, not at interpreter exit
        except OSError as exc:
            if not _writing_stdout(exc):
                raise
            # later flushes of the same buffer go nowhere instead of failing again at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            click.echo(f"error: cannot write to standard output: {exc.strerror or exc}", err=True)
            sys.exit(1)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.exceptions.NoArgsIsHelpError:  # `cpu-quant` alone: the help, as click shows it
            raise
        except click.UsageError as exc:
            raise UsageErrorLine(exc) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise UsageErrorLine(exc) from None


def _writing_stdout(exc: OSError) -> bool:
    """Did ``exc`` come from writing or flushing stdout (click's ``echo``, the JSON emitter,
    the final flush), not from a file the command was working on?"""
    tb = exc.__traceback__
    names = set()
    while tb is not None:
        names.add(tb.tb_frame.f_code.co_name)
        last = tb
        tb = tb.tb_next
    return bool(names & {"echo", "stdout_for_json"}) or last.tb_frame.f_code.co_name == "main"


def _resolve_source(src: str | None) -> Path:
    if src is not None:
        from ..hub import resolve_checkpoint

        return resolve_checkpoint(src)
    from ..models.demo import demo_model_path

    return demo_model_path()


def _default_destination(src: Path, kind: str, method: str, group: int) -> Path:
    """``./<source>-<kind>[-<method>]-w4g<group>``: the source's dtype suffix dropped, the
    method left out when it is the kind (``SmolLM2-135M-Instruct-gptq-w4g128``)."""
    from .conventions import default_output_name

    return Path.cwd() / default_output_name(src, kind, method, group)


def _print_summary(report, dst: Path) -> None:
    rows = [
        ("output", str(dst)),
        ("layout", report.layout),
        ("method", report.settings["method"]
         + ("" if report.settings["scale_search"] else " (no scale search)")),
        ("group", str(report.settings["group_size"])),
        ("head", "quantized" if report.head_quantized else "bf16"),
        ("bits/weight", f"{report.bits_per_weight:.3f} (codes + scales), "
                        f"{report.bits_per_weight_on_disk:.3f} on disk"),
        ("calibration", f"{report.calibration_tokens} tokens"),
        ("time", f"{report.total_seconds:.1f} s"),
    ]
    snrs = [t.weighted_snr_db for t in report.tensors]
    if snrs:
        rows.append(("weighted SNR", f"min {min(snrs):.1f} dB, median {sorted(snrs)[len(snrs) // 2]:.1f} dB"))
    raised = [t.name for t in report.tensors if t.damp_raised]
    if raised:
        rows.append(("damping raised", ", ".join(raised[:4]) + (" ..." if len(raised) > 4 else "")))
    fell = [f"{t.name} ({t.gptq_fallback})" for t in report.tensors if t.gptq_fallback]
    if fell:
        rows.append(("GPTQ fallback", ", ".join(fell[:4]) + (" ..." if len(fell) > 4 else "")))
    width = max(len(k) for k, _ in rows)
    click.echo("")
    for k, v in rows:
        click.echo(f"  {k:<{width}}  {v}")


def _print_fidelity(reports: dict) -> None:
    from ..eval.summary import fidelity_lines

    click.echo("\n".join(fidelity_lines(reports)))


# the library's defaults are the command's: one definition (smoothing aside: the command
# smooths where it applies, ``--smooth``'s None; the library only when asked)
DEFAULTS = QuantSettings()


def quantize_options(fn):
    """Options shared by every command that runs the quantization pipeline."""
    options = [
        click.option("--group", "group", type=int, default=DEFAULTS.group_size, show_default=True,
                     help="Group size (32, 64, 128 or -1 for one group per row)."),
        click.option("--method", type=click.Choice(METHODS), default=DEFAULTS.method, show_default=True,
                     help="Calibrated GPTQ, or round-to-nearest (data-free with --calib none)."),
        click.option("--calib", default=None,
                     help=f"Calibration text: 'mix' (built-in: prose, dialogue in the chat "
                          f"template, code and four languages), 'austen' (built-in: six Austen "
                          f"novels), 'none' (data-free, rtn only), a .txt, a .jsonl with a 'text' "
                          f"field, or a directory of them [default: {DEFAULT_CALIBRATION}]."),
        click.option("--samples", type=int, default=DEFAULTS.samples, show_default=True,
                     help="Number of calibration windows."),
        click.option("--seqlen", type=int, default=DEFAULTS.seqlen, show_default=True,
                     help="Tokens per calibration window."),
        click.option("--batch-size", type=int, default=DEFAULTS.batch_size, show_default=True,
                     help="Calibration windows per forward pass (memory vs speed)."),
        click.option("--image-samples", type=int, default=DEFAULTS.image_samples,
                     show_default=True,
                     help="A vision-language model: the calibration windows that begin with "
                          "an image (a user turn holding it and a request to describe it, laid "
                          "out by the checkpoint's processor; its embeddings from the vision "
                          "tower and projector), among --samples; 0 calibrates on text alone. "
                          "See docs/families.md."),
        click.option("--images", default=None,
                     help="Directory of .jpg/.png/.webp images for --image-samples [default: "
                          "the built-in set of 16 public-domain and CC0 pictures]."),
        click.option("--offload-activations", is_flag=True,
                     help="Keep the calibration activations on disk between layers (in the "
                          "staging directory) and let glibc map blocks of 4 MiB and more on "
                          "their own (16 MiB without this option): peak memory no longer grows "
                          "with --samples and is lower, at the cost of disk I/O and about 1.2x "
                          "the time; the artifact is identical."),
        click.option("--act-order/--no-act-order", default=DEFAULTS.act_order, show_default=True,
                     help="GPTQ sweeps the columns by decreasing Hessian diagonal, with the "
                          "group scales searched before the sweep (static groups), so the saved "
                          "layout keeps a trivial g_idx and desc_act false; --no-act-order "
                          "sweeps in natural order (see docs/gptq.md)."),
        click.option("--damp", type=float, default=DEFAULTS.damp, show_default=True,
                     help="GPTQ dampening, as a fraction of the Hessian's mean diagonal."),
        click.option("--no-scale-search", is_flag=True,
                     help="Plain absmax scales instead of the weighted scale search."),
        click.option("--positive-scales", is_flag=True,
                     help="Symmetric scales >= 0 only, the convention of ExecuTorch's XNNPACK "
                          "and QNN int4 weights: export-phone --quantized takes such a run's "
                          "codes as they are (see docs/phone.md)."),
        click.option("--w4a8-hessians", is_flag=True,
                     help="GPTQ's Hessians from the activations quantized to int8 per token, as "
                          "vLLM's AMX W4A8 kernel multiplies them, instead of the bf16 ones. "
                          "An option to measure (cpu-quant eval --w4a8), off by default; see "
                          "docs/gptq.md."),
        click.option("--smooth/--no-smooth", default=None,
                     help="Fold activation smoothing into the weights before GPTQ (norm "
                          "weights, v_proj and up_proj rows; strength chosen per fold on the "
                          "W4A8 kernel's and the bf16 activations' errors). The checkpoint "
                          "stays in stock vLLM's format. Default: on for calibrated GPTQ on "
                          "the symmetric grid of a Llama, Mistral or Qwen3 model (on the demo "
                          "model it cut held-out KL by over a fifth), off elsewhere; --smooth "
                          "folds it into Qwen2 and is refused on other architectures. See "
                          "docs/gptq.md."),
        click.option("--no-lm-head", is_flag=True,
                     help="Keep the output head bf16 (costs decode speed; see docs/gptq.md)."),
        click.option("--head-group", type=int, default=None,
                     help="Group size for the output head (default: 32 for calibrated GPTQ "
                          "on the symmetric grid when --group is larger, else --group's rule; "
                          "see docs/gptq.md)."),
        click.option("--down-group", type=int, default=None,
                     help="Group size for the MLP's down projections (default: 64 for "
                          "calibrated GPTQ on the symmetric grid when --group is larger, else "
                          "--group; see docs/gptq.md)."),
        click.option("--strict-group", is_flag=True,
                     help="Refuse modules that --group does not divide instead of using a smaller group."),
        click.option("--no-eval", is_flag=True, help="Skip the short fidelity check at the end."),
        overwrite_option,
        click.option("--resume", is_flag=True,
                     help="Continue an interrupted or killed run from its last completed layer "
                          "(same source contents, settings and calibration only; Ctrl-C or "
                          "SIGTERM stops a run at once and keeps its completed layers)."),
        click.option("--nproc", type=click.IntRange(min=1), default=None,
                     help="Run as N processes on this host (data-parallel over "
                          "torch.distributed, gloo): each takes a share of the calibration "
                          "batches, and the artifact is the one a single process writes, at "
                          "any --threads (threads per process; default: this host's CPUs "
                          "/ N). Across hosts, start the ranks with torchrun instead (see "
                          "docs/gptq.md)."),
        click.option("--rank-timeout", type=click.FloatRange(min=1), default=DEFAULT_RANK_TIMEOUT,
                     show_default=True,
                     help="In a distributed run, seconds a process waits for the others; a "
                          "process that ends or hangs stops the run after at most this long."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return run_options(fn)


def _agree_across_ranks(team, src: str | None, dst: str | None, formats: list, kind: str,
                        opts: dict) -> None:
    """Every rank of a distributed run started with the same command (before any work)."""
    from ..quantize.distributed import agree_on_command

    flags = {p.name: p.opts[0] for p in click.get_current_context().command.params if p.name}
    options = dict(opts, src=src, dst=str(Path(dst).resolve()) if dst else None, kind=kind,
                   format=",".join(f.name for f in formats))
    agree_on_command(team, options, dict(flags, src="SRC", dst="DST"))


def _settings_from(opts: dict, symmetric: bool) -> QuantSettings:
    return QuantSettings(
        method=opts["method"], group_size=opts["group"], scale_search=not opts["no_scale_search"],
        act_order=opts["act_order"], damp=opts["damp"], quantize_head=not opts["no_lm_head"],
        head_group=opts["head_group"], down_group=opts["down_group"],
        strict_group=opts["strict_group"], calib=opts["calib"],
        samples=opts["samples"], seqlen=opts["seqlen"], batch_size=opts["batch_size"],
        offload_activations=opts["offload_activations"], symmetric=symmetric,
        positive_scales=opts["positive_scales"], w4a8_hessians=opts["w4a8_hessians"],
        smooth=opts["smooth"], image_samples=opts["image_samples"], images=opts["images"])


def run_quantize_command(src: str | None, dst: str | None, formats: list, symmetric: bool,
                         kind: str, opts: dict) -> None:
    from ..quantize.distributed import joined, launched_rank
    from .conventions import RunConventions, stdout_for_json

    nproc, timeout = opts.pop("nproc"), opts.pop("rank_timeout")
    if nproc is not None and launched_rank():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if nproc != local:
            raise CpuQuantError(f"--nproc {nproc} in a process started as one of {local} ranks: "
                                "--nproc starts the ranks itself; under torchrun leave it out")
    elif nproc is not None and nproc > 1:
        from ..quantize.plan import check_own_grids
        from .launcher import check_nproc, launch_ranks

        check_nproc(nproc, opts["samples"], opts["batch_size"], opts["calib"] != "none")
        check_own_grids(formats, nproc)

        sys.exit(launch_ranks(nproc, sys.argv[1:], opts["threads"]))
    with joined(timeout) as team:
        conv = RunConventions.take(opts)
        _agree_across_ranks(team, src, dst, formats, kind, opts)
        if not team.writer:  # rank 0 speaks for the run
            conv.quiet, conv.as_json = True, False
        with stdout_for_json(conv.as_json) as emit:
            emit(_run_quantize(src, dst, formats, symmetric, kind, opts, conv, team))


def _run_quantize(src: str | None, dst: str | None, formats: list, symmetric: bool, kind: str,
                  opts: dict, conv, team) -> dict:
    from ..quantize.pipeline import check_request, quantize_checkpoint, update_report
    from ..report.phases import PhaseMeter
    from .after_run import finish_outputs

    settings = _settings_from(opts, symmetric)
    limits = check_request(formats, settings)  # before resolving (and perhaps downloading) the source
    source = _resolve_source(src)
    target = Path(dst) if dst else _default_destination(source, kind, settings.method, settings.group_size)
    if not settings.quantize_head:
        click.echo("warning: --no-lm-head keeps the output head in bf16; on the demo model the head "
                   "is about a quarter of all weights, so every decode step reads it at 4x the "
                   "bytes of a 4-bit head", err=True)
    conv.note(f"quantizing {source} -> {target} ({kind}, {settings.method}, group {settings.group_size})")
    meter = PhaseMeter()
    committed: dict[str, str] = {}  # the outputs, once DST is in place
    try:
        with meter.phase("quantize"):
            report = quantize_checkpoint(source, target, settings, formats,
                                         overwrite=opts["overwrite"], resume=opts["resume"],
                                         progress=conv.progress, team=team,
                                         on_commit=committed.update, checked=limits)
        team.release_signals()
        if not team.writer:
            return {}
        if team.world_size > 1:  # the other ranks on this host are done: the checks get their threads
            import torch

            torch.set_num_threads(torch.get_num_threads() * int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        shown = len(report.plan_notes) if conv.verbose else 6
        for note in report.plan_notes[:shown]:
            conv.note(f"note: {note}")
        if len(report.plan_notes) > shown:
            conv.note(f"note: ... {len(report.plan_notes) - shown} more in quantization_report.json "
                      "(-v shows them)")
        _print_summary(report, target)
        from ..core.cpu import read_machine
        from ..formats import get_format

        try:
            facts = read_machine()
        except CpuQuantError:  # no /proc/cpuinfo: nothing to say
            facts = None
        for name, out in report.outputs.items():
            why = None if facts is None else get_format(name).unservable_here(facts, Path(out))
            if why:
                conv.note(f"note: {why}")
        fidelity = None
        scored = _evaluated_output(report.outputs)
        if not opts["no_eval"] and scored is None:
            conv.note("note: no safetensors format was written; the fidelity check is skipped")
        elif not opts["no_eval"]:
            from ..eval.fidelity import EvalSettings, evaluate_artifact

            conv.note("\nrunning the short fidelity check (--no-eval skips it) ...")
            try:
                with meter.phase("eval"):
                    fid = evaluate_artifact(scored, source, EvalSettings.quick(), progress=conv.progress,
                                            variants=("weights", "w4a8_emulated"))
            except KeyboardInterrupt:  # the artifact is complete: nothing to resume
                from ..core.errors import Interrupted

                finish_outputs(report.outputs, source, fallback=asdict(report))
                raise Interrupted(f"fidelity check interrupted; {target} is complete (without a "
                                  f"fidelity score): measure it with `cpu-quant eval {scored} "
                                  f"--reference {source}`") from None
            fidelity = {k: v.as_dict() for k, v in fid.items()}
            _print_fidelity(fid)
        for directory in _safetensors_outputs(report.outputs):
            update_report(directory, phases=meter.as_dict(), command_line=_command_line(),
                          phase_seconds=report.phase_seconds,  # with the final write's time
                          **({"fidelity": fidelity} if fidelity else {}))
        doc = asdict(report)
        doc.update(fidelity=fidelity, phases=meter.as_dict(), command_line=_command_line())
        # the card of an output without a report JSON (a GGUF file) comes from this run's report
        written = finish_outputs(report.outputs, source, fallback=dict(doc))
        for path in written:
            conv.note(f"wrote {path}")
        doc.update(command="gptq" if kind == "gptq" else "tinygemm", output=str(target),
                   written=[str(p) for p in written])
        return doc
    except KeyboardInterrupt:
        if not committed:
            raise
        raise _interrupted_after_commit(committed, source, target) from None


def _interrupted_after_commit(outputs: dict[str, str], source: Path, target: Path
                              ) -> CpuQuantError:
    """Ctrl-C or SIGTERM after DST was put in place: finish its model card and report.html
    (a moment; further signals wait for it) and say truthfully what DST holds."""
    from ..core.errors import Interrupted
    from ..quantize.signals import signals_held
    from .after_run import finish_outputs, read_report

    with signals_held():
        reports = [r for r in (read_report(Path(d)) for d in outputs.values()) if r is not None]
        finish_outputs(outputs, source, fallback=reports[0] if reports else None)
    written = "its model card and report.html" if reports else "its model card"
    return Interrupted(f"interrupted after {target} was written: it is complete, with {written}, "
                       "but without a fidelity score (measure it with `cpu-quant eval "
                       f"{next(iter(outputs.values()))} --reference {source}`)")


def _command_line() -> str:
    import shlex

    return "cpu-quant " + shlex.join(sys.argv[1:])


def _safetensors_outputs(outputs: dict[str, str]) -> list[str]:
    """The outputs in safetensors formats: they hold the same weights (the same codes and bf16
    scales, every other tensor bf16), so one fidelity score serves them all."""
    from ..formats import SafetensorsFormat, get_format

    return [d for name, d in outputs.items() if isinstance(get_format(name), SafetensorsFormat)]


def _evaluated_output(outputs: dict[str, str]) -> str | None:
    scored = _safetensors_outputs(outputs)
    return scored[0] if scored else None
