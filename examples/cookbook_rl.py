"""tinker-cookbook's RL trainer (``tinker_cookbook.rl.train``, unmodified) for several tenants
at once against one local `mmlora api`, offline: each tenant its own API key, adapter, word
task and process; environments written with the cookbook's own types (``ProblemEnv``,
``RLDatasetBuilder``); the cookbook's default loss. The tenants' processes are forked from
this one after its imports (made once). The service runs their calls together (its log:
``N forward_backward in one step``).

    python examples/cookbook_rl.py --hf-dir data/smollm2-135m-instruct --log-path runs/cookbook-rl

starts the service on that model, trains the tenants, stops the service and ends with one
line per tenant: ``<tenant>: mean reward A -> B``, its held-out reward (the cookbook's test-set
evaluation, sampled) before and after training.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import random
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import chz
import huggingface_hub.constants
from tinker_cookbook import renderers
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer, register_tokenizer
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "apple river stone cloud music table garden silver window candle forest bread eagle "
    "honey lamp ocean piano rocket summer tiger violin winter yellow zebra"
).split()
# Each tenant's task: an instruction, and the answer to a list of words.
TASKS = {
    "capitalize": ("Capitalize each word:", lambda w: [x.capitalize() for x in w]),
    "upper": ("Write each word in capital letters:", lambda w: [x.upper() for x in w]),
    "reverse": ("Write these words in reverse order:", lambda w: w[::-1]),
    "first": ("Repeat only the first word:", lambda w: w[:1]),
}


class WordTaskEnv(ProblemEnv):
    """One word-task question; the reward is how close the answer is to the expected one
    (partial credit: a small model's first answers are rarely exact)."""

    def __init__(self, renderer: renderers.Renderer, question: str, answer: str) -> None:
        super().__init__(renderer, format_coef=0.0)
        self.question, self.answer = question, answer

    def get_question(self) -> str:
        return self.question

    def check_answer(self, sample_str: str) -> float:
        return difflib.SequenceMatcher(None, sample_str.strip(), self.answer).ratio()

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return self.answer


class Problems(RLDataset):
    def __init__(self, builders: list[EnvGroupBuilder], batch_size: int) -> None:
        self.builders, self.batch_size = builders, batch_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.builders[index * self.batch_size : (index + 1) * self.batch_size]

    def __len__(self) -> int:
        return len(self.builders) // self.batch_size


@chz.chz
class WordTaskDataset(RLDatasetBuilder):
    """A task's training problems (``groups`` of ``group_size`` samples per step) and its
    held-out problems (one sample each), drawn with the task's own seed."""

    task: str
    model_name: str
    renderer_name: str
    groups: int = 4
    group_size: int = 4
    n_train: int = 256
    n_test: int = 32

    async def __call__(self) -> tuple[RLDataset, RLDataset]:
        renderer = renderers.get_renderer(self.renderer_name, get_tokenizer(self.model_name))
        instruction, solve = TASKS[self.task]
        rng = random.Random(self.task)

        def problem() -> tuple[str, str]:
            words = rng.sample(WORDS, 2)
            return f"{instruction} {' '.join(words)}", " ".join(solve(words))

        def builders(n: int, size: int) -> list[EnvGroupBuilder]:
            return [
                ProblemGroupBuilder(partial(WordTaskEnv, renderer, *problem()), size, self.task)
                for _ in range(n)
            ]

        test = builders(self.n_test, 1)  # drawn first: the same held-out set every run
        return Problems(builders(self.n_train, self.group_size), self.groups), Problems(test, 1)


def tenant(args: argparse.Namespace) -> None:
    """One tenant's run of the cookbook's trainer (TINKER_API_KEY is its key)."""
    register_tokenizer(args.model_name, lambda: AutoTokenizer.from_pretrained(args.hf_dir))
    config = train.Config(
        learning_rate=args.lr,
        dataset_builder=WordTaskDataset(
            task=args.task,
            model_name=args.model_name,
            renderer_name=args.renderer,
            groups=args.groups,
            group_size=args.group_size,
            n_test=args.test_problems,
        ),
        model_name=args.model_name,
        recipe_name="word_tasks_rl",
        renderer_name=args.renderer,
        max_tokens=args.max_tokens,
        log_path=str(args.log_path / args.tenant),
        eval_every=args.steps,
        save_every=0,
        max_steps=args.steps,
        lora_rank=args.rank,
        base_url=args.url,
        num_groups_to_log=0,
        **({"loss_fn": args.loss} if args.loss else {}),
    )
    asyncio.run(train.main(config))


def start_tenant(args: argparse.Namespace, name: str, key: str, job: tuple[str, str, str]) -> int:
    """Fork one tenant's process (the imports above are made once, not once per tenant):
    ``job`` is its (task, loss, service URL); its key is its TINKER_API_KEY, it runs offline
    and its output goes to ``<log-path>/<tenant>.out``. Returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    fd = os.open(args.log_path / f"{name}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(TINKER_API_KEY=key, HF_HUB_OFFLINE="1")
    huggingface_hub.constants.HF_HUB_OFFLINE = True  # the Hub reads it once, at import
    task, loss, url = job
    code = 1
    try:
        tenant(argparse.Namespace(**vars(args), tenant=name, task=task, loss=loss, url=url))
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def held_out_rewards(log_dir: Path) -> tuple[float, float]:
    """The test-set mean reward at the first and the last evaluation."""
    rows = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    found = [
        v
        for row in rows
        for k, v in row.items()
        if k.startswith("test/") and k.endswith("reward/total")
    ]
    return found[0], found[-1]


def serve(args: argparse.Namespace, keys: list[str]) -> tuple[subprocess.Popen, str]:
    """`mmlora api` on the model, its log in the log folder; its URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = args.log_path / "service.log"
    proc = subprocess.Popen(
        [
            str(REPO / ".venv/bin/mmlora"),
            "api",
            "--run-dir",
            str(args.log_path / "service"),
            "--port",
            str(port),
            f"hf_dir={args.hf_dir}",
            f"api.model_name={args.model_name}",
            f"lora.slots={len(keys)}",
            *args.service_override,
        ],
        cwd=REPO,
        env={**os.environ, "MMLORA_API_KEYS": ",".join(keys)},
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    while "api: serving" not in log.read_text():
        if proc.poll() is not None:
            raise SystemExit(f"the service did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", type=Path, required=True, help="the base model's folder")
    parser.add_argument("--model-name", default="smollm2-135m-instruct")
    parser.add_argument(
        "--renderer", default="qwen3_instruct", help="chat format (SmolLM2: ChatML)"
    )
    parser.add_argument("--log-path", type=Path, required=True)
    parser.add_argument("--tasks", default="capitalize,upper,reverse", help="one tenant each")
    parser.add_argument(
        "--losses", default="", help="each tenant's loss_fn, in order (default: the cookbook's)"
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--test-problems", type=int, default=32, help="held-out, per tenant")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument(
        "--service-override", action="append", default=[], help="e.g. lora.max_rank=8"
    )
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    losses = args.losses.split(",") if args.losses else [""] * len(tasks)
    # A tenant by its task (and its place, where tasks repeat)
    tenants = [task if tasks.count(task) == 1 else f"{task}{i}" for i, task in enumerate(tasks)]
    keys = [f"tml-{name}" for name in tenants]
    args.log_path.mkdir(parents=True, exist_ok=True)
    service, url = serve(args, keys)
    try:
        pids = {
            start_tenant(args, name, key, (task, loss, url)): name
            for name, key, task, loss in zip(tenants, keys, tasks, losses)
        }
        failed = [
            name for pid, name in pids.items() if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        ]
    finally:
        service.terminate()
        service.wait(60)
    if failed:
        raise SystemExit(f"tenants {failed} failed: see {args.log_path}/<tenant>.out")
    for name, key in zip(tenants, keys):
        before, after = held_out_rewards(args.log_path / name)
        print(f"{key}: mean reward {before:.2f} -> {after:.2f}")


if __name__ == "__main__":
    main()
