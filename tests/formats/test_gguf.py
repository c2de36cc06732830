"""GGUF format: Q4_0 blocks held to gguf-py's dequantize, damaged files refused, resume exact.

Unit tier: tiny random models (tests/conftest.py) and hand-made GroupQuants. The e2e tier
(``-m e2e``) loads the demo model's GGUF in real llama.cpp (llama-cpp-python's peer venv).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from cpu_quant.core.errors import CpuQuantError
from cpu_quant.core.grid import GroupQuant
from cpu_quant.formats.gguf import architectures as gguf_architectures
from cpu_quant.formats.gguf import format as gguf_format
from cpu_quant.formats.gguf import q4_0 as gguf_q4_0
from cpu_quant.formats.gguf import reader as gguf_reader
from cpu_quant.formats.gguf import sink as gguf_sink
from cpu_quant.models.tiny import make_tiny_model
from tests.helpers.gguf_edit import copy_without_tensor
from tests.helpers.gguf_rtn import feed, info_for, rtn_results, write_gguf

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")
# the whole-file tests' models: the demo tokenizer cut to its first 1024 tokens (writing and
# parsing the demo's 49,152 tokens and 48,900 merges took most of these tests' time)
TINY_VOCAB = 1024


def random_gq(n: int, k: int, group: int, seed: int = 0, negative: bool = True) -> GroupQuant:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.05 + 1e-3
    if negative:
        scales = scales * torch.where(torch.rand(n, k // group, generator=g) < 0.5, -1.0, 1.0)
    return GroupQuant(codes, scales.to(torch.bfloat16).to(torch.float32), None, group)


def gguf_py_dequantize(blocks: torch.Tensor) -> np.ndarray:
    return gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_0)


# -- the blocks --------------------------------------------------------------------------------
@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_q4_0_blocks_match_gguf_py_bit_for_bit(group: int) -> None:
    gq = random_gq(48, 256, group)
    blocks = gguf_q4_0.pack_q4_0(gq)
    assert blocks.dtype == torch.uint8 and blocks.shape == (48, 256 // 32 * 18)
    ours = gq.dequantize().numpy()
    theirs = gguf_py_dequantize(blocks)
    assert theirs.dtype == np.float32 and np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    back = gguf_q4_0.unpack_q4_0(blocks)
    ref = gguf_q4_0.as_blocks_of_32(gq)
    assert back.group_size == 32
    assert torch.equal(back.codes, ref.codes) and torch.equal(back.scales, ref.scales)


def test_q4_0_nibble_order_is_j_and_j_plus_16() -> None:
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)
    codes[0, 16:] = 15 - codes[0, 16:]
    blocks = gguf_q4_0.pack_q4_0(GroupQuant(codes, torch.tensor([[0.5]]), None, 32))
    assert blocks[0, :2].view(torch.float16).item() == 0.5
    for j in range(16):
        assert blocks[0, 2 + j].item() == int(codes[0, j]) | (int(codes[0, j + 16]) << 4)


def test_negative_scales_survive() -> None:
    gq = random_gq(8, 64, 32, negative=True)
    assert (gq.scales < 0).any()
    back = gguf_q4_0.unpack_q4_0(gguf_q4_0.pack_q4_0(gq))
    assert torch.equal(back.scales, gq.scales)


@pytest.mark.parametrize("bad", [70000.0, 2.0 ** -20 * 1.5078125, float("inf")])
def test_scale_fp16_cannot_hold_is_refused(bad: float) -> None:
    gq = random_gq(4, 64, 32)
    gq.scales[2, 1] = torch.tensor(bad).to(torch.bfloat16).float()
    with pytest.raises(CpuQuantError, match=r"model.layers.0.mlp.up_proj: 1 scale\(s\) not exact in fp16"):
        gguf_q4_0.pack_q4_0(gq, "model.layers.0.mlp.up_proj")


def test_small_scale_exact_in_fp16_subnormals_is_kept() -> None:
    gq = random_gq(4, 64, 32)
    gq.scales[0, 0] = 2.0 ** -20  # one significant bit: an exact fp16 subnormal
    assert gguf_q4_0.unpack_q4_0(gguf_q4_0.pack_q4_0(gq)).scales[0, 0].item() == 2.0 ** -20


def test_rope_permutation_round_trips() -> None:
    rows = torch.arange(4 * 16 * 3).reshape(64, 3)
    perm = gguf_architectures.permute_rope_rows(rows, 4)
    assert not torch.equal(perm, rows) and torch.equal(gguf_architectures.unpermute_rope_rows(perm, 4), rows)
    # llama.cpp's order within a head: HF rows 0, 8, 1, 9, ... (interleaved halves)
    assert perm[:4, 0].tolist() == [0, 24, 3, 27]


# -- whole files ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_files(demo_src: Path, tmp_path_factory) -> dict[str, tuple[Path, dict, dict]]:
    """arch -> (gguf file, GroupQuants written, source config); group 128 where K allows."""
    out = {}
    for arch in ARCHS:
        base = tmp_path_factory.mktemp(arch)
        src = make_tiny_model(arch, base / "src", demo_src, vocab=TINY_VOCAB)
        path, quant, _ = write_gguf(src, base / "out", group=128)
        out[arch] = (path, quant, json.loads((src / "config.json").read_text()))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_q4_0_tensor_matches_gguf_py(tiny_files, arch: str) -> None:
    path, quant, cfg = tiny_files[arch]
    reader = gguf.GGUFReader(path)
    spec = gguf_architectures.arch_spec(cfg)
    modules = gguf_reader._hf_module_names(spec, cfg["num_hidden_layers"])
    seen = 0
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.Q4_0:
            continue
        theirs = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type))
        module = modules[t.name]
        theirs = gguf_reader._undo_rows(spec, cfg, module, theirs)
        ours = quant[module].dequantize()
        assert torch.equal(theirs.view(torch.int32), ours.view(torch.int32)), t.name
        seen += 1
    assert seen == len(quant) == 7 * cfg["num_hidden_layers"]
    assert [f for f in gguf_reader.verify(path, cfg) if f.severity == "error"] == []


@pytest.mark.parametrize("arch", ARCHS)
def test_unpack_reads_back_what_was_written(tiny_files, arch: str) -> None:
    path, quant, _ = tiny_files[arch]
    back = gguf_reader.unpack(path)
    assert set(back) == set(quant)
    for m, gq in quant.items():
        ref = gguf_q4_0.as_blocks_of_32(gq)
        assert torch.equal(back[m].codes, ref.codes) and torch.equal(back[m].scales, ref.scales), m


def test_our_reader_parses_what_gguf_py_parses(tiny_files) -> None:
    """verify, inspect and unpack open a file through gguf-py's parser over a plain view of
    the mapping: every field (its parts and types) and every tensor (name, type, shape,
    offset, bytes) is the one gguf-py's own reader gives."""
    from cpu_quant.formats.gguf.mapped import read_gguf

    path = tiny_files["llama"][0]
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    assert not isinstance(ours.data, np.memmap) and isinstance(theirs.data, np.memmap)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), name
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, list(mine.shape), mine.data_offset) == \
            (t.name, t.tensor_type, list(t.shape), t.data_offset)
        assert np.array_equal(mine.data, t.data), t.name


