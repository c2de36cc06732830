"""GGUF of llama.cpp's file types (``gguf:q4_k_m``, ``gguf:q4_k_s``, ``gguf:iq4_nl``): the
per-tensor type mix held to llama.cpp's own files, and a written file read back by gguf-py
bit for bit, checked by ``verify`` and summarised by ``inspect``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from cpu_quant.core.errors import CpuQuantError
from cpu_quant.core.io.checkpoint import open_checkpoint
from cpu_quant.formats import get_format
from cpu_quant.formats.gguf import reader as gguf_reader
from cpu_quant.formats.gguf.architectures import arch_spec
from cpu_quant.formats.gguf.mix import use_more_bits
from cpu_quant.models.tiny import TinyShape, make_tiny_model
from cpu_quant.quantize.block_fit import quantize_block_rtn
from cpu_quant.quantize.plan import check_own_grids
from tests.helpers.gguf_rtn import LAYER, feed, info_for

LEAVES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _llama_config(layers: int, hidden: int, ff: int, heads: int, kv: int, tied: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": ff, "num_attention_heads": heads,
            "num_key_value_heads": kv, "tie_word_embeddings": tied}


def _mix(fmt_name: str, cfg: dict, in_features: dict[str, int], head: bool,
         calibrated: bool = True) -> dict[str, str]:
    """GGUF-ish key (``blk.i.<leaf>``, ``token_embd``, ``output``) -> the type we write."""
    fmt = get_format(fmt_name)
    out = {}
    for i in range(cfg["num_hidden_layers"]):
        for leaf in LEAVES:
            out[f"{i}.{leaf}"] = fmt.tensor_type(f"model.layers.{i}.{leaf}", in_features[leaf],
                                                 cfg, calibrated).name
    out["token_embd"] = fmt.tensor_type("model.embed_tokens", cfg["hidden_size"], cfg,
                                        calibrated).name
    if head:
        out["output"] = fmt.tensor_type("lm_head", cfg["hidden_size"], cfg, calibrated).name
    return out


def _llama2_7b() -> tuple[dict, dict[str, int]]:
    cfg = _llama_config(32, 4096, 11008, 32, 32, tied=False)
    k = {leaf: 4096 for leaf in LEAVES} | {"mlp.down_proj": 11008}
    return cfg, k


def test_q4_k_m_and_q4_k_s_of_a_32_layer_llama_count_as_llama_cpps() -> None:
    """llama.cpp's loader summary of its own files of Llama-2-7B (32 layers, untied, no GQA):
    Q4_K_M ``q4_K: 193, q6_K: 33``, Q4_K_S ``q4_K: 217, q5_K: 8, q6_K: 1`` (plus 65 f32
    norms), the embedding and the head included."""
    cfg, k = _llama2_7b()
    assert Counter(_mix("gguf:q4_k_m", cfg, k, head=True).values()) == {"Q4_K": 193, "Q6_K": 33}
    assert Counter(_mix("gguf:q4_k_s", cfg, k, head=True).values()) == {"Q4_K": 217, "Q5_K": 8,
                                                                        "Q6_K": 1}
    mix = _mix("gguf:q4_k_m", cfg, k, head=True)
    more = [i for i in range(32) if mix[f"{i}.self_attn.v_proj"] == "Q6_K"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert more == [i for i in range(32) if mix[f"{i}.mlp.down_proj"] == "Q6_K"]
    assert mix["output"] == "Q6_K" and mix["token_embd"] == "Q4_K"


# llama.cpp's own Q4_K_M of Gemma 3 270M (general.file_type 15; 18 layers, 4 heads, 1 KV head,
# hidden 640, head_dim 256, tied head), its tensor types as gguf-py read them
GEMMA3_270M_Q4_K_M = {
    "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_output": "Q4_K", "ffn_gate": "Q5_0",
    "ffn_up": "Q5_0", "token_embd": "Q8_0",
    "attn_v Q8_0 layers": [0, 1, 4, 7, 10, 13, 15, 16, 17],  # the others Q5_0
    "ffn_down Q6_K layers": [0, 1, 4, 7, 10, 13, 15, 16, 17],  # the others Q4_K
}


def test_q4_k_m_of_gemma_3_270m_is_llama_cpps() -> None:
    """Rows not whole super-blocks of 256 (640) fall back (Q4_K to Q5_0, Q6_K to Q8_0); the
    tied embedding takes the head's type, Q8_0 as its rows are not whole blocks either."""
    cfg = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 18, "hidden_size": 640,
           "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
           "head_dim": 256, "tie_word_embeddings": True}
    k = {leaf: 640 for leaf in LEAVES} | {"self_attn.o_proj": 1024, "mlp.down_proj": 2048}
    mix = _mix("gguf:q4_k_m", cfg, k, head=False)
    want = GEMMA3_270M_Q4_K_M
    gguf_leaf = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
                 "mlp.up_proj": "ffn_up"}
    for i in range(18):
        for leaf, name in gguf_leaf.items():
            assert mix[f"{i}.{leaf}"] == want[name], (i, leaf)
        v_type = "Q8_0" if i in want["attn_v Q8_0 layers"] else "Q5_0"
        down_type = "Q6_K" if i in want["ffn_down Q6_K layers"] else "Q4_K"
        assert mix[f"{i}.self_attn.v_proj"] == v_type, i
        assert mix[f"{i}.mlp.down_proj"] == down_type, i
    assert mix["token_embd"] == want["token_embd"]


