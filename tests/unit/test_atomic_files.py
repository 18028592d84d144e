import json
import os

import pytest

from megatron_multilora.atomic_files import atomic_file, write_json_atomic


def test_atomic_file_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "sub" / "a.jsonl"
    write_json_atomic(target, {"v": 1})  # creates the parent folder
    assert json.loads(target.read_text()) == {"v": 1}

    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write('{"v": ')
            raise RuntimeError("killed mid-write")
    assert json.loads(target.read_text()) == {"v": 1}  # the previous file, untouched
    assert os.listdir(target.parent) == ["a.jsonl"]  # no temporary file left

    with atomic_file(target, binary=True) as f:
        f.write(b"\x89PNG")
    assert target.read_bytes() == b"\x89PNG"
    assert os.listdir(target.parent) == ["a.jsonl"]


def test_atomic_file_gets_umask_permissions(tmp_path):
    # mkstemp would create 0600 files: plots and data must be readable like any other file.
    umask = os.umask(0o022)
    os.umask(umask)
    write_json_atomic(tmp_path / "x.json", [])
    assert (tmp_path / "x.json").stat().st_mode & 0o777 == 0o666 & ~umask