def test_metadata_follows_the_converter(tiny_files) -> None:
    path, _, cfg = tiny_files["gemma2"]
    r = gguf.GGUFReader(path)
    field = lambda k: r.get_field(k).contents()  # noqa: E731
    assert field("general.architecture") == "gemma2"
    assert field("gemma2.attention.key_length") == cfg["head_dim"]
    assert field("gemma2.attention.sliding_window") == cfg["sliding_window"]
    assert field("gemma2.final_logit_softcapping") == pytest.approx(cfg["final_logit_softcapping"])
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "smollm"
    assert len(field("tokenizer.ggml.tokens")) == cfg["vocab_size"]
    assert field("tokenizer.chat_template")
    names = {t.name for t in r.tensors}
    assert "output.weight" not in names and "blk.0.post_ffw_norm.weight" in names
    norm = next(t for t in r.tensors if t.name == "blk.0.attn_norm.weight")
    assert norm.tensor_type == gguf.GGMLQuantizationType.F32
    # Gemma's norm is stored as 1 + w (HF computes x * (1 + w)); random init has w = 0
    assert np.allclose(norm.data, 1.0)


def test_unsupported_architecture_is_one_line() -> None:
    with pytest.raises(CpuQuantError, match="architecture Phi3ForCausalLM is not supported"):
        gguf_architectures.arch_spec({"architectures": ["Phi3ForCausalLM"]})
    assert "not supported" in gguf_format.GGUFFormat().refuse_source({"architectures": ["Phi3ForCausalLM"]})