def test_iq4_nl_rules() -> None:
    """IQ4_NL: ``attn_v`` takes Q5_K with 4 or more heads per KV head; the first eighth of
    ``ffn_down`` takes Q5_K without an importance matrix only (a data-free run); the head Q6_K."""
    cfg = _llama_config(16, 2048, 8192, 32, 8, tied=False)  # GQA 4
    k = {leaf: 2048 for leaf in LEAVES} | {"mlp.down_proj": 8192}
    calibrated = _mix("gguf:iq4_nl", cfg, k, head=True)
    data_free = _mix("gguf:iq4_nl", cfg, k, head=True, calibrated=False)
    assert all(calibrated[f"{i}.self_attn.v_proj"] == "Q5_K" for i in range(16))
    assert all(calibrated[f"{i}.mlp.down_proj"] == "IQ4_NL" for i in range(16))
    assert [data_free[f"{i}.mlp.down_proj"] for i in range(3)] == ["Q5_K", "Q5_K", "IQ4_NL"]
    assert calibrated["output"] == "Q6_K" and calibrated["token_embd"] == "IQ4_NL"
    no_gqa = _llama_config(16, 2048, 8192, 32, 16, tied=False)
    assert _mix("gguf:iq4_nl", no_gqa, k, head=False)["0.self_attn.v_proj"] == "IQ4_NL"


def test_use_more_bits_is_llama_cpps_integer_arithmetic() -> None:
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23,
                                                              26, 27, 28, 29]


def test_rows_of_no_whole_block_are_refused_in_one_line() -> None:
    cfg, _ = _llama2_7b()
    with pytest.raises(CpuQuantError, match="not whole blocks of 32"):
        get_format("gguf:iq4_nl").tensor_type("model.layers.0.mlp.up_proj", 100, cfg, True)


def test_a_type_mix_format_is_written_alone() -> None:
    with pytest.raises(CpuQuantError, match="in a run of its own"):
        check_own_grids([get_format("gguf:q4_k_m"), get_format("gptq")])
    with pytest.raises(CpuQuantError, match="by one process"):
        check_own_grids([get_format("gguf:q4_k_s")], processes=2)
    check_own_grids([get_format("gguf:q4_k_m")])
    check_own_grids([get_format("gptq"), get_format("gguf")], processes=2)


@pytest.mark.parametrize("args, message", [
    (["--format", "gguf:q4_k_m,gptq"], "in a run of its own"),
    (["--format", "gguf:iq4_nl", "--nproc", "2"], "by one process"),
])
def test_the_command_refuses_in_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    from tests.conftest import run_cli

    proc = run_cli("gptq", str(tmp_path / "missing-src"), str(tmp_path / "out"), *args,
                   check=False, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


# -- a written file ------------------------------------------------------------------------------
SHAPE = TinyShape(hidden=256, intermediate=256, layers=2, heads=4, kv_heads=1, tied=False)


@pytest.fixture
def one_thread():
    """The quantizer fits grids on one thread per worker (schedule.quantize_linears)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def k_model(demo_src: Path, tmp_path_factory) -> Path:
    """A tiny untied Llama whose rows are whole super-blocks (256), with GQA 4, and the demo
    tokenizer's first 1024 tokens (the whole vocabulary's GGUF metadata was most of these
    tests' time)."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("kmix") / "src", demo_src,
                           vocab=1024, shape=SHAPE)


