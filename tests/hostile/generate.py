"""The hostile-input corpus: every bad input of the reliability reviews, against every command.

``python -m tests.hostile.generate OUT [--run]`` writes the corpus: the base inputs (a tiny
random Llama with the demo tokenizer, another of the same shapes with every weight moved a
little, its GPTQ, cpu_int4 and GGUF artifacts, a run interrupted after its first layer, a short
calibration text) into ``OUT/bases``, one
directory per case (``OUT/cases/<id>/``, holding the hostile input), and ``OUT/cases.json``:
each case's command line, expected exit code and expected message. ``--run`` also runs every
case and prints its outcome.

``tests/test_hostile_corpus.py`` parametrizes over :data:`CASES`: it builds each case the same
way in a temporary directory, runs the command in-process (:func:`invoke`: ``cpu_quant.cli.main``
under click's ``CliRunner``: most cases take milliseconds, where a subprocess spends seconds
on its imports) and asserts the exit code, the one ``error:`` line (or, for ``verify``, the
``ERROR`` finding), no traceback, nothing at or beside the output, and every file of the case
directory (the sources included) unchanged.

The table is generated: each group of faults is a set of functions that make one input hostile,
crossed with every command that reads that kind of input.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# a calibrated run at its smallest (with a short calibration text: Workspace.tiny_calib); the
# interrupted run in the bases was made with the same settings (TINY_SETTINGS)
TINY_CALIB = ["--group", "32", "--samples", "2", "--seqlen", "32", "--batch-size", "1",
              "--no-eval"]
# the interrupted run's settings; smooth=None is the gptq command's default (folded where it
# applies), so that `gptq --resume` with the same options continues it
TINY_SETTINGS = {"group_size": 32, "samples": 2, "seqlen": 32, "batch_size": 1}
RTN = ["--method", "rtn", "--calib", "none", "--group", "32", "--no-eval"]
# the bases' artifacts: their values do not matter, only that they are whole (no scale search: faster)
BASE_RTN = [*RTN, "--no-scale-search"]
EVAL_SMALL = ["--windows", "1", "--prompts", "1", "--seqlen", "32", "--new-tokens", "2"]
PHONE = ["--backend", "xnnpack", "--max-seq-len", "64"]
UP = "model.layers.1.mlp.up_proj"  # a tensor every fault that edits one weight uses


# -- running the CLI in-process --------------------------------------------------------------
@dataclass
class Outcome:
    exit_code: int
    stdout: str
    stderr: str
    exception: BaseException | None  # an exception the command did not handle (a traceback)
    seconds: float
    cpu_seconds: float  # this process's CPU time (all threads)

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("error:")]

    @property
    def traceback(self) -> bool:
        return self.exception is not None or "Traceback" in self.stderr + self.stdout


def invoke(argv: list[str], env: dict[str, str] | None = None) -> Outcome:
    """``cpu-quant ARGV`` in this process; what a user would see, and any unhandled exception."""
    from click.testing import CliRunner

    from cpu_quant.cli import main

    t0, c0 = time.perf_counter(), time.process_time()
    result = CliRunner().invoke(main, [str(a) for a in argv], env=env, prog_name="cpu-quant")
    exc = result.exception
    if isinstance(exc, SystemExit):
        exc = None
    return Outcome(result.exit_code, result.stdout, result.stderr, exc,
                   round(time.perf_counter() - t0, 2), round(time.process_time() - c0, 2))


# -- the base inputs, built once ---------------------------------------------------------------
@dataclass(frozen=True)
class Bases:
    model: Path  # tiny random Llama (hidden 64, 2 layers), bf16, the demo tokenizer
    other: Path  # the same shapes, every weight moved a little (as by a fine-tune)
    quant: Path  # `gptq model quant --format gptq,gguf` (RTN, group 32): quant/gptq, quant/gguf
    cpu_int4: Path  # `convert quant/gptq cpu_int4 --to cpu_int4`
    partial: Path  # holds `.out.partial`: `gptq model out TINY_CALIB` stopped after layer 1
    calib: Path  # a short calibration text (20000 characters of the built-in split)

    @property
    def gguf(self) -> Path:
        return next((self.quant / "gguf").glob("*.gguf"))


def build_bases(root: Path, model: Path | None = None) -> Bases:
    """Make the base inputs under ``root`` (``model``: an existing tiny model to copy)."""
    import pytest

    from cpu_quant.data.corpus import builtin_split
    from cpu_quant.models.demo import demo_model_path
    from cpu_quant.models.tiny import make_tiny_model
    from cpu_quant.quantize.pipeline import quantize_checkpoint
    from cpu_quant.quantize.settings import QuantSettings

    root.mkdir(parents=True, exist_ok=True)
    calib = root / "calib.txt"
    calib.write_text(builtin_split("calibration")[0][:20000])
    if model is None:
        model = make_tiny_model("llama", root / "model", demo_model_path())
    else:
        model = Path(shutil.copytree(model, root / "model"))
    other = Path(shutil.copytree(model, root / "other"))
    _fine_tune(other)
    quant = root / "quant"
    for argv in (["gptq", model, quant, *BASE_RTN, "--format", "gptq,gguf"],
                 ["convert", quant / "gptq", root / "cpu_int4", "--to", "cpu_int4"]):
        out = invoke(argv)
        if out.exit_code != 0:
            raise RuntimeError(f"building the corpus' bases: cpu-quant {argv[0]} failed: "
                               f"{out.stderr[-2000:]} {out.exception!r}")

    def stop(i: int, n: int) -> None:
        raise KeyboardInterrupt

    partial = root / "partial"
    partial.mkdir()
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(model, partial / "out",
                            QuantSettings(**TINY_SETTINGS, calib=str(calib), smooth=None),
                            progress=False, on_layer=stop)
    assert (partial / ".out.partial" / "cpu_quant_state.json").is_file()
    return Bases(model, other, quant, root / "cpu_int4", partial, calib)


def _fine_tune(model: Path) -> None:
    """Move every weight of ``model`` a little: another model of the same shapes and config."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(1)
    for f in model.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            noise = torch.randn(t.shape, generator=gen) * 0.01 * t.float().std().clamp(min=1e-3)
            tensors[name] = (t.float() + noise).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})


