"""The fidelity suite's GPTQModel arm with a quantized head (``gptqmodel+head``), without
running GPTQModel: its untied input, its ``dynamic`` rule, the spec its build hands the runner,
and the check that refuses an artifact whose head is not 4-bit in the rule's group.

The arm's real run is in the end-to-end tier (``tests/test_bench_smoke.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.peers import gptqmodel_env
from benchmarks.suites import fidelity
from benchmarks.suites import quantize as q
from cpu_quant.core.grid import GroupQuant
from cpu_quant.core.io.safetensors_writer import write_safetensors
from cpu_quant.core.naming import group_for_module
from cpu_quant.formats.gptq.layout import gptq_module_tensors
from cpu_quant.quantize.plan import HEAD_GROUP

HEAD_RULE = {"+:(?:lm_head)$": {"bits": 4, "group_size": HEAD_GROUP, "sym": True,
                                "desc_act": False}}


def test_the_untied_copy_is_the_same_function_with_a_head_of_its_own(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from cpu_quant.core.io.checkpoint import open_checkpoint

    untied = q.untied_copy(tiny_llama, tmp_path / "untied")
    ckpt = open_checkpoint(untied)
    assert ckpt.config["tie_word_embeddings"] is False
    assert torch.equal(ckpt.tensor("lm_head.weight"), ckpt.tensor("model.embed_tokens.weight"))
    assert (untied / "tokenizer.json").is_file()
    ckpt.close()
    ids = torch.tensor([[1, 504, 3300, 28, 2373, 17, 9, 4031]])
    logits = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)(ids).logits
              for p in (tiny_llama, untied)]
    assert torch.equal(*logits)
    assert q.untied_copy(untied, tmp_path / "again") == untied  # already untied: kept as is
    assert not (tmp_path / "again").exists()


def test_the_head_rule_is_cpu_quants_default_head(tiny_llama):
    rule = q.head_dynamic(tiny_llama, 128)
    assert rule == HEAD_RULE
    # the key is the one cpu-quant writes, and consumers matching it give the head group 32
    assert group_for_module(rule, "lm_head", 128) == HEAD_GROUP
    assert group_for_module(rule, "model.layers.0.mlp.down_proj", 128) == 128


@pytest.fixture
def peer_venv(monkeypatch, tmp_path):
    """A GPTQModel venv as far as the suite can tell (its build is not run here)."""
    env = gptqmodel_env.PeerEnv(tmp_path / "venv", tmp_path / "venv" / "bin" / "python", {})
    monkeypatch.setattr(gptqmodel_env, "ready_env", lambda: env)
    return env


def _suite(tiny_llama: Path, workdir: Path, arms: list[str]):
    return fidelity.build(q.SuiteOptions(smoke=True, workdir=workdir, source=tiny_llama,
                                         arms=arms))


def test_the_head_arm_builds_from_the_untied_copy_with_the_head_rule_first(tiny_llama, tmp_path,
                                                                           peer_venv):
    suite = _suite(tiny_llama, tmp_path / "work", ["gptqmodel+head"])
    (arm,) = suite.arms
    untied = tmp_path / "work" / "inputs" / "untied_source"
    assert suite.inputs["untied_source"] == untied  # hashed into the provenance
    assert suite.settings["head_dynamic"] == HEAD_RULE
    bdir = tmp_path / "build"
    bdir.mkdir()
    cmd = arm.build(bdir)
    assert cmd.argv[0] == str(peer_venv.python)
    spec = json.loads((bdir / "spec.json").read_text())
    matched = q.matched_dynamic(tiny_llama, q.SMOKE["group"])
    assert spec["model"] == str(untied) and spec["lm_head"] is True
    assert list(spec["dynamic"]) == [*HEAD_RULE, *matched]
    assert spec["dynamic"] == {**HEAD_RULE, **matched}
    assert arm.settings["lm_head"] is True and arm.settings["dynamic"] == spec["dynamic"]
    # the bf16-head peer keeps the tied source and no head rule
    plain = _suite(tiny_llama, tmp_path / "plain", ["gptqmodel"]).arms[0]
    plain.build(bdir)
    spec = json.loads((bdir / "spec.json").read_text())
    assert spec["model"] == str(tiny_llama) and spec["lm_head"] is False
    assert spec["dynamic"] == matched
    assert not (tmp_path / "plain" / "inputs" / "untied_source").exists()


def _gptqmodel_artifact(root: Path, windows: Path, dynamic: dict, head_bits: int | None,
                        head_group: int = HEAD_GROUP, hidden: int = 64, vocab: int = 96) -> Path:
    """What the runner leaves, reduced to what the check reads: ``gptqmodel_run.json``,
    ``config.json`` and the head (``head_bits`` None: the head kept in bf16)."""
    root.mkdir(parents=True)
    spec = {"windows": str(windows), "group_size": 128, "lm_head": True, "desc_act": False,
            "sym": True, "dynamic": dynamic}
    (root / "gptqmodel_run.json").write_text(json.dumps({"spec": spec}))
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "lm_head": True,
            "checkpoint_format": "gptq", "dynamic": dynamic}
    (root / "config.json").write_text(json.dumps({"tie_word_embeddings": False,
                                                  "quantization_config": qcfg}))
    tensors = {"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    if head_bits is None:
        tensors["lm_head.weight"] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    else:
        codes = torch.randint(0, 16, (vocab, hidden), dtype=torch.uint8)
        gq = GroupQuant(codes, torch.rand(vocab, hidden // head_group), None, head_group)
        head = gptq_module_tensors(gq)
        if head_bits != 4:  # the packed shape of wider codes: K·bits/32 rows
            head["qweight"] = torch.zeros(hidden * head_bits // 32, vocab, dtype=torch.int32)
        tensors.update({f"lm_head.{k}": v for k, v in head.items()})
    write_safetensors(root / "model.safetensors", tensors)
    return root


@pytest.mark.parametrize("head_bits, head_group, problem", [
    (4, HEAD_GROUP, None),
    (8, HEAD_GROUP, "8 bits in groups of 32"),  # GPTQModel's own default for a head
    (4, 64, "4 bits in groups of 64"),
    (None, HEAD_GROUP, "not stored quantized"),
])
def test_the_head_arm_refuses_a_head_that_is_not_4_bit_in_the_rules_group(
        tmp_path, head_bits, head_group, problem):
    windows = tmp_path / "windows.json"
    windows.write_text("[[1, 2, 3]]")
    dynamic = {**HEAD_RULE, "+:model\\.layers\\.\\d+\\.mlp\\.(?:down_proj)$": {"group_size": 64}}
    artifact = _gptqmodel_artifact(tmp_path / "artifact", windows, dynamic, head_bits,
                                   head_group)
    check = lambda: fidelity.check_gptqmodel_artifact(  # noqa: E731
        artifact, windows, dict(q.SMOKE), dynamic, head=True)
    if problem is None:
        check()
    else:
        with pytest.raises(ValueError, match=problem):
            check()
    # the bf16-head arms still refuse an artifact whose head was quantized
    with pytest.raises(ValueError, match="lm_head is True, the arm wants False"):
        fidelity.check_gptqmodel_artifact(artifact, windows, dict(q.SMOKE), dynamic)
