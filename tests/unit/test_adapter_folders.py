import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_multilora.checkpoint.adapter_files import read_adapter
from megatron_multilora.checkpoint.adapter_folders import FolderFormat, expect_format, folder_format
from megatron_multilora.checkpoint.peft_format import read_peft


def _folder(root, name, config=None, files=()):
    folder = root / name
    folder.mkdir()
    if config is not None:
        (folder / "adapter_config.json").write_text(
            config if isinstance(config, str) else json.dumps(config)
        )
    for file in files:
        save_file({"t": torch.zeros(1)}, str(folder / file))
    return folder


def test_each_format_is_recognised(tmp_path):
    ours = _folder(
        tmp_path,
        "ours",
        {"format": "megatron-multilora-adapter", "rank": 4},
        ["adapter.safetensors"],
    )
    peft = _folder(tmp_path, "peft", {"peft_type": "LORA", "r": 4}, ["adapter_model.safetensors"])
    ckpt = _folder(tmp_path, "step_00000010")
    torch.save({"step": 10}, ckpt / "state.pt")
    assert folder_format(ours) is FolderFormat.ADAPTER
    assert folder_format(peft) is FolderFormat.PEFT
    assert folder_format(ckpt) is FolderFormat.TRAINING_CHECKPOINT
    assert read_adapter(ours)[0]["rank"] == 4 and read_peft(peft)[0]["r"] == 4


def test_errors_name_the_folder_and_what_is_wrong(tmp_path):
    cases = [
        (tmp_path / "nowhere", FileNotFoundError, "nowhere: no such folder"),
        (_folder(tmp_path, "empty"), FileNotFoundError, "holds no adapter_config.json"),
        (
            _folder(tmp_path, "garbled", "{not json"),
            ValueError,
            "garbled/adapter_config.json: not valid JSON",
        ),
        (_folder(tmp_path, "foreign", {"format": "other"}), ValueError, "format 'other' is not"),
        (
            _folder(tmp_path, "neither", {"r": 4}),
            ValueError,
            "neither a 'format' nor a 'peft_type'",
        ),
        (
            _folder(tmp_path, "no_tensors", {"peft_type": "LORA"}),
            FileNotFoundError,
            "no_tensors: adapter_model.safetensors is missing",
        ),
        (
            _folder(
                tmp_path,
                "ours_no_tensors",
                {"format": "megatron-multilora-adapter"},
                ["adapter_model.safetensors"],
            ),
            FileNotFoundError,
            "adapter.safetensors is missing",
        ),
    ]
    for folder, error, message in cases:
        with pytest.raises(error, match=message):
            folder_format(folder)


def test_reading_the_wrong_format_says_which_it_is(tmp_path):
    peft = _folder(tmp_path, "peft", {"peft_type": "LORA"}, ["adapter_model.safetensors"])
    with pytest.raises(ValueError, match=r"peft is a PEFT LoRA folder .*, not an adapter folder"):
        read_adapter(peft)
    ours = _folder(
        tmp_path, "ours", {"format": "megatron-multilora-adapter"}, ["adapter.safetensors"]
    )
    with pytest.raises(ValueError, match=r"ours is an adapter folder .*, not a PEFT LoRA folder"):
        read_peft(ours)
    expect_format(ours, FolderFormat.ADAPTER)
