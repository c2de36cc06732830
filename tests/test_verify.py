"""cpu-quant verify / inspect on real artifacts and on broken copies of them, one defect each.

The good artifact is written by the real pipeline from the demo model (RTN, data-free, scale
search off: the checks are structural, and the search would only add minutes). Each broken copy
hard-links every file it does not change. The foreign artifacts under tests/fixtures/foreign
were written by GPTQModel 7.6.0 and by transformers 5.24 + optimum 2.3.0
(scripts/make_foreign_fixtures.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cpu_quant.cli.inspect import inspect as inspect_cmd
from cpu_quant.cli.verify import verify as verify_cmd
from cpu_quant.core.errors import CpuQuantError
from cpu_quant.formats.gptq.layout import pack_gptq_qzeros, unpack_gptq_qweight
from cpu_quant.verify import inspect_checkpoint, verify_checkpoint

FOREIGN = Path(__file__).parent / "fixtures" / "foreign"
INDEX = "model.safetensors.index.json"
Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="session")
def good(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's shared data-free RTN artifact when conftest has one, else built here.

    Tests never write into it: derive() writes edited files anew and hard-links the rest.
    """
    try:
        return request.getfixturevalue("rtn_plain_artifact")
    except pytest.FixtureLookupError:
        pass
    from cpu_quant.models.demo import demo_model_path
    from cpu_quant.quantize.pipeline import QuantSettings, quantize_checkpoint

    dst = tmp_path_factory.mktemp("verify") / "good"
    quantize_checkpoint(demo_model_path(), dst,
                        QuantSettings(method="rtn", calib="none", scale_search=False),
                        progress=False)
    return dst


def _shard_of(root: Path, tensor: str) -> str:
    return json.loads((root / INDEX).read_text())["weight_map"][tensor]


def derive(good: Path, dst: Path, *, config: Callable[[dict], None] | None = None,
           shards: dict[str, Callable[[Tensors], None]] | None = None) -> Path:
    """A copy of ``good`` with ``config`` and the named shards edited; the rest hard-linked."""
    shards = shards or {}
    dst.mkdir()
    for f in good.iterdir():
        if f.name == "config.json" and config is not None:
            data = json.loads(f.read_text())
            config(data)
            (dst / f.name).write_text(json.dumps(data))
        elif f.name in shards:
            tensors = load_file(str(f))
            shards[f.name](tensors)
            save_file(tensors, str(dst / f.name), metadata={"format": "pt"})
        else:
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copyfile(f, dst / f.name)
    if shards:  # keep the index true to the shards, so only the intended defect remains
        index = json.loads((good / INDEX).read_text())
        weight_map = {n: s for n, s in index["weight_map"].items() if s not in shards}
        for shard in shards:
            weight_map.update({n: shard for n in load_file(str(dst / shard))})
        index["weight_map"] = weight_map
        (dst / INDEX).unlink()
        (dst / INDEX).write_text(json.dumps(index))
    return dst


def run_verify(path: Path, *extra: str) -> tuple[int, str]:
    out = CliRunner().invoke(verify_cmd, [str(path), *extra])
    assert out.exception is None or isinstance(out.exception, SystemExit), out.output
    return out.exit_code, out.output


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("ERROR")]


# -- the good artifacts pass ----------------------------------------------------------------------
def test_good_artifact_passes(good: Path) -> None:
    code, output = run_verify(good)
    assert code == 0, output
    assert not error_lines(output)
    report = verify_checkpoint(good)
    assert report.ok and report.format == "gptq"
    assert report.zero_convention == "v1" and report.checkpoint_format == "gptq"
    assert report.quantized_modules == 30 * 7 + 1  # every decoder linear and the head


@pytest.mark.parametrize("name,convention", [
    ("gptqmodel_v1", "v1"), ("gptqmodel_v2", "v2"), ("transformers_v2", "v2")])
def test_foreign_artifacts_pass_with_the_right_convention(name: str, convention: str) -> None:
    path = FOREIGN / name
    code, output = run_verify(path)
    assert code == 0, output
    report = verify_checkpoint(path)
    assert report.zero_convention == convention
    assert report.quantized_modules == 2 * 7
    # they were written with the head left bf16: verify warns and states the cost
    warnings = [f for f in report.warnings if f.check == "head"]
    assert len(warnings) == 1 and "MB read every decode step" in warnings[0].message


