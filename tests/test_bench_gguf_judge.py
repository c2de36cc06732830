"""The gguf_judge suite: llama-perplexity's KL report read right, its argv, the arms' pairing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.suites import gguf_judge as gj

# the closing statistics of llama-perplexity --kl-divergence (llama.cpp vendored in
# llama-cpp-python 0.3.36), as it printed them for our Q4_0 file of the off-grid demo model
# on the Italian domain (8 chunks of 512 tokens)
REPORT = """
====== Perplexity statistics ======
Mean PPL(Q)                   :  89.605986 ±   6.730450
Mean PPL(base)                :  78.394695 ±   5.953349
Cor(ln(PPL(Q)), ln(PPL(base))):  97.61%
Mean ln(PPL(Q)/PPL(base))     :   0.133666 ±   0.016532
Mean PPL(Q)/PPL(base)         :   1.143011 ±   0.018897
Mean PPL(Q)-PPL(base)         :  11.211291 ±   1.587141

====== KL divergence statistics ======
Mean    KLD:   0.195511 ±   0.005451
Maximum KLD:   3.826683
99.9%   KLD:   2.181348
99.0%   KLD:   1.170068
95.0%   KLD:   0.611794
90.0%   KLD:   0.422746
Median  KLD:   0.121753
10.0%   KLD:   0.033148
 5.0%   KLD:   0.018110
 1.0%   KLD:   0.005718
 0.1%   KLD:   0.000986
Minimum KLD:   0.000867

====== Token probability statistics ======
Mean    Δp: -1.546 ± 0.213 %
Maximum Δp: 53.216%
99.9%   Δp: 44.677%
99.0%   Δp: 23.081%
95.0%   Δp: 10.095%
90.0%   Δp:  3.475%
75.0%   Δp:  0.120%
Median  Δp: -0.009%
25.0%   Δp: -1.507%
10.0%   Δp: -8.312%
 5.0%   Δp: -16.725%
 1.0%   Δp: -44.114%
 0.1%   Δp: -69.666%
Minimum Δp: -77.152%
RMS Δp    :  9.760 ± 0.458 %
Same top p: 71.225 ± 1.003 %
"""


def test_the_kl_report_is_read_into_its_numbers():
    got = gj.parse_kl_report(REPORT)
    assert got == {"kl_mean": 0.195511, "kl_se": 0.005451, "same_top": pytest.approx(0.71225),
                   "same_top_se": pytest.approx(0.01003), "ppl_ratio": 1.143011,
                   "ppl": 89.605986}


def test_a_report_without_kl_statistics_is_an_error():
    with pytest.raises(ValueError, match="no KL divergence statistics"):
        gj.parse_kl_report(REPORT.split("====== KL")[0])


def test_the_base_is_saved_once_and_every_arm_scored_against_it(tmp_path):
    settings = {"ctx": 512, "chunks": 8, "threads": 2}
    save = gj.perplexity_argv(tmp_path, tmp_path / "bf16.gguf", tmp_path / "it.txt",
                              tmp_path / "base.kld", settings, save=True)
    score = gj.perplexity_argv(tmp_path, tmp_path / "arm.gguf", tmp_path / "it.txt",
                               tmp_path / "base.kld", settings, save=False)
    assert save[0] == score[0] == str(tmp_path.joinpath("llama-perplexity"))
    assert "--kl-divergence" not in save and score[-1] == "--kl-divergence"
    assert "--no-repack" in save and "--no-repack" in score  # every llama.cpp tool that runs one
    for argv in (save, score):
        i = argv.index("--kl-divergence-base")
        assert argv[i + 1] == str(tmp_path / "base.kld")
        assert argv[argv.index("-c") + 1] == "512" and argv[argv.index("--chunks") + 1] == "8"


def test_a_pass_scores_every_domain_and_writes_what_the_suite_reads(tmp_path):
    """The worker's loop, with a stand-in tool that prints the report (the real tool's run is
    the suite's end-to-end test)."""
    # a stand-in where the suite runs the tool
    tool = Path(gj.perplexity_argv(tmp_path, tmp_path, tmp_path, tmp_path, gj.JUDGE, False)[0])
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{REPORT}\nEOF\n")
    tool.chmod(0o755)
    pairs = [f"{d}={tmp_path / d}.txt:{tmp_path / d}.kld" for d in gj.DOMAINS]
    assert gj.main([str(tmp_path), str(tmp_path / "arm.gguf"), str(tmp_path / "out"),
                    json.dumps(gj.JUDGE), *pairs]) == 0
    got = json.loads((tmp_path / "out" / "judge.json").read_text())
    assert set(got) == set(gj.DOMAINS) and got["italian"]["kl_mean"] == 0.195511
    assert (tmp_path / "out" / "perplexity-javascript.log").read_text().strip()
    tool.write_text("#!/bin/sh\necho 'failed to load model' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="exited 1"):
        gj.judge(tmp_path, tmp_path / "arm.gguf", {"italian": (Path("a"), Path("b"))}, gj.JUDGE,
                 tmp_path / "out2")


def test_arm_names_pair_each_type_with_llama_cpps():
    assert gj.arm_name("smollm2", gj.OURS, "q4_k_m") == "smollm2:cpu-quant-q4_k_m"
    assert gj.arm_name("smollm2", gj.THEIRS, "q4_k_m") == "smollm2:llama.cpp-q4_k_m-imatrix"
    assert {t for t, _ in gj.TYPES.values()} == {"Q4_0", "Q4_K_M", "IQ4_NL"}


def test_a_source_or_prebuilt_artifact_is_refused_before_any_work(tmp_path):
    """The suite judges its own off-grid models: --source or --artifact is refused in one
    line, before any model is read or written."""
    from benchmarks.suites.quantize import SuiteOptions

    for opts in (SuiteOptions(smoke=True, workdir=tmp_path / "w", source=tmp_path),
                 SuiteOptions(smoke=True, workdir=tmp_path / "w",
                              prebuilt={"x": tmp_path})):
        with pytest.raises(ValueError, match="no --source or --artifact"):
            gj.build(opts)
    assert not (tmp_path / "w").exists()