def _write(fmt_name: str, src: Path, dst: Path) -> tuple[Path, dict, dict]:
    """Every linear on the format's grid (round-to-nearest with the fitted grid: the sink sees
    what GPTQ hands it, a BlockQuant), the rest as floats (the head too)."""
    fmt = get_format(fmt_name)
    cfg = json.loads((src / "config.json").read_text())
    ckpt = open_checkpoint(src)
    quant, floats = {}, {}
    for name in ckpt.names:
        t = ckpt.tensor(name)
        if name.endswith("_proj.weight") and LAYER.match(name):
            module = name.removesuffix(".weight")
            quant[module] = quantize_block_rtn(t, fmt.tensor_grid(module, t.shape[1], cfg, True))
        else:
            floats[name] = t
    n = cfg["num_hidden_layers"]
    sink = fmt.open_sink(dst, n, None)
    feed(sink, quant, floats, n)
    sink.finish(info_for(src, cfg, 128, False))
    return next(dst.glob("*.gguf")), quant, cfg


@pytest.mark.e2e
@pytest.mark.parametrize("fmt_name", ["gguf:q4_k_m", "gguf:q4_k_s", "gguf:iq4_nl"])
def test_every_tensor_matches_gguf_py_and_reads_back(k_model: Path, tmp_path: Path,
                                                     fmt_name: str, one_thread) -> None:
    fmt = get_format(fmt_name)
    path, quant, cfg = _write(fmt_name, k_model, tmp_path)
    assert path.name == f"src{fmt.file_suffix}" and fmt.file_suffix.endswith(".gguf")
    reader = gguf.GGUFReader(path)
    assert reader.get_field("general.file_type").contents() == int(fmt.llama_file_type)
    spec = arch_spec(cfg)
    modules = gguf_reader._hf_module_names(spec, cfg["num_hidden_layers"])
    back = gguf_reader.unpack(path)
    seen = Counter()
    for t in reader.tensors:
        module = modules.get(t.name)
        if module not in quant:
            continue
        want = fmt.tensor_type(module, quant[module].shape[1], cfg, True)
        assert t.tensor_type == want, t.name
        theirs = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type))
        theirs = gguf_reader._undo_rows(spec, cfg, module, theirs)
        ours = quant[module].dequantize()
        assert torch.equal(theirs.view(torch.int32), ours.view(torch.int32)), t.name
        assert torch.equal(back[module].codes, quant[module].codes), t.name
        assert torch.equal(back[module].dequantize().view(torch.int32), ours.view(torch.int32))
        seen[t.tensor_type.name] += 1
    assert sum(seen.values()) == len(quant) == 7 * SHAPE.layers
    assert len(seen) >= 2  # more than one type in every mix of this model
    assert [f for f in gguf_reader.verify(path, cfg) if f.severity == "error"] == []
    summary = gguf_reader.inspect(path)
    assert summary["file_type"] == fmt.file_type.name
    assert set(seen) <= set(summary["types"])


def test_a_non_finite_block_scale_is_refused(k_model: Path, tmp_path: Path, one_thread) -> None:
    path, _, cfg = _write("gguf:q4_k_m", k_model, tmp_path)
    reader = gguf.GGUFReader(path)
    t = next(t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_K)
    data = bytearray(path.read_bytes())
    off = int(t.data_offset)
    data[off:off + 2] = np.array([np.inf], dtype=np.float16).tobytes()  # the first d
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    errors = [f for f in gguf_reader.verify(bad, cfg) if f.severity == "error"]
    assert [f.check for f in errors] == ["gguf-scale"] and t.name == errors[0].tensor