def test_json_output_schema(good: Path) -> None:
    code, output = run_verify(good, "--json")
    assert code == 0
    doc = json.loads(output)
    assert doc["schema"] == "cpu-quant.verify/1"
    assert doc["ok"] is True and doc["errors"] == 0
    assert {"path", "format", "checkpoint_format", "zero_convention", "quantized_modules",
            "warnings", "findings"} <= doc.keys()
    for f in doc["findings"]:
        assert set(f) == {"severity", "check", "tensor", "message"}
        assert f["severity"] in ("error", "warning", "info")


# -- one defect each ------------------------------------------------------------------------------
def _all_qzeros_to(value: int) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        for name in [n for n in t if n.endswith(".qzeros")]:
            g, cols = t[name].shape
            t[name] = pack_gptq_qzeros(torch.full((g, cols * 8), value, dtype=torch.int64))
    return edit


def test_v2_zeros_under_a_v1_config(good: Path, tmp_path: Path) -> None:
    shards = {f.name: _all_qzeros_to(8) for f in good.glob("*.safetensors")}
    bad = derive(good, tmp_path / "bad", shards=shards)
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 1, output
    assert "zero-convention" in errors[0] and "the v2 convention" in errors[0]
    assert "checkpoint_format is 'gptq'" in errors[0] and "zero 9" in errors[0]
    assert verify_checkpoint(bad).zero_convention == "v2"


def test_v1_zeros_under_a_v2_config(good: Path, tmp_path: Path) -> None:
    bad = derive(good, tmp_path / "bad",
                 config=lambda c: c["quantization_config"].update(checkpoint_format="gptq_v2"))
    code, output = run_verify(bad)
    assert code == 1
    assert any("v1 convention" in e and "'gptq_v2'" in e and "zero 7" in e
               for e in error_lines(output)), output


def test_qzeros_not_matching_sym(good: Path, tmp_path: Path) -> None:
    target = "model.layers.5.mlp.down_proj.qzeros"

    def edit(t: Tensors) -> None:
        g, cols = t[target].shape
        zeros = torch.randint(0, 16, (g, cols * 8), generator=torch.Generator().manual_seed(0))
        t[target] = pack_gptq_qzeros(zeros)

    bad = derive(good, tmp_path / "bad", shards={_shard_of(good, target): edit})
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 1 and target in errors[0] and "not constant" in errors[0], output


def test_missing_head_tensors_while_config_claims_them(good: Path, tmp_path: Path) -> None:
    shard = _shard_of(good, "lm_head.qweight")

    def edit(t: Tensors) -> None:
        for name in [n for n in t if n.startswith("lm_head.")]:
            del t[name]

    bad = derive(good, tmp_path / "bad", shards={shard: edit})
    code, output = run_verify(bad)
    assert code == 1
    assert any("lm_head.qweight" in e and "lm_head is true" in e and "missing" in e
               for e in error_lines(output)), output


def test_bf16_head_is_a_warning_with_its_cost(good: Path, tmp_path: Path) -> None:
    shard = _shard_of(good, "lm_head.qweight")

    def edit(t: Tensors) -> None:
        for name in [n for n in t if n.startswith("lm_head.")]:
            del t[name]
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    bad = derive(good, tmp_path / "bad", shards={shard: edit},
                 config=lambda c: c["quantization_config"].update(lm_head=False))
    code, output = run_verify(bad)
    assert code == 0, output
    head = [line for line in output.splitlines() if line.startswith("WARNING") and "head" in line]
    assert len(head) == 1
    # 49152 x 576 bf16 = 56.6 MB against the 4-bit layers' bytes
    assert "56.6 MB read every decode step" in head[0] and "W4A8" in head[0], head[0]


def test_tied_config_with_a_quantized_head(good: Path, tmp_path: Path) -> None:
    bad = derive(good, tmp_path / "bad", config=lambda c: c.update(tie_word_embeddings=True))
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 1 and "tie_word_embeddings is true" in errors[0], output


def test_desc_act_true(good: Path, tmp_path: Path) -> None:
    bad = derive(good, tmp_path / "bad",
                 config=lambda c: c["quantization_config"].update(desc_act=True))
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 1 and "desc_act is true" in errors[0], output


