from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import ConfigError
from pipeline.texts import checkpoint_text, file_text


def test_a_folder_given_as_a_text_file_is_named_as_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a folder, not a file"):
        file_text(tmp_path, what="evaluation text", hint="pass a file")
    with pytest.raises(ConfigError, match="does not exist"):
        file_text(tmp_path / "missing.txt", what="evaluation text", hint="pass a file")


def test_a_checkpoints_own_text_that_is_not_utf8_says_which_byte(tmp_path: Path) -> None:
    (tmp_path / "eval.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        checkpoint_text(tmp_path, "eval.txt")
    assert info.value.message == (f"the checkpoint's eval.txt {tmp_path / 'eval.txt'} is not UTF-8 text: byte 0xe9 "
                                  "at offset 3 (unexpected end of data)")
