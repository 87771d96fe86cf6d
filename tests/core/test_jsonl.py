"""JSONL input: lines split at "\n" only, UTF-8 required, lone surrogates found."""

import json

import pytest

from ember.core.errors import DataError
from ember.core.jsonl import jsonl_lines, jsonl_records, lone_surrogate, readable


def test_lines_end_at_newlines_only_and_blank_lines_keep_their_numbers(tmp_path):
    text = "one\u2028two\u2029three\x85four"  # JSON allows these unescaped inside a string
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": text}, ensure_ascii=False) + "\n\n" + json.dumps({"prompt": "b"}) + "\n")
    lines = jsonl_lines(path)
    assert len(lines) == 4 and lines[1] == lines[3] == ""
    assert json.loads(lines[0])["prompt"] == text and json.loads(lines[2])["prompt"] == "b"


def test_a_leading_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    path = tmp_path / "notepad.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "a"}\n')
    assert json.loads(jsonl_lines(path)[0]) == {"prompt": "a"}


def test_a_file_that_is_not_utf8_is_a_data_error_naming_the_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"^--prompts: .*latin1.jsonl is not UTF-8 text \(byte 15: "):
        jsonl_lines(path, "--prompts: ")


def test_lone_surrogate_finds_the_first_unpaired_one():
    assert lone_surrogate("plain \U0001f600 text") is None
    assert lone_surrogate(json.loads('"ab\\ud800c\\udfff"')) == (2, "U+D800")


def test_readable_takes_files_and_pipes_not_directories_or_missing_paths(tmp_path):
    import os

    (tmp_path / "a.jsonl").write_text("{}\n")
    os.mkfifo(tmp_path / "in.fifo")  # what /dev/stdin or a shell's <(...) is
    assert readable(tmp_path / "a.jsonl") and readable(str(tmp_path / "in.fifo"))
    assert not readable(tmp_path) and not readable(tmp_path / "missing.jsonl")


def test_records_are_parsed_lines_named_by_file_and_line_blank_ones_skipped(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"a": 1}\n\n  \n[2, "x"]\n', encoding="utf-8")
    assert list(jsonl_records(path)) == [({"a": 1}, f"{path}:1"), ([2, "x"], f"{path}:4")]
    path.write_text('{"a": 1}\n{"a": \n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"^--text: {path}:2 is not JSON \(Expecting value\)$"):
        list(jsonl_records(path, "--text: "))
