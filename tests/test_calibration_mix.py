"""The built-in calibration mix (``cpu_quant/data/mix.py``): the same token ids on every run,
each domain in its stated share of the windows, held-out domains disjoint from the calibration,
and a missing or damaged source refused in one line (also by the script that builds them)."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from cpu_quant.core.errors import CpuQuantError
from cpu_quant.data import mix
from cpu_quant.data.corpus import builtin_split

REPO = Path(__file__).resolve().parents[1]
# the mix's first 16 windows of 64 tokens with the demo tokenizer (sha256 of their ids): a
# change to a source, the shares, the windowing or the chat rendering changes it
MIX_16x64_SHA256 = "48475470db328f0a1ae7f055b82b54128222b09cb578a0ef638cc4acc3c79087"


class _Chars:
    """A tokenizer of one token per character (no model needed)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def _digest(windows: list[list[int]]) -> str:
    return hashlib.sha256(repr(windows).encode()).hexdigest()


def _build_script():
    spec = importlib.util.spec_from_file_location("build_calibration_mix",
                                                  REPO / "scripts" / "build_calibration_mix.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_shares_add_up_and_split_the_windows_as_stated():
    assert sum(d.share for d in mix.MIX) == pytest.approx(1.0)
    assert mix.window_counts(128) == {"austen": 13, "english": 26, "dialogue": 25, "code": 25,
                                      "german": 13, "spanish": 13, "russian": 13}
    for n in (1, 7, 10, 33, 128, 1000):
        counts = mix.window_counts(n)
        assert sum(counts.values()) == n
        for d in mix.MIX:  # largest remainder: never more than one window from the exact share
            assert abs(counts[d.name] - d.share * n) < 1


def test_each_window_comes_from_its_domain_in_the_stated_order():
    tok = _Chars()
    n, seqlen = 20, 48
    windows = mix.mix_windows(tok, n, seqlen)
    assert len(windows) == n and all(len(w) == seqlen for w in windows)
    counts = mix.window_counts(n)
    i = 0
    for domain in mix.MIX:
        text = "".join(mix.domain_texts(domain, tok))
        for w in windows[i:i + counts[domain.name]]:
            assert "".join(map(chr, w)) in text, domain.name
        i += counts[domain.name]


@pytest.mark.e2e
def test_the_mix_gives_the_same_token_ids_on_every_run(demo_src):
    from cpu_quant.core.io.checkpoint import load_tokenizer

    first = mix.load_calibration("mix").windows(load_tokenizer(demo_src), 16, 64)
    again = mix.load_calibration("mix").windows(load_tokenizer(demo_src), 16, 64)
    assert first == again
    assert _digest(first) == MIX_16x64_SHA256
    # dialogue is in the model's chat template
    text = load_tokenizer(demo_src).decode(sum(first[5:9], []))
    assert "<|im_start|>assistant" in text or "<|im_start|>user" in text


def test_the_shipped_sources_match_their_checksums():
    sums = (mix.SOURCES_DIR / "SHA256SUMS").read_text().split()
    listed = dict(zip(sums[1::2], sums[0::2], strict=True))
    assert sorted(listed) == sorted(f"{s}.jsonl.gz" for s in (*mix.MIX_SOURCES,
                                                                 *mix.HELDOUT_SOURCES))
    for name, digest in listed.items():
        assert hashlib.sha256((mix.SOURCES_DIR / name).read_bytes()).hexdigest() == digest
    for name in (*mix.MIX_SOURCES, *mix.HELDOUT_SOURCES):  # and every source says its licence
        assert mix.SOURCES[name].licence and mix.SOURCES[name].package


def test_heldout_domains_share_no_text_with_the_calibration():
    assert not set(mix.HELDOUT_SOURCES) & set(mix.MIX_SOURCES)
    assert not set(mix.HELDOUT) & {d.name for d in mix.MIX}
    calibration = {ln.strip() for name in mix.MIX_SOURCES for r in mix.read_source(name)
                   for v in r.values() for ln in v.splitlines() if len(ln.strip()) >= 40}
    calibration |= {ln.strip() for t in builtin_split("calibration") for ln in t.splitlines()
                    if len(ln.strip()) >= 40}
    for name in mix.HELDOUT_SOURCES:
        records = mix.read_source(name)
        assert len("".join(v for r in records for v in r.values())) > 100_000
        shared = {ln.strip() for r in records for v in r.values() for ln in v.splitlines()
                  if ln.strip() in calibration}
        assert not shared, (name, sorted(shared)[:3])


def test_heldout_names_select_the_domain_and_dialogue_is_rendered(demo_src):
    from cpu_quant.core.io.checkpoint import load_tokenizer

    tok = load_tokenizer(demo_src)
    faq = mix.heldout_texts("debian-faq", tok)
    assert faq[0].count("<|im_start|>user") == 1 and "Debian" in "".join(faq)
    assert mix.heldout_texts("italian", _Chars())[0] == mix.read_source("fortunes-it")[0]["text"]
    assert mix.heldout_texts(None, tok) == builtin_split("heldout")


def _copy_sources(tmp_path, monkeypatch) -> Path:
    copy = tmp_path / "sources"
    shutil.copytree(mix.SOURCES_DIR, copy)
    monkeypatch.setattr(mix, "SOURCES_DIR", copy)
    mix._checksums.cache_clear()
    return copy


def test_a_missing_or_damaged_source_is_one_line(tmp_path, monkeypatch):
    copy = _copy_sources(tmp_path, monkeypatch)
    (copy / "fortunes-de.jsonl.gz").unlink()
    with pytest.raises(CpuQuantError) as err:
        mix.load_calibration("mix")
    msg = str(err.value)
    assert "fortunes-de" in msg and "build_calibration_mix.py" in msg and "\n" not in msg
    (copy / "fortunes-de.jsonl.gz").write_bytes(b"not the file")
    with pytest.raises(CpuQuantError, match="does not match its sha256"):
        mix.load_calibration("mix")
    (copy / "SHA256SUMS").unlink()
    mix._checksums.cache_clear()
    with pytest.raises(CpuQuantError, match="sources are missing"):
        mix.check_heldout("italian")
    mix._checksums.cache_clear()


def test_the_cli_refuses_a_missing_source_in_one_line(tmp_path, tiny_llama):
    """``cpu-quant gptq --calib mix`` in a tree whose mix lacks a source: one line, exit 1."""
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "cpu_quant", tree / "cpu_quant",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "cpu_quant" / "data" / "sources" / "python-stdlib.jsonl.gz").unlink()
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-m", "cpu_quant", "gptq", str(tiny_llama),
                           str(tmp_path / "out"), "--calib", "mix", "--samples", "2",
                           "--seqlen", "32"], capture_output=True, text=True, env=env,
                          cwd=tree, timeout=300)  # cwd: ``-m`` puts it first on sys.path
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "python-stdlib" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_the_build_script_refuses_a_missing_package_in_one_line(tmp_path, capsys):
    script = _build_script()
    empty = tmp_path / "debs"
    empty.mkdir()
    assert script.main(["--deb-dir", str(empty), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "fortunes" in err
    with pytest.raises(script.BuildError, match="not a source"):
        script.fetch_deb("no-such-package", tmp_path, empty)
    # a .deb whose bytes differ from the pinned sha256
    version = script.PACKAGES["fortunes-it"][0]
    (empty / f"{script.deb_name('fortunes-it', version)}all.deb").write_bytes(b"x")
    with pytest.raises(script.BuildError, match="expected"):
        script.fetch_deb("fortunes-it", tmp_path, empty)


def _on_q4_1_grid(src: Path, dst: Path) -> Path:
    """``src`` with every linear weight stored as GGUF Q4_1 and dequantized (as the registry
    models are)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    for name, w in state.items():
        if w.ndim == 2 and "proj" in name:
            q = dequantize(quantize(w.float().numpy().astype(np.float32), T.Q4_1), T.Q4_1)
            state[name] = torch.from_numpy(q.reshape(w.shape)).to(w.dtype)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_the_judging_copy_sits_on_no_grid_and_a_zero_perturbation_is_refused(tiny_llama,
                                                                             tmp_path):
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.core.source_grid import checkpoint_grid
    from cpu_quant.models.off_grid import perturb_off_grid

    on_grid = _on_q4_1_grid(tiny_llama, tmp_path / "on-grid")
    assert checkpoint_grid(open_checkpoint(on_grid)).on_a_grid
    moved = perturb_off_grid(on_grid, tmp_path / "off-grid")
    grid = checkpoint_grid(open_checkpoint(moved))
    assert set(grid.counts()) == {"no grid of 5 bits or fewer"}
    again = perturb_off_grid(on_grid, tmp_path / "again")  # deterministic: the same bytes
    assert (again / "model.safetensors").read_bytes() == (moved / "model.safetensors").read_bytes()
    with pytest.raises(CpuQuantError, match="still on a grid"):
        perturb_off_grid(on_grid, tmp_path / "unmoved", rel=0.0)


def test_the_built_in_texts_token_ids_are_kept_and_read_back_the_same(demo_src, tmp_path,
                                                                       monkeypatch):
    """The built-in texts' token ids are kept in the cache directory, read back instead of
    tokenizing again, equal to a fresh tokenization; a file that cannot be read is tokenized
    again and rewritten; another tokenizer definition, or other texts, get their own file;
    a user's text is never kept."""
    from cpu_quant.core.io.checkpoint import load_tokenizer
    from cpu_quant.data import corpus

    monkeypatch.setenv("CPU_QUANT_CACHE", str(tmp_path))
    tok = load_tokenizer(demo_src)
    texts = [t[:20000] for t in builtin_split("heldout")]
    fresh = corpus._tokenize(tok, texts)
    assert corpus.token_ids(tok, texts, cache=True) == fresh
    (kept,) = (tmp_path / corpus.TOKEN_CACHE).iterdir()

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as m:
        m.setattr(corpus, "_tokenize", no_tokenizing)
        assert corpus.token_ids(tok, texts, cache=True) == fresh
        windows = corpus.token_windows(tok, texts, 4, 64, cache=True)
    assert windows == corpus.token_windows(tok, texts, 4, 64)
    kept.write_bytes(kept.read_bytes()[:100])  # damaged
    assert corpus.token_ids(tok, texts, cache=True) == fresh
    assert corpus.token_ids(tok, texts[:3], cache=True) == corpus._tokenize(tok, texts[:3])
    tok.add_tokens(["<cpu-quant-test-token>"])
    corpus.token_ids(tok, texts, cache=True)
    assert len(list((tmp_path / corpus.TOKEN_CACHE).glob("*.npy"))) == 3
    corpus.token_ids(tok, ["a user's text"] * 3)
    assert len(list((tmp_path / corpus.TOKEN_CACHE).iterdir())) == 3