def test_inspect_summary(tiny_files) -> None:
    path, quant, _ = tiny_files["llama"]
    s = gguf_reader.inspect(path)
    assert s["architecture"] == "llama" and s["types"]["Q4_0"] == len(quant)
    assert s["layer_bits_per_weight"] == 4.5 and s["file_type"] == "Q4_0"
    assert s["file_bytes"] == path.stat().st_size


# -- damaged files -------------------------------------------------------------------------------
def _copy(path: Path, tmp_path: Path) -> Path:
    dst = tmp_path / path.name
    dst.write_bytes(path.read_bytes())
    return dst


def _errors(path: Path, cfg: dict | None = None) -> list[str]:
    return [f"{f.check}: {f.tensor}: {f.message}" for f in gguf_reader.verify(path, cfg)
            if f.severity == "error"]


def test_truncated_file_is_refused(tiny_files, tmp_path: Path) -> None:
    path = _copy(tiny_files["llama"][0], tmp_path)
    os.truncate(path, path.stat().st_size - 1000)
    errs = _errors(path)
    assert errs and any("truncated" in e or "unreadable" in e for e in errs), errs


def test_flipped_magic_is_refused(tiny_files, tmp_path: Path) -> None:
    path = _copy(tiny_files["llama"][0], tmp_path)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    assert any(e.startswith("gguf-magic") for e in _errors(path))


def test_missing_tensor_is_refused(tiny_files, tmp_path: Path) -> None:
    src, _, cfg = tiny_files["qwen3"]
    copy_without_tensor(src, tmp_path / "cut.gguf", "blk.1.attn_k_norm.weight")
    assert "gguf-tensor: blk.1.attn_k_norm.weight: missing" in _errors(tmp_path / "cut.gguf", cfg)


def test_non_finite_scale_is_refused(tiny_files, tmp_path: Path) -> None:
    path = _copy(tiny_files["llama"][0], tmp_path)
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_v.weight")
    with open(path, "r+b") as f:
        f.seek(int(t.data_offset))
        f.write(np.array([np.inf], dtype=np.float16).tobytes())
    assert any(e.startswith("gguf-scale: blk.0.attn_v.weight") for e in _errors(path))


# -- resume -----------------------------------------------------------------------------------
def test_resume_from_parts_is_byte_identical(demo_src: Path, tmp_path: Path) -> None:
    src = make_tiny_model("llama", tmp_path / "src", demo_src, vocab=TINY_VOCAB)
    quant, floats, cfg = rtn_results(src, 32, head_quantized=True)
    n = cfg["num_hidden_layers"]
    info = info_for(src, cfg, 32, True)

    whole = gguf_format.GGUFFormat().open_sink(tmp_path / "whole", n, None)
    feed(whole, quant, floats, n)
    whole.finish(info)

    first = gguf_format.GGUFFormat().open_sink(tmp_path / "resumed", n, None)
    feed(first, quant, floats, n, layers=range(1))
    state = json.loads(json.dumps(first.state()))  # what the resume point stores
    del first  # the crash
    again = gguf_format.GGUFFormat().open_sink(tmp_path / "resumed", n, state)
    feed(again, quant, floats, n, layers=range(1, n + 1))
    again.finish(info)

    a, b = (next((tmp_path / d).glob("*.gguf")) for d in ("whole", "resumed"))
    assert a.read_bytes() == b.read_bytes()
    assert not (tmp_path / "resumed" / gguf_sink.PARTS_DIR).exists()
    assert "output.weight" in {t.name for t in gguf.GGUFReader(b).tensors}
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == [
        "src-Q4_0.gguf", "src-Q4_0.quantization_report.json"]


# -- e2e: real llama.cpp -----------------------------------------------------------------------
LOGITS_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[4])
import numpy as np
from benchmarks.peers.llama_cpp_open import open_model
model, out, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = open_model(model, n_ctx=256, n_batch=256, logits_all=True, n_threads=2, seed=0,
                 verbose=False)