# -- one case's directory ----------------------------------------------------------------------
class Workspace:
    """The directory one case lives in: every file the command could touch is under ``root``.

    A source model is copied to ``root/models/tiny``, beside an unrelated file
    (``root/models/notes.txt``) that must survive; artifacts to ``root/q/``; the output is
    ``root/out`` unless the case says otherwise."""

    def __init__(self, root: Path, bases: Bases) -> None:
        self.root, self.bases = root, bases
        self.dst = root / "out"
        self.sources: list[Path] = []

    @property
    def tiny_calib(self) -> list:
        return [*TINY_CALIB, "--calib", self.bases.calib]

    def _source(self, path: Path) -> Path:
        self.sources.append(path)
        return path

    def model(self, which: str = "model") -> Path:
        parent = self.root / "models"
        parent.mkdir(exist_ok=True)
        (parent / "notes.txt").write_text("not cpu-quant's")
        name = "tiny" if which == "model" else which
        return self._source(Path(shutil.copytree(getattr(self.bases, which), parent / name)))

    def artifact(self, fmt: str = "gptq") -> Path:
        base = self.bases.quant / "gptq" if fmt == "gptq" else self.bases.cpu_int4
        return self._source(Path(shutil.copytree(base, self.root / "q" / fmt)))

    def gguf(self) -> Path:
        (self.root / "q").mkdir(exist_ok=True)
        return self._source(Path(shutil.copy(self.bases.gguf, self.root / "q" / "model.gguf")))

    def partial(self) -> Path:
        """The interrupted run's staging directory, beside ``dst``; returns it."""
        staging = self.root / ".out.partial"
        shutil.copytree(self.bases.partial / ".out.partial", staging)
        return staging

    def file(self, name: str, data: str | bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
        return path


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Workspace], list]  # makes the hostile input in the workspace; the argv
    needle: str  # in the one `error:` line (kind "error") or in an ERROR finding ("finding")
    exit_code: int = 2
    kind: str = "error"


# -- editing files -------------------------------------------------------------------------------
def edit_json(path: Path, edit: Callable[[object], object]) -> None:
    """Apply ``edit`` (which changes the parsed JSON in place) to the file."""
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_header(path: Path, edit: Callable[[dict], None]) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])


def edit_tensors(directory: Path, edit: Callable[[dict], None], name: str) -> None:
    """Rewrite the shard of ``directory`` holding ``name`` with ``edit`` applied to its tensors."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            if name not in fh.keys():
                continue
        tensors = load_file(f)
        edit(tensors)
        save_file(tensors, f, metadata={"format": "pt"})
        return
    raise KeyError(name)


def _shard(directory: Path) -> Path:
    return sorted(directory.glob("*.safetensors"))[0]


def _set_value(name: str, value: float) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        def edit(t: dict) -> None:
            w = t[name].clone()
            w.view(-1)[3] = value
            t[name] = w
        edit_tensors(d, edit, name)
    return fault


def _to_dtype(name: str, dtype: str) -> Callable[[Path], None]:
    import torch

    def fault(d: Path) -> None:
        edit_tensors(d, lambda t: t.__setitem__(name, t[name].to(getattr(torch, dtype))), name)
    return fault


def _config(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    return lambda d: edit_json(d / "config.json", edit)


def _header(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    return lambda d: edit_header(_shard(d), edit)


def _truncate(d: Path) -> None:
    f = _shard(d)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _header_claims_more(d: Path) -> None:
    f = _shard(d)
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])


def _header_not_json(d: Path) -> None:
    f = _shard(d)
    raw = bytearray(f.read_bytes())
    raw[8:12] = b"\xff\xfe{["
    f.write_bytes(bytes(raw))


def _shrink_offsets(h: dict) -> None:
    h[f"{UP}.weight"]["data_offsets"][1] -= 2


def _unknown_dtype(h: dict) -> None:
    h[f"{UP}.weight"]["dtype"] = "Q4_K"


def _negative_shape(h: dict) -> None:
    h[f"{UP}.weight"]["shape"] = [-1, 64]


def _trailing_garbage(d: Path) -> None:
    with open(_shard(d), "ab") as fh:
        fh.write(b"\0appended bytes that belong to no tensor" * 16)


NESTED_DEPTH = 100_000  # far beyond Python's recursion limit (json.loads recurses per level)


def _nested_json() -> bytes:
    return b'{"a":' * NESTED_DEPTH + b"1" + b"}" * NESTED_DEPTH


def _header_nested(d: Path) -> None:
    f = _shard(d)
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = _nested_json()
    head += b" " * (-len(head) % 8)
    f.write_bytes(len(head).to_bytes(8, "little") + head + raw[8 + n:])


def _nested(name: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(_nested_json())


def _overlap_offsets(h: dict) -> None:
    # up_proj's bytes made gate_proj's (the same shape and dtype): two tensors share bytes
    h[f"{UP}.weight"]["data_offsets"] = list(
        h["model.layers.1.mlp.gate_proj.weight"]["data_offsets"])


def _symlink_loop(d: Path) -> None:
    shutil.rmtree(d)
    d.symlink_to(d.name)


def _shard_symlink_loop(d: Path) -> None:
    f = _shard(d)
    f.unlink()
    f.symlink_to(f.name)


def _shard_a_directory(d: Path) -> None:
    f = _shard(d)
    f.unlink()
    f.mkdir()
    (f / "notes.txt").write_text("a directory named like a shard")


def _in_two_shards(d: Path) -> None:
    """Two shards (no index), each holding a copy of up_proj's weight."""
    from safetensors.torch import load_file, save_file

    f = _shard(d)
    tensors = load_file(f)
    names = sorted(tensors)
    half = len(names) // 2
    first = {n: tensors[n] for n in names[:half]}
    second = {n: tensors[n] for n in names[half:]}
    first[f"{UP}.weight"] = second[f"{UP}.weight"] = tensors[f"{UP}.weight"]
    f.unlink()
    save_file(first, d / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, d / "model-00002-of-00002.safetensors", metadata={"format": "pt"})


