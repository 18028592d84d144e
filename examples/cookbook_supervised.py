"""tinker-cookbook's supervised training loop (``tinker_cookbook.supervised.train``, the loop
behind its ``sl_basic`` recipe) run unchanged against a local `mmlora api` service, offline:
the tokenizer comes from the service's Hugging Face folder, the conversations from a local
JSONL file (the cookbook's own format: one ``{"messages": [...]}`` per line).

    MMLORA_API_KEYS=tml-alice mmlora api --run-dir runs/api --port 8000 hf_dir=data/smollm2-135m-instruct &
    TINKER_API_KEY=tml-alice python examples/cookbook_supervised.py --port 8000 \\
        --hf-dir data/smollm2-135m-instruct --conversations chats.jsonl --log-path runs/cookbook

The loop writes its metrics (``train_mean_nll`` per step) to ``<log-path>/metrics.jsonl`` and
its checkpoints to ``<log-path>/checkpoints.jsonl``, as it does against Tinker.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import register_tokenizer
from transformers import AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--hf-dir",
        type=Path,
        required=True,
        help="the service's base model folder (its tokenizer is read here)",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="the service's base model name (default: --hf-dir's folder name, "
        "as `mmlora api` names it)",
    )
    parser.add_argument("--conversations", type=Path, required=True)
    parser.add_argument("--log-path", type=Path, required=True)
    parser.add_argument("--renderer", default="role_colon")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=128)
    args = parser.parse_args()

    model_name = args.model_name or args.hf_dir.resolve().name
    # The cookbook loads a model's tokenizer from the Hub by name; offline, from the folder.
    register_tokenizer(model_name, lambda: AutoTokenizer.from_pretrained(args.hf_dir))
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model_name,
        renderer_name=args.renderer,
        max_length=args.max_length,
        batch_size=args.batch_size,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    config = train.Config(
        log_path=str(args.log_path),
        model_name=model_name,
        recipe_name="sl_basic",
        renderer_name=args.renderer,
        base_url=f"http://127.0.0.1:{args.port}",
        dataset_builder=FromConversationFileBuilder(
            common_config=common, file_path=str(args.conversations)
        ),
        learning_rate=args.lr,
        num_epochs=args.epochs,
        lora_rank=args.rank,
        save_every=5,
        eval_every=0,
    )
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
