"""One-line warnings for calibration text that is probably wrong: binary, UTF-16, or too short
for the windows asked (windows that repeat the same tokens)."""

from __future__ import annotations

import logging

import pytest

from cpu_quant.data.corpus import load_texts, token_windows


class _Chars:
    """A tokenizer of one token per character (no model needed)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("content, needle", [
    ("a plain English sentence, repeated. " * 20, None),
    (bytes(range(256)) * 8, "looks binary"),
    ("some text in UTF-16 " * 20, "looks like UTF-16"),
])
def test_text_files_that_are_not_utf8_text_warn(tmp_path, caplog, content, needle):
    path = tmp_path / "calib.txt"
    if isinstance(content, str) and needle:
        path.write_bytes(content.encode("utf-16"))
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="cpu_quant"):
        load_texts(path)
    found = _warnings(caplog)
    if needle is None:
        assert not found
    else:
        assert len(found) == 1 and needle in found[0] and found[0].startswith("warning:")
        assert "\n" not in found[0]


def test_windows_that_repeat_the_same_tokens_warn(caplog):
    text = "abcdefghijklmnopqrstuvwxyz" * 2  # 52 tokens for 8 windows of 48: starts 0..4 repeat
    with caplog.at_level(logging.WARNING, logger="cpu_quant"):
        windows = token_windows(_Chars(), [text], 8, 48)
    [msg] = _warnings(caplog)
    assert len(windows) == 8 and "calibration windows repeat" in msg and "--samples 8" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cpu_quant"):
        token_windows(_Chars(), ["".join(chr(0x400 + i) for i in range(400))], 4, 48)
    assert not _warnings(caplog)


def test_quiet_silences_the_warnings(tmp_path):
    from cpu_quant.cli.conventions import RunConventions

    logger = logging.getLogger("cpu_quant")
    before = logger.level
    try:
        RunConventions(quiet=True).apply()
        assert not logging.getLogger("cpu_quant.data").isEnabledFor(logging.WARNING)
    finally:
        logger.setLevel(before)