def test_group_vllm_does_not_take(good: Path, tmp_path: Path) -> None:
    bad = derive(good, tmp_path / "bad",
                 config=lambda c: c["quantization_config"].update(group_size=96))
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert "group 96 is not one" in errors[0] and "(accepted: " in errors[0], output
    # the modules the dynamic rules do not cover (down_proj) now disagree with their scales
    assert any("down_proj.scales" in e and "the stored scales imply group 128" in e
               for e in errors)


def test_scales_inconsistent_with_dynamic(good: Path, tmp_path: Path) -> None:
    bad = derive(good, tmp_path / "bad",
                 config=lambda c: c["quantization_config"].update(dynamic={}))
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert errors and all("down_proj" not in e for e in errors), output
    assert any("self_attn.q_proj.qweight" in e and "group 128 does not divide the in-features"
               " 576" in e for e in errors)


def test_nan_in_scales(good: Path, tmp_path: Path) -> None:
    target = "model.layers.7.self_attn.o_proj.scales"

    def edit(t: Tensors) -> None:
        t[target] = t[target].clone()
        t[target][0, 3] = float("nan")

    bad = derive(good, tmp_path / "bad", shards={_shard_of(good, target): edit})
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 1 and target in errors[0] and "1 NaN and 0 Inf" in errors[0], output