llm.eval(tokens)
logits = np.array(llm.scores[: len(tokens)], dtype=np.float32)
llm.reset()
gen = [t for _, t in zip(range(8), llm.generate(tokens[:8], temp=0.0))]
np.save(out, logits)
print(json.dumps({"generated": gen, "n_vocab": llm.n_vocab()}))
"""


def _llama_cpp_python() -> Path | None:
    from benchmarks.peers.llama_cpp_env import ready_env

    env = ready_env()
    return None if env is None else env.python


@pytest.mark.e2e
def test_llama_cpp_runs_our_gguf_of_the_demo_model(demo_formats: Path, tmp_path: Path) -> None:
    """llama.cpp loads the main job's GGUF (written by the same calibrated run as the GPTQ
    checkpoint), generates, and its logits agree with torch holding our dequantized weights.

    Tolerance: llama.cpp multiplies Q4_0 weights by activations it first quantizes to Q8_0
    (8 bits per block of 32), and its embedding is Q8_0 where the torch reference is bf16, so the
    two differ by more than float rounding. We ask top-1 agreement >= 0.9 and a mean KL(torch ||
    llama.cpp) below 0.05 nats: under half the KL the 4-bit linears cost against bf16 (about 0.1
    on held-out text), so a layout error (a wrong permutation, nibble order or scale) would
    exceed it by far; the test prints the measured values.
    """
    from cpu_quant.eval.dequantized import load_model
    from tests.conftest import REPO

    py = _llama_cpp_python()
    if py is None:
        pytest.skip("llama-cpp-python peer venv not built (python -m benchmarks.peers.llama_cpp_env)")
    path = next((demo_formats / "gguf").glob("*.gguf"))
    assert [f for f in gguf_reader.verify(path) if f.severity == "error"] == []
    tokens = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
              411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 10576, 1601, 260, 2914, 282, 4649, 47]

    out = tmp_path / "logits.npy"
    proc = subprocess.run([str(py), "-c", LOGITS_SCRIPT, str(path), str(out), json.dumps(tokens),
                           str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    theirs = torch.from_numpy(np.load(out)).double()

    model = load_model(demo_formats / "gptq", dtype=torch.float32)
    with torch.no_grad():
        ours = model(torch.tensor([tokens])).logits[0].double()
    p = torch.log_softmax(ours, -1)
    q = torch.log_softmax(theirs, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    print(f"llama.cpp vs torch on our weights: KL {kl:.5f}, top-1 {top1:.3f}, "
          f"generated {result['generated']}")
    assert result["n_vocab"] == model.config.vocab_size
    assert top1 >= 0.9 and kl < 0.05
    assert len(result["generated"]) == 8


@pytest.mark.e2e
def test_one_run_writes_the_same_codes_to_every_format(demo_formats: Path) -> None:
    """One calibrated run, three formats: the cpu_int4 tensors are bit-identical to converting
    the GPTQ output, and every GGUF Q4_0 block holds the GPTQ codes and scales (a group of 128
    as four blocks of 32)."""
    from safetensors import safe_open

    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.formats import get_format

    gptq, int4 = get_format("gptq"), get_format("cpu_int4")
    a, b = open_checkpoint(demo_formats / "gptq"), open_checkpoint(demo_formats / "cpu_int4")
    qa, qb = a.config["quantization_config"], b.config["quantization_config"]
    assert qa["dynamic"] == qb["dynamic"] and qa["lm_head"] == qb["lm_head"] is True
    modules = gptq.modules(a)
    assert modules == int4.modules(b) and len(modules) == 30 * 7 + 1
    from_gguf = gguf_reader.unpack(next((demo_formats / "gguf").glob("*.gguf")))
    for m in modules:
        ga = gptq.unpack(gptq.read_tensors(a, m), qa, m)
        gb = int4.unpack(int4.read_tensors(b, m), qb, m)
        assert torch.equal(ga.codes, gb.codes) and torch.equal(ga.scales, gb.scales), m
        assert gb.zeros is None
        expanded = gguf_q4_0.as_blocks_of_32(ga)
        assert torch.equal(from_gguf[m].codes, expanded.codes), m
        assert torch.equal(from_gguf[m].scales, expanded.scales), m
    rest = [n for n in a.names if n.rpartition(".")[2] not in gptq.suffixes]
    for n in rest:
        with safe_open(str(b.files[n]), "pt") as f:
            assert torch.equal(a.tensor(n), f.get_tensor(n)), n


# -- llama.cpp's commands: weight repacking off --------------------------------------------------
LLAMA_MODEL_TOOLS = r"llama-(?:cli|server|perplexity|imatrix|bench|run|simple|completion)"


def _docs_commands(text: str) -> list[str]:
    """The llama.cpp commands that run a model (``-m``) in a Markdown text's code."""
    import re

    code = re.findall(r"```[^\n]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    return [line.strip() for block in code for line in block.splitlines()
            if re.match(LLAMA_MODEL_TOOLS + r"\b.*\s-m\s", line.strip())]