@pytest.mark.e2e
def test_a_calibrated_run_writes_every_tensor_on_its_type(tiny_llama: Path, tmp_path: Path) -> None:
    """``cpu-quant gptq --format gguf:q4_k_m`` on the tiny model (tied head, K = 64 and 128:
    the mix falls back to Q5_0 and Q8_0): the plan gives every tensor its type, and every
    tensor reads back through gguf-py as our unpack does. The file is tied, as llama.cpp's own
    of a tied model: one ``token_embd`` on the type llama.cpp gives it, which is the
    GPTQ-quantized head (no ``output``, no embedding quantized apart, no smoothing fold into
    the head)."""
    from cpu_quant.core.smoothing_factors import load_factors
    from tests.conftest import run_cli

    dst = tmp_path / "out"
    run_cli("gptq", str(tiny_llama), str(dst), "--samples", "4", "--seqlen", "32", "--no-eval",
            "--format", "gguf:q4_k_m", timeout=900)
    fmt = get_format("gguf:q4_k_m")
    path = dst / f"{tiny_llama.name}-Q4_K_M.gguf"
    cfg = json.loads((tiny_llama / "config.json").read_text())
    modules = gguf_reader._hf_module_names(arch_spec(cfg), cfg["num_hidden_layers"])
    back = gguf_reader.unpack(path)
    modules["token_embd.weight"] = "lm_head"  # the head, as the tied embedding
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    assert fmt.tensor_type("lm_head", cfg["hidden_size"], cfg, True) == fmt.tensor_type(
        "model.embed_tokens", cfg["hidden_size"], cfg, True)
    seen = Counter()
    for t in gguf.GGUFReader(path).tensors:
        if t.name not in modules:
            continue
        assert t.tensor_type == fmt.tensor_type(modules[t.name], int(t.shape[0]), cfg, True)
        seen[t.tensor_type.name] += 1
        if modules[t.name] in back:
            theirs = torch.from_numpy(gguf.quants.dequantize(np.array(t.data), t.tensor_type))
            theirs = gguf_reader._undo_rows(arch_spec(cfg), cfg, modules[t.name], theirs)
            ours = back[modules[t.name]].dequantize()
            assert torch.equal(theirs.view(torch.int32), ours.view(torch.int32)), t.name
    n = cfg["num_hidden_layers"]
    assert sum(seen.values()) == 7 * n + 1  # the linears, and the head as the embedding
    assert set(seen) == {"Q5_0", "Q8_0"} and "lm_head" in back
    assert [f for f in gguf_reader.verify(path, cfg) if f.severity == "error"] == []
    report = json.loads((dst / f"{tiny_llama.name}-Q4_K_M.quantization_report.json").read_text())
    groups = {t["name"]: t["group_size"] for t in report["tensors"]}
    assert groups["lm_head"] == 32 and "model.embed_tokens" not in groups
    factors = load_factors(dst)
    # a fold into the head divides the final norm (the key); a Q4_0 run of this model has it
    assert factors is not None and "model.norm.weight" not in factors, sorted(factors)


# -- e2e: the demo model in real llama.cpp ---------------------------------------------------------
def _torch_model_from_gguf(path: Path, src: Path):
    """The source model in float32 holding exactly the file's weights: every quantized tensor
    dequantized (our unpack, rope rows undone), the norms as stored (smoothing folded in), the
    head from ``output`` when the file has one (then untied from the embedding)."""
    from transformers import AutoModelForCausalLM

    reader = gguf.GGUFReader(path)
    spec, cfg = gguf_reader._reader_config(reader)
    names = gguf.get_tensor_name_map(spec.arch, cfg["num_hidden_layers"])
    tensors = {t.name: t for t in reader.tensors}
    modules = gguf_reader.unpack(path)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if "output.weight" in tensors:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    state = {}
    for hf, param in model.state_dict().items():
        module = hf.removesuffix(".weight")
        if module in modules:
            state[hf] = modules[module].dequantize()
            continue
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        t = tensors.get(gname)
        if t is None:
            continue  # rotary buffers
        w = gguf.quants.dequantize(np.array(t.data), t.tensor_type)
        state[hf] = torch.from_numpy(np.ascontiguousarray(w)).reshape(param.shape).float()
    missing = [n for n in model.state_dict() if n not in state and "rotary" not in n]
    assert not missing, missing
    model.load_state_dict(state, strict=False)
    return model.eval()