def _in_two_indexed_shards(d: Path) -> None:
    """As :func:`_in_two_shards`, with an index that maps every tensor to one of them."""
    from safetensors import safe_open

    _in_two_shards(d)
    weight_map = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            weight_map.update(dict.fromkeys(fh.keys(), f.name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _fifo(name: str) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        (d / name).unlink(missing_ok=True)
        os.mkfifo(d / name)
    return fault


def _no_safetensors(d: Path) -> None:
    for f in d.glob("*.safetensors*"):
        f.unlink()


def _pickle_only(d: Path) -> None:
    _no_safetensors(d)
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")


def _index(data: object) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        (d / "model.safetensors.index.json").write_text(
            data if isinstance(data, str) else json.dumps(data))
    return fault


def _link_outside(name: str) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        outside = d.parent / f"outside-{name}"
        shutil.move(d / name, outside)
        (d / name).symlink_to(outside)
    return fault


def _remove(*names: str) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        for n in names:
            (d / n).unlink(missing_ok=True)
    return fault


def _write(name: str, data: str) -> Callable[[Path], None]:
    def fault(d: Path) -> None:
        (d / name).write_text(data)
    return fault


def _auto_map(d: Path) -> None:
    edit_json(d / "tokenizer_config.json",
              lambda c: c.update(auto_map={"AutoTokenizer": ["tok.EvilTokenizer", None]}))


def _replace_with_file(d: Path) -> None:
    shutil.rmtree(d)
    d.write_text("not a directory")


def _delete(d: Path) -> None:
    shutil.rmtree(d)


@dataclass(frozen=True)
class Expect:
    """What a command must do with a hostile input."""

    needle: str
    exit_code: int = 2
    kind: str = "error"  # "error": one `error:` line on stderr; "finding": an ERROR line (verify)


def finding(needle: str) -> Expect:
    """``verify``'s answer to a broken artifact: exit 1 and an ``ERROR`` finding on stdout."""
    return Expect(needle, 1, "finding")


Fault = Callable[[Path], "Path | None"]  # makes the input hostile; may return another path
CommandLine = Callable[[Workspace, Path], list]


def crossed(group: str, make_input: Callable[[Workspace], Path],
            faults: dict[str, tuple[Fault, str | Expect]],
            commands: dict[str, CommandLine],
            overrides: dict[tuple[str, str], str | Expect | None] | None = None) -> list[Case]:
    """Every fault of a group against every command that reads that kind of input. An override
    gives a command's own answer to a fault, or None where the fault is not one for that
    command (said why beside the table)."""
    overrides = overrides or {}
    cases = []
    for fault, (make, default) in faults.items():
        for command, argv in commands.items():
            expect = overrides.get((fault, command), default)
            if expect is None:
                continue
            if isinstance(expect, str):
                expect = Expect(expect)

            def build(ws: Workspace, make=make, argv=argv) -> list:
                path = make_input(ws)
                args = argv(ws, path)  # before the fault: a command line may copy other inputs
                replaced = make(path)
                if isinstance(replaced, Path):
                    args = [replaced if a == path else a for a in args]
                return args

            cases.append(Case(f"{group}-{fault}-{command}", build, expect.needle,
                              expect.exit_code, expect.kind))
    return cases


# -- bf16 model sources --------------------------------------------------------------------------
MODEL_FAULTS: dict[str, tuple[Fault, str | Expect]] = {
    "missing": (_delete, "does not exist"),
    "a-file": (_replace_with_file, "is not a directory"),
    "no-config": (_remove("config.json"), "has no config.json"),
    "config-not-json": (_write("config.json", "{not json"), "not valid JSON"),
    "config-a-list": (_write("config.json", "[1, 2]"), "expected a JSON object"),
    "no-safetensors": (_no_safetensors, "holds no .safetensors"),
    "pickle-only": (_pickle_only, "never unpickles"),
    "truncated": (_truncate, "truncated"),
    "header-claims-more": (_header_claims_more, "header claims"),
    "header-not-json": (_header_not_json, "corrupted safetensors header"),
    "header-offsets": (_header(_shrink_offsets), "its offsets give"),
    "header-unknown-dtype": (_header(_unknown_dtype), "unknown dtype"),
    "header-negative-shape": (_header(_negative_shape), "malformed shape"),
    "weight-map-list": (_index({"weight_map": ["a", "b"]}), "weight_map must map"),
    "index-not-json": (_index("{nope"), "no valid weight_map"),
    "index-missing-file": (_index({"weight_map": {f"{UP}.weight": "gone.safetensors"}}),
                           "points to missing"),
    "config-link-outside": (_link_outside("config.json"), "points outside the checkpoint"),
    "shard-link-outside": (_link_outside("model.safetensors"), "points outside the checkpoint"),
    "config-disagrees": (_config(lambda c: c.update(intermediate_size=256)),
                         "config disagrees with the tensors"),
    "nan-weight": (_set_value("model.layers.0.mlp.up_proj.weight", float("nan")), "NaN or Inf"),
    "inf-weight": (_set_value("model.layers.0.self_attn.q_proj.weight", float("inf")),
                   "NaN or Inf"),  # the same check as NaN: not repeated where it costs a load
    "int8-weight": (_to_dtype("model.layers.0.mlp.down_proj.weight", "int8"), "is I8"),
    "int32-weight": (_to_dtype(f"{UP}.weight", "int32"), "is I32"),
    "tokenizer-missing": (_remove("tokenizer.json", "tokenizer_config.json",
                                  "chat_template.jinja"), "cannot load the tokenizer"),
    "tokenizer-corrupt": (_write("tokenizer.json", "{not json"), "cannot load the tokenizer"),
    "tokenizer-auto-map": (_auto_map, "names repository code (auto_map)"),
    "config-hidden-a-string": (_config(lambda c: c.update(hidden_size="64")),
                               "hidden_size must be a positive integer"),
    # transformers' default intermediate_size (11008) then disagrees with the tensors
    "config-no-intermediate": (_config(lambda c: c.pop("intermediate_size")),
                               "config disagrees with the tensors"),
    "config-zero-heads": (_config(lambda c: c.update(num_attention_heads=0)),
                          "num_attention_heads must be a positive integer"),
    "config-unknown-model-type": (_config(lambda c: c.update(model_type="nope")),
                                  "cannot read the model config"),
    "context-shorter-than-seqlen": (_config(lambda c: c.update(max_position_embeddings=16)),
                                    "beyond the"),
    "trailing-garbage": (_trailing_garbage, "after the last tensor"),
    "header-nested-json": (_header_nested, "nested too deeply"),
    "config-nested-json": (_nested("config.json"), "nested too deeply"),
    "index-nested-json": (_nested("model.safetensors.index.json"), "nested too deeply"),
    "header-overlapping-offsets": (_header(_overlap_offsets), "share bytes"),
    "fp8-weight": (_to_dtype(f"{UP}.weight", "float8_e4m3fn"), "is F8_E4M3"),
    "symlink-loop": (_symlink_loop, "symlink loop"),
    "shard-symlink-loop": (_shard_symlink_loop, "symlink loop"),
    "shard-a-directory": (_shard_a_directory, "not a regular file"),
    "tensor-in-two-shards": (_in_two_shards, "is in both model-00001-of-00002.safetensors "
                                             "and model-00002-of-00002.safetensors"),
    # an index names one copy, but a loader that reads every tensor of every shard takes the other
    "tensor-in-two-indexed-shards": (_in_two_indexed_shards, "is in both"),
    "tokenizer-config-fifo": (_fifo("tokenizer_config.json"), "not a regular file"),
    "tokenizer-class-unknown": (lambda d: edit_json(d / "tokenizer_config.json", lambda c: c.update(
        tokenizer_class="NopeTokenizerFast")), "NopeTokenizerFast"),
    "config-eps-nan": (_config(lambda c: c.update(rms_norm_eps=float("nan"))),
                       "rms_norm_eps must be a finite number >= 0"),
    "config-eps-negative": (_config(lambda c: c.update(rms_norm_eps=-1e-5)),
                            "rms_norm_eps must be a finite number >= 0"),
    "config-vocab-huge": (_config(lambda c: c.update(vocab_size=10**12)),
                          "vocab_size is 1000000000000"),
    "config-layers-huge": (_config(lambda c: c.update(num_hidden_layers=10**9)),
                           "num_hidden_layers is 1000000000"),
    "huge-weight": (_set_value(f"{UP}.weight", 3e38), "3e+38"),
}

MODEL_COMMANDS: dict[str, CommandLine] = {
    "gptq": lambda ws, src: ["gptq", src, ws.dst, *ws.tiny_calib],
    "tinygemm": lambda ws, src: ["tinygemm", src, ws.dst, *ws.tiny_calib],
    "eval-reference": lambda ws, src: ["eval", ws.artifact(), "--reference", src, *EVAL_SMALL,
                                       "--output-json", ws.root / "r.json"],
    "export-phone": lambda ws, src: ["export-phone", src, ws.dst, *PHONE],
    "verify-source": lambda ws, src: ["verify", ws.artifact(), "--source", src],
}

MODEL_OVERRIDES: dict[tuple[str, str], str | Expect | None] = {
    # verify --source reads the source's tensors only: not its tokenizer, context or
    # architecture (what it says about a config that disagrees is a finding per module)
    **{(f, "verify-source"): None
       for f in ("tokenizer-missing", "tokenizer-corrupt", "tokenizer-auto-map",
                 "tokenizer-config-fifo", "tokenizer-class-unknown",
                 "context-shorter-than-seqlen", "config-no-intermediate",
                 "config-unknown-model-type", "config-disagrees", "config-vocab-huge",
                 "config-layers-huge")},
    # export-phone builds its own graph from the config (read_spec)
    ("config-no-intermediate", "export-phone"): "intermediate_size is missing",
    ("config-unknown-model-type", "export-phone"): None,  # it reads `architectures`, unchanged
    # Inf goes through the same finiteness check as NaN; where finding it takes a model load
    # (seconds), the NaN case stands for both
    ("inf-weight", "eval-reference"): None,
    ("inf-weight", "export-phone"): None,
    ("context-shorter-than-seqlen", "export-phone"): "--max-seq-len 64 is beyond",
    ("a-file", "export-phone"): "is a file",
}


# -- quantized artifacts -------------------------------------------------------------------------
def _qcfg(edit: Callable[[dict], object]) -> Fault:
    return _config(lambda c: edit(c["quantization_config"]))


def _artifact_tensor(suffix: str, edit: Callable[[object], object]) -> Fault:
    """Apply ``edit`` to the first tensor of the artifact whose name ends with ``suffix``."""
    def fault(d: Path) -> None:
        from safetensors.torch import load_file, save_file

        for f in sorted(d.glob("*.safetensors")):
            tensors = load_file(f)
            names = sorted(n for n in tensors if n.endswith(suffix))
            if names:
                tensors[names[0]] = edit(tensors[names[0]].clone())
                save_file(tensors, f, metadata={"format": "pt"})
                return
        raise KeyError(suffix)
    return fault


def _first_value(value: float) -> Callable:
    def edit(t):
        t.view(-1)[0] = value
        return t
    return edit


def _drop_tensor(suffix: str) -> Fault:
    def fault(d: Path) -> None:
        from safetensors.torch import load_file, save_file

        for f in sorted(d.glob("*.safetensors")):
            tensors = load_file(f)
            names = sorted(n for n in tensors if n.endswith(suffix))
            if names:
                del tensors[names[0]]
                save_file(tensors, f, metadata={"format": "pt"})
                index = d / "model.safetensors.index.json"
                if index.is_file():
                    edit_json(index, lambda i, gone=names[0]: i["weight_map"].pop(gone, None))
                return
        raise KeyError(suffix)
    return fault


def _artifact_header(edit: Callable[[dict, str], None]) -> Fault:
    def fault(d: Path) -> None:
        f = _shard(d)
        name = sorted(json.loads(f.read_bytes()[8:8 + int.from_bytes(f.read_bytes()[:8],
                                                                       "little")]))
        qweight = next(n for n in name if n.endswith(".qweight"))
        edit_header(f, lambda h: edit(h, qweight))
    return fault


def _shrink_named(h: dict, name: str) -> None:
    h[name]["data_offsets"][1] -= 4


ARTIFACT_FAULTS: dict[str, tuple[Fault, str | Expect]] = {
    "missing": (_delete, "does not exist"),
    "a-file": (_replace_with_file, "is not a directory"),
    "no-config": (_remove("config.json"), "has no config.json"),
    "config-not-json": (_write("config.json", "{not json"), "not valid JSON"),
    "config-a-list": (_write("config.json", "[1, 2]"), "expected a JSON object"),
    "config-nested-json": (_nested("config.json"), "nested too deeply"),
    "quant-method-unknown": (_qcfg(lambda q: q.update(quant_method="awq")), "awq"),
    "qcfg-a-list": (_config(lambda c: c.update(quantization_config=[1])),
                    "quantization_config"),
    "bits-a-string": (_qcfg(lambda q: q.update(bits="4")), "bits"),
    "bits-a-list": (_qcfg(lambda q: q.update(bits=[4])), "bits"),
    "bits-8": (_qcfg(lambda q: q.update(bits=8)), "bits"),
    "group-mismatch": (_qcfg(lambda q: q.update(group_size=64)), "fails verify"),
    "group-a-string": (_qcfg(lambda q: q.update(group_size="32")), "group_size"),
    "dynamic-bad-regex": (_qcfg(lambda q: q.update(dynamic={"-:model.(": {}})),
                          "not a valid regex"),
    "dynamic-a-list": (_qcfg(lambda q: q.update(dynamic=["a"])), "dynamic"),
    "desc-act-a-string": (_qcfg(lambda q: q.update(desc_act="no")), "desc_act"),
    "nan-scale": (_artifact_tensor(".scales", _first_value(float("nan"))), "NaN or Inf"),
    "inf-scale": (_artifact_tensor(".scales", _first_value(float("inf"))), "NaN or Inf"),
    "qweight-missing": (_drop_tensor(".qweight"), "qweight"),
    "qweight-float": (_artifact_tensor(".qweight", lambda t: t.float()), "qweight"),
    "scales-wrong-shape": (_artifact_tensor(".scales", lambda t: t[:1].contiguous()), "scales"),
    "header-offsets": (_artifact_header(_shrink_named), "its offsets give"),
    "truncated": (_truncate, "truncated"),
    "weight-map-list": (_index({"weight_map": ["a", "b"]}), "weight_map must map"),
    "report-a-list": (_write("quantization_report.json", "[1, 2]"), "not a JSON object"),
    "report-not-json": (_write("quantization_report.json", "{nope"), "not valid JSON"),
    "report-nested-json": (_nested("quantization_report.json"), "not valid JSON"),
    "report-wrong-types": (lambda d: edit_json(d / "quantization_report.json",
                                               lambda r: r.update(settings=[1], tensors=3,
                                                                  plan_notes=7)),
                           "quantization_report.json"),
}

ARTIFACT_COMMANDS: dict[str, CommandLine] = {
    "convert": lambda ws, q: ["convert", q, ws.dst, "--to", "cpu_int4"],
    "verify": lambda ws, q: ["verify", q],
    "inspect": lambda ws, q: ["inspect", q],
    "eval-quant": lambda ws, q: ["eval", q, "--reference", ws.model(), *EVAL_SMALL,
                                 "--output-json", ws.root / "r.json"],
    "report": lambda ws, q: ["report", q],
}

_REPORT_FAULTS = ("report-a-list", "report-not-json", "report-nested-json", "report-wrong-types")
ARTIFACT_OVERRIDES: dict[tuple[str, str], str | Expect | None] = {
    # `report` reads only quantization_report.json; the others do not need the report
    **{(f, "report"): None for f, _ in ARTIFACT_FAULTS.items()
       if f not in (*_REPORT_FAULTS, "missing", "a-file")},
    ("missing", "report"): "is not a directory",
    ("a-file", "report"): "is not a directory",
    ("report-wrong-types", "report"): "cannot render it",
    **{(f, c): None for f in _REPORT_FAULTS for c in ("verify", "eval-quant")},
    # inspect is a summary: it shows what it can read of the report, and says nothing of the rest
    **{(f, "inspect"): None for f in _REPORT_FAULTS},
    ("report-wrong-types", "convert"): None,  # copied as it is: convert needs none of it
    # verify reports a broken artifact as findings (exit 1); a missing one is an error (2)
    **{(f, "verify"): finding(needle) for f, needle in (
        ("config-not-json", "not valid JSON"), ("config-a-list", "expected a JSON object"),
        ("config-nested-json", "nested too deeply"),
        ("bits-a-string", "quantization_config.bits is '4'"),
        ("bits-a-list", "quantization_config.bits is [4]"), ("bits-8", "bits=8"),
        ("group-mismatch", "group 64"), ("group-a-string", "group_size is '32'"),
        ("dynamic-bad-regex", "not a valid regex"), ("dynamic-a-list", "not a mapping"),
        ("desc-act-a-string", "desc_act is 'no'"), ("nan-scale", "1 NaN"),
        ("inf-scale", "1 Inf"), ("qweight-missing", "qweight"), ("qweight-float", "I32"),
        ("scales-wrong-shape", "scales"), ("header-offsets", "its offsets give"),
        ("truncated", "truncated"), ("weight-map-list", "weight_map must map"))},
    ("quant-method-unknown", "verify"): "is not one verify knows",
    ("qcfg-a-list", "verify"): "has no quantization_config",
    # inspect summarises what the files hold, whatever it is (verify judges it): an unknown
    # or non-4-bit method, a config without a usable quantization_config, tensors that
    # disagree with the config
    **{(f, "inspect"): None for f in ("quant-method-unknown", "qcfg-a-list", "bits-8",
                                      "group-mismatch", "nan-scale", "inf-scale",
                                      "qweight-missing", "qweight-float",
                                      "scales-wrong-shape")},
    # convert and eval refuse what verify finds damaged, naming verify's first finding
    **{(f, c): "fails verify" for f in ("group-mismatch", "qweight-missing", "qweight-float",
                                        "scales-wrong-shape")
       for c in ("convert", "eval-quant")},
    **{(f, "eval-quant"): "fails verify" for f in (
        "bits-a-string", "bits-a-list", "group-a-string", "dynamic-bad-regex",
        "dynamic-a-list", "desc-act-a-string", "nan-scale", "inf-scale")},
    # 8-bit GPTQ is a runtime's limit, not damage: eval's reader says it reads 4-bit only
    ("bits-8", "eval-quant"): "only 4-bit GPTQ is supported",
    ("quant-method-unknown", "eval-quant"): "is not one verify knows",
    ("qcfg-a-list", "eval-quant"): "has no quantization_config",
    ("nan-scale", "convert"): "1 NaN",
    ("inf-scale", "convert"): "1 Inf",
    ("bits-8", "convert"): "only 4-bit checkpoints convert",
}


# -- output paths (the guard every writing command shares) ----------------------------------------
# command -> (its source, its command line for an output path, without --overwrite)
WRITERS: dict[str, tuple[Callable[[Workspace], Path], Callable[[Path, Path], list]]] = {
    "gptq": (lambda ws: ws.model(), lambda src, dst: ["gptq", src, dst, *RTN]),
    "tinygemm": (lambda ws: ws.model(), lambda src, dst: ["tinygemm", src, dst, *RTN]),
    "convert": (lambda ws: ws.artifact(), lambda src, dst: ["convert", src, dst, "--to",
                                                             "cpu_int4"]),
    "export-phone": (lambda ws: ws.model(), lambda src, dst: ["export-phone", src, dst, *PHONE]),
}


def _link(ws: Workspace, target: Path) -> Path:
    link = ws.root / "link"
    link.symlink_to(target)
    return link


def _existing(ws: Workspace, what: str) -> Path:
    """An existing output of kind ``what`` at ``ws.dst``."""
    dst = ws.dst
    if what == "file":
        dst.write_text("mine")
    elif what == "foreign":
        dst.mkdir()
        (dst / "a.jpg").write_bytes(b"\xff\xd8")
    elif what == "artifact-link":  # a link to a directory cpu-quant wrote
        target = ws.root / "elsewhere"
        shutil.copytree(ws.bases.cpu_int4, target)
        dst.symlink_to(target)
    elif what == "locked":
        (ws.root / ".out.lock").write_text(str(os.getppid()))  # alive, and another process
    else:  # "artifact": without --overwrite it is kept
        shutil.copytree(ws.bases.cpu_int4, dst)
    return dst


# case -> (the output path for a source, --overwrite given, the message)
PLACEMENTS: dict[str, tuple[Callable[[Workspace, Path], Path], bool, str]] = {
    "dst-is-src": (lambda ws, src: src, True, "is the source"),
    "dst-is-parent": (lambda ws, src: src.parent, True, "contains the source"),
    "dst-inside-src": (lambda ws, src: src / "out", True, "is inside the source"),
    "dst-links-to-src": (lambda ws, src: _link(ws, src), True, "is the source"),
    "dst-links-to-parent": (lambda ws, src: _link(ws, src.parent), True,
                            "contains the source"),
    "dst-exists": (lambda ws, src: _existing(ws, "artifact"), False, "already exists"),
    "overwrite-a-file": (lambda ws, src: _existing(ws, "file"), True, "is not a directory"),
    "overwrite-foreign-dir": (lambda ws, src: _existing(ws, "foreign"), True,
                              "is not a cpu-quant artifact"),
    "overwrite-link-to-artifact": (lambda ws, src: _existing(ws, "artifact-link"), True,
                                   "is not a directory"),
    "dst-parent-missing": (lambda ws, src: ws.root / "nope" / "out", False, "does not exist"),
    "dst-locked": (lambda ws, src: _existing(ws, "locked"), False, "another cpu-quant run"),
}


def destination_cases() -> list[Case]:
    cases = []
    for place, (where, overwrite, needle) in PLACEMENTS.items():
        for command, (source, argv) in WRITERS.items():
            def build(ws: Workspace, source=source, argv=argv, where=where,
                      overwrite=overwrite) -> list:
                src = source(ws)
                return [*argv(src, where(ws, src)), *(["--overwrite"] if overwrite else [])]

            cases.append(Case(f"output-{place}-{command}", build, needle))
    return cases


# eval writes files: --output-json and --save-reference
def _eval_output(flag: str, where: Callable[[Workspace, Path, Path], Path]) -> Callable:
    def build(ws: Workspace) -> list:
        q, ref = ws.artifact(), ws.model()
        return ["eval", q, "--reference", ref, *EVAL_SMALL, flag, where(ws, q, ref)]
    return build


EVAL_OUTPUT_CASES = [
    Case(f"eval-{flag.strip('-')}-{name}", _eval_output(flag, where), needle)
    for flag in ("--output-json", "--save-reference")
    for name, where, needle in (
        ("inside-quant", lambda ws, q, ref: q / "r.json", "is inside the source"),
        ("over-a-source-file", lambda ws, q, ref: ref / "model.safetensors",
         "is inside the source"),
        ("is-the-quant-dir", lambda ws, q, ref: q, "is a directory"),
        ("a-directory", lambda ws, q, ref: ws.file("d/keep", "x").parent, "is a directory"),
        ("parent-missing", lambda ws, q, ref: ws.root / "nope" / "r.json", "does not exist"),
    )
]


# -- resume: the same run, the same model, the same layer ----------------------------------------
HIDDEN = ".out.partial/cpu_quant_hidden-00001.safetensors"
STATE = ".out.partial/cpu_quant_state.json"


def _restamp(ws: Workspace, **stamp: str | None) -> None:
    """Rewrite the saved activations with their metadata changed (None: the key removed)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from cpu_quant.core.io.safetensors_writer import write_safetensors

    path = ws.root / HIDDEN
    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata() or {})
    for k, v in stamp.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    write_safetensors(path, load_file(path), metadata=meta)


def _flip_tensor(src: Path) -> None:
    """A model of the same shapes whose one weight is reversed: other contents."""
    edit_tensors(src, lambda t: t.__setitem__(f"{UP}.weight", t[f"{UP}.weight"].flip(0)
                                              .contiguous()), f"{UP}.weight")


def _resume(prepare: Callable[[Workspace], list | None], *extra: str,
            source: str = "model", command: str = "gptq") -> Callable[[Workspace], list]:
    """``gptq model out --resume`` (TINY_CALIB) over the interrupted run, after ``prepare``
    (which may return other options)."""
    def build(ws: Workspace) -> list:
        src = ws.model(source)
        ws.partial()
        more = prepare(ws)
        more = more if isinstance(more, list) else []
        return [command, src, ws.dst, *ws.tiny_calib, *more, *extra, "--resume"]
    return build


RESUME_CASES = [
    Case("resume-another-model", _resume(lambda ws: None, source="other"),
         "cannot resume: the source model's files or tensor contents differ"),
    Case("resume-changed-tensor",
         _resume(lambda ws: _flip_tensor(ws.root / "models" / "tiny")),
         "cannot resume: the source model's files or tensor contents differ"),
    Case("resume-other-settings", _resume(lambda ws: ["--samples", "3"]),
         "the settings, formats or compute dtype"),
    Case("resume-other-formats", _resume(lambda ws: ["--format", "gptq,cpu_int4"]),
         "the settings, formats or compute dtype"),
    Case("resume-as-tinygemm", _resume(lambda ws: None, command="tinygemm"),
         "the settings, formats or compute dtype"),
    Case("resume-other-calibration",
         _resume(lambda ws: ["--calib", ws.file("other.txt", ws.bases.calib.read_text()[::-1])]),
         "the calibration tokens"),
    Case("resume-activations-of-another-layer",
         _resume(lambda ws: _restamp(ws, completed_layers="2")),
         "holds the activations of layer 2, the state says 1"),
    Case("resume-activations-of-another-run",
         _resume(lambda ws: _restamp(ws, fingerprint="0" * 64)), "written by another run"),
    Case("resume-activations-unstamped",
         _resume(lambda ws: _restamp(ws, completed_layers=None, fingerprint=None)),
         "carries no layer stamp"),
    Case("resume-activations-missing", _resume(lambda ws: (ws.root / HIDDEN).unlink()),
         "lacks the calibration activations of layer 1"),
    Case("resume-activations-truncated",
         _resume(lambda ws: (ws.root / HIDDEN).write_bytes((ws.root / HIDDEN).read_bytes()[:999])),
         "is corrupted"),
    Case("resume-state-not-json", _resume(lambda ws: (ws.root / STATE).write_text("{")),
         "is corrupted"),
    Case("resume-state-a-list", _resume(lambda ws: (ws.root / STATE).write_text("[1]")),
         "is corrupted"),
    Case("resume-state-wrong-types",
         _resume(lambda ws: edit_json(ws.root / STATE, lambda st: st.update(completed_layers="1"))),
         "is corrupted"),
    Case("resume-state-beyond-the-model",
         _resume(lambda ws: edit_json(ws.root / STATE, lambda st: st.update(completed_layers=7))),
         "is corrupted"),
    Case("resume-state-missing", _resume(lambda ws: (ws.root / STATE).unlink()),
         "holds no completed layer"),
    Case("resume-nothing-to-resume",
         lambda ws: ["gptq", ws.model(), ws.dst, *ws.tiny_calib, "--resume"],
         "nothing to resume"),
]


# -- GGUF files ----------------------------------------------------------------------------------
def _gguf_bytes(edit: Callable[[bytes], bytes]) -> Fault:
    def fault(f: Path) -> None:
        f.write_bytes(edit(f.read_bytes()))
    return fault


GGUF_FAULTS: dict[str, tuple[Fault, str | Expect]] = {
    "empty": (_gguf_bytes(lambda b: b""), "not a readable GGUF file"),
    # cut inside the metadata (gguf-py parses a 49152-entry vocabulary slowly: a cut past it
    # costs seconds per command, and exercises nothing more)
    "truncated": (_gguf_bytes(lambda b: b[:65536]), "not a readable GGUF file"),
    "bad-magic": (_gguf_bytes(lambda b: b"GGUX" + b[4:]), "not a readable GGUF file"),
    "random-bytes": (_gguf_bytes(lambda b: bytes(range(256)) * 64), "not a readable GGUF file"),
}
GGUF_COMMANDS: dict[str, CommandLine] = {
    "verify": lambda ws, f: ["verify", f],
    "inspect": lambda ws, f: ["inspect", f],
    "verify-source": lambda ws, f: ["verify", f, "--source", ws.model()],
    "convert": lambda ws, f: ["convert", f, ws.dst, "--to", "gptq"],
    "eval-quant": lambda ws, f: ["eval", f, "--reference", ws.model(), *EVAL_SMALL],
}
# a GGUF file is not a checkpoint directory: convert and eval say so, whatever its bytes
GGUF_OVERRIDES = {(f, c): "is not a directory" for f in GGUF_FAULTS
                  for c in ("convert", "eval-quant")}


# -- calibration and held-out text ---------------------------------------------------------------
def _calib(name: str, data: str | bytes | None) -> Callable[[Path], Path]:
    """Replace the (absent) calibration path with a file ``name`` holding ``data``."""
    def fault(where: Path) -> Path:
        path = where.parent / name
        if data is None:  # a directory with nothing usable in it
            path.mkdir()
            (path / "notes.md").write_text("not calibration text")
        elif isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
        return path
    return fault


def _fifo(name: str) -> Callable[[Path], Path]:
    """Replace the calibration path with a named pipe ``name`` that no process writes to."""
    def fault(where: Path) -> Path:
        path = where.parent / name
        os.mkfifo(path)
        return path
    return fault


CALIB_FAULTS: dict[str, tuple[Fault, str | Expect]] = {
    "missing": (lambda p: p.parent / "none.txt", "does not exist"),
    "empty-txt": (_calib("c.txt", ""), "calibration text is too short"),
    "too-short-txt": (_calib("c.txt", "Too short."), "calibration text is too short"),
    "jsonl-no-text-field": (_calib("c.jsonl", '{"txt": "wrong field"}\n'), "field 'text'"),
    "jsonl-text-a-number": (_calib("c.jsonl", '{"text": 5}\n'), "field 'text'"),
    "jsonl-not-json": (_calib("c.jsonl", "{nope\n"), "not valid JSON"),
    "jsonl-not-utf8": (_calib("c.jsonl", b'{"text": "caf\xe9"}\n'), "not UTF-8"),
    "empty-directory": (_calib("cdir", None), "holds no .txt or .jsonl"),
    "wrong-suffix": (_calib("c.csv", "a,b\n"), "must be .txt or .jsonl"),
    # a named pipe nobody writes to: reading it would block until the command is killed
    "fifo": (_fifo("c.txt"), "is not a regular file"),
}
CALIB_COMMANDS: dict[str, CommandLine] = {
    "gptq": lambda ws, c: ["gptq", ws.model(), ws.dst, *TINY_CALIB, "--calib", c],
    "tinygemm": lambda ws, c: ["tinygemm", ws.model(), ws.dst, *TINY_CALIB, "--calib", c],
    "export-phone": lambda ws, c: ["export-phone", ws.model(), ws.dst, "--backend", "qnn",
                                   "--max-seq-len", "64", "--calib", c],
    "eval-text": lambda ws, c: ["eval", ws.artifact(), "--reference", ws.model(), *EVAL_SMALL,
                                "--text", c],
}
CALIB_OVERRIDES = {("missing", "eval-text"): "does not exist",
                   ("empty-txt", "eval-text"): "too short",
                   ("too-short-txt", "eval-text"): "too short",
                   ("empty-txt", "export-phone"): "too short",
                   ("too-short-txt", "export-phone"): "too short"}


# -- option values -------------------------------------------------------------------------------
def _opts(command: str, *args: str, source: str = "model") -> Callable[[Workspace], list]:
    def build(ws: Workspace) -> list:
        if command in ("gptq", "tinygemm"):
            return [command, ws.model(), ws.dst, *args]
        if command == "export-phone":
            return [command, ws.model(), ws.dst, *args]
        if command == "eval":
            return [command, ws.artifact(), "--reference", ws.model(), *args]
        if command == "convert":
            return [command, ws.artifact(), ws.dst, *args]
        return [command, *args]
    return build


def _incomplete_logits(ws: Workspace) -> Path:
    """A file that says it was written by --save-reference and holds none of its tensors."""
    import torch

    from cpu_quant.core.io.safetensors_writer import write_safetensors
    from cpu_quant.eval.reference_logits import FORMAT

    path = ws.root / "logits.safetensors"
    write_safetensors(path, {"x": torch.zeros(1)}, metadata={"format": FORMAT})
    return path


QUANTIZE_OPTION_FAULTS = {
    "batch-size-0": (["--batch-size", "0"], "--batch-size must be >= 1"),
    "batch-size-negative": (["--batch-size", "-2"], "--batch-size must be >= 1"),
    "samples-0": (["--samples", "0"], "--samples must be >= 1"),
    "seqlen-1": (["--seqlen", "1"], "--seqlen must be >= 2"),
    "seqlen-beyond-context": (["--seqlen", "2048"],
                              "--seqlen 2048 is beyond the model's context of 1024"),
    "group-96": (["--group", "96"], "--group must be one of"),
    "group-0": (["--group", "0"], "--group must be one of"),
    "head-group-96": (["--head-group", "96"], "--head-group must be one of"),
    "head-group-not-dividing": (["--group", "32", "--head-group", "128", "--strict-group"],
                                "--head-group 128 does not divide"),
    "group-not-dividing": (["--group", "128", "--strict-group", "--samples", "2", "--seqlen",
                            "32"], "--strict-group"),
    "damp-0": (["--damp", "0"], "--damp must be in (0, 1]"),
    "damp-2": (["--damp", "2"], "--damp must be in (0, 1]"),
    "gptq-without-data": (["--calib", "none"], "GPTQ needs calibration data"),
    "w4a8-hessians-rtn": (["--method", "rtn", "--w4a8-hessians"],
                          "--w4a8-hessians applies to --method gptq only"),
    "format-unknown": (["--format", "gptq,nope"], "nope"),
    "format-empty": (["--format", ""], "--format"),
    "quiet-and-verbose": (["-q", "-v"], "-q and -v contradict"),
    "threads-0": (["--threads", "0"], "Invalid value for '--threads'"),
    "samples-not-a-number": (["--samples", "many"], "Invalid value for '--samples'"),
    "method-unknown": (["--method", "awq"], "Invalid value for '--method'"),
    "unknown-option": (["--calib-decode-tokens", "8"], "No such option"),
    # refused before any rank starts: no processes to leave behind
    "nproc-1000": (["--nproc", "1000"], "--nproc 1000 is more than 4 ranks per CPU"),
    "nproc-beyond-batches": (["--nproc", "3", "--samples", "2", "--batch-size", "1"],
                             "3 ranks need at least 3 calibration batches, there are 2"),
}
# tinygemm writes one format: it has no --format
QUANTIZE_OPTION_NOT_TINYGEMM = {"format-unknown", "format-empty"}

OPTION_CASES = [
    *[Case(f"option-{name}-{command}", _opts(command, *args, *(
        ["--no-eval"] if command in ("gptq", "tinygemm") else [])), needle)
      for name, (args, needle) in QUANTIZE_OPTION_FAULTS.items()
      for command in ("gptq", "tinygemm")
      if not (command == "tinygemm" and name in QUANTIZE_OPTION_NOT_TINYGEMM)],
    *[Case(f"option-{name}-eval", _opts("eval", *args), needle) for name, args, needle in (
        ("windows-0", ["--windows", "0"], "--windows must be >= 1"),
        ("prompts-0", ["--prompts", "0"], "--prompts must be >= 1"),
        ("new-tokens-0", ["--new-tokens", "0"], "--new-tokens must be >= 1"),
        ("seqlen-1", ["--seqlen", "1"], "--seqlen must be >= 2"),
        ("seqlen-beyond-context", ["--seqlen", "2048"], "--seqlen 2048 is beyond"),
        ("reference-and-logits", ["--reference-logits", "x.safetensors"],
         "give --reference or --reference-logits, not both"),
        ("quiet-and-verbose", ["-q", "-v"], "-q and -v contradict"),
    )],
    Case("option-no-reference-eval", lambda ws: ["eval", ws.artifact()],
         "give --reference SRC"),
    Case("option-nothing-to-score-eval", lambda ws: ["eval", "--reference", ws.model()],
         "give QUANT"),
    Case("option-logits-and-save-eval",
         lambda ws: ["eval", ws.artifact(), "--reference-logits", ws.file("x.st", "x"),
                     "--save-reference", ws.root / "y.st"], "--save-reference needs"),
    Case("option-reference-logits-missing-eval",
         lambda ws: ["eval", ws.artifact(), "--reference-logits", ws.root / "none.st",
                     *EVAL_SMALL], "is not a file"),
    Case("option-reference-logits-garbage-eval",
         lambda ws: ["eval", ws.artifact(), "--reference-logits", ws.file("x.st", "garbage"),
                     *EVAL_SMALL], "--reference-logits"),
    Case("option-reference-logits-a-model-eval",
         lambda ws: ["eval", ws.artifact(), "--reference-logits",
                     ws.model() / "model.safetensors", *EVAL_SMALL],
         "not a file written by --save-reference"),
    Case("option-reference-logits-incomplete-eval",
         lambda ws: ["eval", ws.artifact(), "--reference-logits", _incomplete_logits(ws),
                     *EVAL_SMALL], "is not a whole file written by --save-reference"),
    *[Case(f"option-{name}-export-phone", _opts("export-phone", *args), needle)
      for name, args, needle in (
          ("calib-samples-negative", ["--calib-samples", "-1"], "--calib-samples must be >= 0"),
          ("max-seq-len-1", ["--max-seq-len", "1"], "--max-seq-len must be at least 2"),
          ("max-seq-len-beyond-context", ["--backend", "xnnpack", "--max-seq-len", "4096"],
           "--max-seq-len 4096 is beyond the model's context of 1024"),
          ("prefill-len-0", ["--prefill-len", "0"], "--prefill-len must be >= 1"),
          ("scheme-unknown", ["--backend", "xnnpack", "--scheme", "int2"], "int2"),
          ("scheme-of-the-other-backend", ["--backend", "qnn", "--scheme", "8da8w"],
           "--backend qnn supports --scheme"),
          ("group-size-odd", ["--backend", "xnnpack", "--scheme", "8da4w", "--group-size", "3",
                              "--max-seq-len", "64"], "--group must be one of 32, 64, 128"),
          ("group-size-not-dividing", ["--backend", "xnnpack", "--scheme", "8da4w",
                                       "--group-size", "48", "--max-seq-len", "64"],
           "--group must be one of 32, 64, 128"),
          ("backend-unknown", ["--backend", "npu"], "Invalid value for '--backend'"),
      )],
    Case("option-target-unknown-convert", _opts("convert", "--to", "awq"),
         "Invalid value for '--to'"),
    Case("option-no-target-convert", _opts("convert"), "Missing option '--to'"),
    Case("option-hub-id-not-cached-gptq",
         lambda ws: ["gptq", "nobody-xyz/not-cached-model", ws.dst, *RTN],
         "cpu-quant does not download"),
    Case("option-unknown-command", lambda ws: ["quantize", ws.model()], "No such command"),
]


# -- probe's recorded machine files ----------------------------------------------------------------
PROBE_CASES = [
    Case("probe-cpuinfo-missing", lambda ws: ["probe", "--cpuinfo", ws.root / "none"],
         "cannot read"),
    Case("probe-cpuinfo-empty", lambda ws: ["probe", "--cpuinfo", ws.file("cpuinfo", "")],
         "the cpuinfo text is empty"),
    Case("probe-cpuinfo-a-directory",
         lambda ws: ["probe", "--cpuinfo", ws.file("d/x", "").parent], "is a directory"),
    Case("probe-cpuinfo-binary",
         lambda ws: ["probe", "--cpuinfo", ws.file("cpuinfo", bytes(range(256)) * 16)],
         "cpuinfo"),
    Case("probe-cpuinfo-a-fifo", lambda ws: ["probe", "--cpuinfo", _fifo("cpuinfo")(ws.root / "x")],
         "not a regular file"),
    Case("probe-priority-unknown", lambda ws: ["probe", "--priority", "size"],
         "Invalid value for '--priority'"),
]


CASES: list[Case] = [
    *crossed("model", lambda ws: ws.model(), MODEL_FAULTS, MODEL_COMMANDS, MODEL_OVERRIDES),
    *crossed("artifact", lambda ws: ws.artifact(), ARTIFACT_FAULTS, ARTIFACT_COMMANDS,
             ARTIFACT_OVERRIDES),
    *destination_cases(),
    *EVAL_OUTPUT_CASES,
    *RESUME_CASES,
    *crossed("gguf", lambda ws: ws.gguf(), GGUF_FAULTS, GGUF_COMMANDS, GGUF_OVERRIDES),
    *crossed("calib", lambda ws: ws.root / "calib", CALIB_FAULTS, CALIB_COMMANDS,
             CALIB_OVERRIDES),
    *OPTION_CASES,
    *PROBE_CASES,
]


# -- the script ----------------------------------------------------------------------------------
def file_digests(root: Path) -> dict[str, str]:
    """Every path under ``root`` (links not followed) -> the SHA-256 of its bytes, its link
    target, or ``dir``."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[rel] = "dir"
        else:  # a FIFO of a case: never read (it would block)
            out[rel] = "special"
    return out


def tree_digest(root: Path) -> str:
    """One digest of :func:`file_digests`."""
    return hashlib.sha256(json.dumps(file_digests(root), sort_keys=True).encode()).hexdigest()


def write_corpus(out: Path, bases: Bases, cases: list[Case], run: bool = False) -> list[dict]:
    """Each case's hostile input in ``out/cases/<id>/`` with its ``case.json``, and the table
    ``out/cases.json``; with ``run``, each case run and its outcome printed and recorded."""
    table = []
    for case in cases:
        ws = Workspace(out / "cases" / case.id, bases)
        ws.root.mkdir(parents=True)
        argv = [str(a) for a in case.build(ws)]
        row = {"id": case.id, "argv": argv, "exit_code": case.exit_code, "needle": case.needle,
               "kind": case.kind}
        if run:
            result = invoke(argv)
            lines = result.error_lines if case.kind == "error" else \
                [ln for ln in result.stdout.splitlines() if ln.startswith("ERROR")]
            row["outcome"] = {"exit": result.exit_code, "lines": lines,
                              "seconds": result.seconds, "cpu_seconds": result.cpu_seconds,
                              "exception": repr(result.exception) if result.exception else None}
            ok = (result.exit_code == case.exit_code and not result.traceback
                  and any(case.needle in ln for ln in lines))
            print(f"{'ok ' if ok else 'BAD'} {case.id:<50} exit {result.exit_code} "
                  f"{result.seconds:5.2f}s {result.cpu_seconds:5.2f} CPU-s "
                  f"{(lines or [repr(result.exception)])[0][:150]}", flush=True)
        (ws.root / "case.json").write_text(json.dumps(row, indent=2) + "\n")
        table.append(row)
    (out / "cases.json").write_text(json.dumps(table, indent=2) + "\n")
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.hostile.generate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="directory to write the corpus to (must not exist)")
    ap.add_argument("--run", action="store_true", help="also run every case, print outcomes")
    ap.add_argument("--only", default="", help="only the cases whose id contains this")
    ap.add_argument("--skip", default=None, help="leave out the cases whose id contains this")
    opts = ap.parse_args(argv)
    if opts.out.exists():
        ap.error(f"{opts.out} already exists")
    cases = [c for c in CASES if opts.only in c.id and not (opts.skip and opts.skip in c.id)]
    table = write_corpus(opts.out, build_bases(opts.out / "bases"), cases, opts.run)
    print(f"{len(table)} cases -> {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