def test_truncated_safetensors_file(good: Path, tmp_path: Path) -> None:
    shard = _shard_of(good, "model.layers.12.mlp.up_proj.qweight")
    bad = derive(good, tmp_path / "bad")
    (bad / shard).unlink()
    data = (good / shard).read_bytes()
    (bad / shard).write_bytes(data[: len(data) // 2])
    code, output = run_verify(bad)
    assert code == 1
    assert "Traceback" not in output
    errors = error_lines(output)
    assert len(errors) == 1 and shard in errors[0] and "truncated" in errors[0], output


def test_extra_stray_tensor(good: Path, tmp_path: Path) -> None:
    stray = "model.layers.3.mlp.extra_proj.weight"
    shard = _shard_of(good, "model.layers.3.mlp.down_proj.qweight")
    bad = derive(good, tmp_path / "bad",
                 shards={shard: lambda t: t.update({stray: torch.zeros(64, 576,
                                                                       dtype=torch.bfloat16)})})
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 1 and stray in errors[0] and "left over" in errors[0], output


def test_module_both_bf16_and_quantized(good: Path, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.q_proj"
    extra = {f"{name}.weight": torch.zeros(576, 576, dtype=torch.bfloat16)}
    bad = derive(good, tmp_path / "bad",
                 shards={_shard_of(good, f"{name}.qweight"): lambda t: t.update(extra)})
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 1 and f"{name}.weight" in errors[0] and "both bf16 and quantized" in \
        errors[0], output


def test_act_order_g_idx(good: Path, tmp_path: Path) -> None:
    target = "model.layers.9.mlp.down_proj.g_idx"

    def edit(t: Tensors) -> None:
        t[target] = t[target][torch.randperm(t[target].numel(),
                                             generator=torch.Generator().manual_seed(0))]

    bad = derive(good, tmp_path / "bad", shards={_shard_of(good, target): edit})
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert len(errors) == 1 and target in errors[0] and "not trivial" in errors[0], output


# -- bad input ------------------------------------------------------------------------------------
def test_not_a_checkpoint_is_a_one_line_error(tmp_path: Path) -> None:
    out = CliRunner().invoke(verify_cmd, [str(tmp_path / "nope")])
    assert out.exit_code == CpuQuantError.exit_code
    assert out.output.strip().startswith("error:") and len(out.output.strip().splitlines()) == 1


def test_unquantized_checkpoint_is_refused() -> None:
    from cpu_quant.models.demo import demo_model_path

    out = CliRunner().invoke(verify_cmd, [str(demo_model_path())])
    assert out.exit_code == CpuQuantError.exit_code
    assert "no quantization_config" in out.output


# -- inspect ---------------------------------------------------------------------------------------
def test_inspect_summarises_the_good_artifact(good: Path) -> None:
    report = inspect_checkpoint(good)
    assert report.format == "gptq" and report.checkpoint_format == "gptq"
    assert report.quantized_linears == 211
    # groups of 64 (most modules) and 128 (down_proj), bf16 scales: between 4.125 and 4.25
    assert 4.125 < report.bits_per_weight < 4.25
    assert report.bits_per_weight_on_disk > report.bits_per_weight
    assert report.head.startswith("quantized gptq (group 64)")
    assert report.total_bytes < 0.45 * report.bf16_bytes
    assert report.report and report.report["method"] == "rtn"
    kinds = {(k.kind, k.dtype): k.count for k in report.kinds}
    assert kinds[("qweight", "I32")] == 211 and kinds[("embedding", "BF16")] == 1
    out = CliRunner().invoke(inspect_cmd, [str(good)])
    assert out.exit_code == 0 and "bits/weight" in out.output
    doc = json.loads(CliRunner().invoke(inspect_cmd, [str(good), "--json"]).output)
    assert doc["schema"] == "cpu-quant.inspect/1" and doc["quantized_linears"] == 211


def test_inspect_foreign_bf16_head() -> None:
    report = inspect_checkpoint(FOREIGN / "gptqmodel_v1")
    assert report.head.startswith("BF16 [512, 128]")
    assert report.bits_per_weight == pytest.approx(4 + 16 / 32)  # fp16 scales, group 32


# -- cpu_int4 (written here from the documented layout, independently of formats/cpu_int4/) ---------
@pytest.fixture(scope="module")
def cpu_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GPTQModel v1 fixture repacked into the cpu_int4 layout (symmetric: zero 0)."""
    src = FOREIGN / "gptqmodel_v1"
    dst = tmp_path_factory.mktemp("cpu_int4") / "tiny"
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    out: Tensors = {}
    modules = sorted({n.rpartition(".")[0] for n in tensors if n.endswith(".qweight")})
    for name, t in tensors.items():
        if name.rpartition(".")[0] not in modules:
            out[name] = t
    for m in modules:
        codes = unpack_gptq_qweight(tensors[f"{m}.qweight"]).to(torch.uint8)  # [N, K]
        out[f"{m}.weight_packed"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        scales = tensors[f"{m}.scales"].t().to(torch.bfloat16).contiguous()  # [N, K/g]
        out[f"{m}.weight_scale"] = scales
        out[f"{m}.weight_zero"] = torch.zeros_like(scales)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "cpu_int4", "bits": 4, "group_size": 32,
                                     "sym": True, "lm_head": False, "dynamic": {}}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_cpu_int4_documented_layout_passes(cpu_int4: Path) -> None:
    report = verify_checkpoint(cpu_int4)
    assert report.ok, [f.line() for f in report.errors]
    assert report.format == "cpu_int4" and report.quantized_modules == 14
    assert report.zero_convention is None
    inspected = inspect_checkpoint(cpu_int4)
    assert inspected.bits_per_weight == pytest.approx(4 + 16 / 32)  # sym: the zero is not free


@pytest.mark.parametrize("defect,expected", [
    ("group", "does not divide"),
    ("zero", "group zeros are not 0"),
    ("nan", "NaN"),
    ("shape", "expected [64, 4]"),
])
def test_cpu_int4_documented_layout_defects(cpu_int4: Path, tmp_path: Path, defect: str,
                                            expected: str) -> None:
    config_edit = None
    shard_edit = None
    target = "model.layers.1.self_attn.k_proj"
    if defect == "group":
        def config_edit(c: dict) -> None:
            c["quantization_config"]["dynamic"] = {
                r"+:model\.layers\.1\.self_attn\.k_proj$": {"group_size": 256}}
    elif defect == "zero":
        def shard_edit(t: Tensors) -> None:
            t[f"{target}.weight_zero"] = torch.full_like(t[f"{target}.weight_zero"], 0.5)
    elif defect == "nan":
        def shard_edit(t: Tensors) -> None:
            t[f"{target}.weight_scale"] = t[f"{target}.weight_scale"].clone()
            t[f"{target}.weight_scale"][1, 1] = float("nan")
    else:
        def shard_edit(t: Tensors) -> None:
            t[f"{target}.weight_scale"] = t[f"{target}.weight_scale"][:, :2].contiguous()
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((cpu_int4 / "config.json").read_text())
    if config_edit:
        config_edit(config)
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(cpu_int4 / "model.safetensors"))
    if shard_edit:
        shard_edit(tensors)
    save_file(tensors, str(bad / "model.safetensors"))
    code, output = run_verify(bad)
    assert code == 1
    errors = error_lines(output)
    assert errors and all("model.layers.1.self_attn." in e for e in errors), output
    assert any(expected in e for e in errors), output