@pytest.fixture(scope="module")
def demo_type_mix_files(demo_src: Path, artifacts_dir: Path) -> dict[str, Path]:
    """Calibrated GPTQ of the demo model (head quantized) written as Q4_K_M and as IQ4_NL: the
    demo model's two runs of this tier. What the test checks, llama.cpp computing the file's
    own weights, does not depend on the calibration's size or on smoothing, so both are cut to
    what keeps the tier short: 4 x 128 tokens, no smoothing (on a loaded 2-core AVX2 machine the
    small calibration with smoothing took about 510 s per file; 4 x 128 tokens 257 s, of which
    62 s were the smoothing choice)."""
    from tests.conftest import build_once, run_cli

    out = {}
    for name in ("gguf:q4_k_m", "gguf:iq4_nl"):
        dst = artifacts_dir / f"demo-{name.replace(':', '-')}"
        build_once(dst, lambda dst=dst, name=name: run_cli(
            "gptq", str(demo_src), str(dst), "--samples", "4", "--seqlen", "128", "--no-smooth",
            "--no-eval", "--format", name))
        out[name] = next(dst.glob("*.gguf"))
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("fmt_name", ["gguf:q4_k_m", "gguf:iq4_nl"])
def test_llama_cpp_runs_our_type_mix_file_of_the_demo_model(demo_type_mix_files, demo_src: Path,
                                                            tmp_path: Path, fmt_name: str) -> None:
    """llama.cpp loads our Q4_K_M and IQ4_NL files of the demo model, generates greedily, and
    its logits agree with torch holding the file's dequantized weights: top-1 agreement >= 0.9
    and mean KL(torch || llama.cpp) < 0.05 nats, the tolerance of the Q4_0 file's test and for
    the same reason (llama.cpp quantizes the activations to 8 bits before each quantized dot
    product; a wrong bit order, scale or type would cost far more). Greedy generation: eight
    tokens, the first the same as torch's (a near-tie may flip a later one and its sequel)."""
    from tests.conftest import REPO
    from tests.formats.test_gguf import LOGITS_SCRIPT, _llama_cpp_python

    py = _llama_cpp_python()
    if py is None:
        pytest.skip("llama-cpp-python peer venv not built (python -m benchmarks.peers.llama_cpp_env)")
    path = demo_type_mix_files[fmt_name]
    fmt = get_format(fmt_name)
    assert path.name.endswith(fmt.file_suffix)
    assert [f for f in gguf_reader.verify(path) if f.severity == "error"] == []
    types = gguf_reader.inspect(path)["types"]
    cfg = json.loads((demo_src / "config.json").read_text())
    modules = gguf_reader._hf_module_names(arch_spec(cfg), cfg["num_hidden_layers"])
    modules["token_embd.weight"] = "model.embed_tokens"
    for t in gguf.GGUFReader(path).tensors:  # every tensor on the type llama.cpp gives it
        if t.name in modules:
            assert t.tensor_type == fmt.tensor_type(modules[t.name], int(t.shape[0]), cfg,
                                                    True), t.name
    tokens = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018,
              411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 10576, 1601, 260, 2914, 282, 4649, 47]
    out = tmp_path / "logits.npy"
    import subprocess

    proc = subprocess.run([str(py), "-c", LOGITS_SCRIPT, str(path), str(out), json.dumps(tokens),
                           str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    theirs = torch.from_numpy(np.load(out)).double()
    model = _torch_model_from_gguf(path, demo_src)
    with torch.no_grad():
        ours = model(torch.tensor([tokens])).logits[0].double()
        greedy = model.generate(torch.tensor([tokens[:8]]), max_new_tokens=8, do_sample=False,
                                pad_token_id=0)[0, 8:].tolist()
    p, q = torch.log_softmax(ours, -1), torch.log_softmax(theirs, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    top1 = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
    print(f"{fmt_name}: llama.cpp vs torch on the file's weights: KL {kl:.5f}, top-1 {top1:.3f}, "
          f"greedy {result['generated']} vs {greedy}, types {types}")
    assert result["n_vocab"] == model.config.vocab_size
    assert top1 >= 0.9 and kl < 0.05
    assert len(result["generated"]) == 8 and result["generated"][0] == greedy[0]