def test_every_llama_cpp_command_turns_weight_repacking_off(tmp_path: Path) -> None:
    """The argv builder always carries --no-repack (llama.cpp crashes on AMX CPUs without it);
    so do the model card's command and every llama.cpp command in the README and docs; and
    every path to a llama.cpp tool that runs a model, in cpu_quant, benchmarks and tests, is
    handed straight to the builder."""
    import ast
    import re

    from cpu_quant.model_card import model_card_text
    from tests.conftest import REPO

    for tool in ("llama-cli", "llama-server", "llama-perplexity", "llama-imatrix"):
        argv = gguf_format.llama_cpp_command(tool, tmp_path / "m.gguf", "--kl-divergence")
        assert argv[:4] == [tool, "-m", str(tmp_path / "m.gguf"), "--no-repack"], argv
    card = model_card_text(tmp_path / "m-Q4_0.gguf", {"settings": {}}, tmp_path, "gguf")
    assert f"llama-cli -m {tmp_path / 'm-Q4_0.gguf'} --no-repack" in card
    assert "crashes (SIGSEGV)" in card  # and says why

    shown = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for command in _docs_commands(md.read_text()):
            shown.append(command)
            assert "--no-repack" in command, f"{md.name}: {command}"
    assert shown, "no llama.cpp command found in the docs: the scan is broken"

    unbuilt = []
    for path in [*(REPO / "cpu_quant").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py"),
                 *(REPO / "tests").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        built = {id(call.args[0]) for call in ast.walk(tree) if isinstance(call, ast.Call)
                 and getattr(call.func, "id", getattr(call.func, "attr", "")) == "llama_cpp_command"
                 and call.args}
        for node in ast.walk(tree):  # a tool's path: ... / "llama-perplexity"
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                    and isinstance(node.right, ast.Constant) and isinstance(node.right.value, str)
                    and re.fullmatch(LLAMA_MODEL_TOOLS, node.right.value)
                    and id(node) not in built):
                unbuilt.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not unbuilt, f"llama.cpp tools run without llama_cpp_command: {unbuilt}"


@pytest.mark.e2e
def test_the_llama_cpp_tools_accept_the_built_argv(hostile_bases, tmp_path: Path) -> None:
    """The real llama-perplexity and llama-imatrix (the peer build,
    ``python -m benchmarks.peers.llama_cpp_env --tools``) run the tiny model's GGUF with the
    argv :func:`llama_cpp_command` builds (an unknown option would end them with an error
    before any work)."""
    from benchmarks.peers.llama_cpp_env import ready_tools

    tools = ready_tools()
    if tools is None:
        pytest.skip("llama.cpp tools not built (python -m benchmarks.peers.llama_cpp_env --tools)")
    text = tmp_path / "text.txt"
    text.write_text(hostile_bases.calib.read_text())
    runs = {"llama-perplexity": ("-f", text, "-c", "64", "--chunks", "2", "-t", "1"),
            "llama-imatrix": ("-f", text, "-o", tmp_path / "imatrix.gguf", "-c", "64",
                              "--chunks", "2", "-t", "1", "--no-ppl")}
    for tool, args in runs.items():
        argv = gguf_format.llama_cpp_command(tools.path / "bin" / tool, hostile_bases.gguf, *args)
        assert "--no-repack" in argv
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (tool, proc.stderr[-2000:])
        assert "invalid argument" not in proc.stderr
