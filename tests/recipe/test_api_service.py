"""The training service as a black box, with the official tinker SDK as its client: launched
with `mmlora api`, on the tiny model."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from megatron_multilora.data.datasets import load_dataset
from megatron_multilora.data.demo_tasks import write_post_training_datasets
from megatron_multilora.data.tokenizer import ByteTokenizer
from tests.recipe.conftest import job, run_in_process

REPO = Path(__file__).resolve().parents[2]
KEYS = ["tml-alice", "tml-bob", "tml-carol", "tml-dave"]
SLOTS = 4
SESSION_TIMEOUT = 25  # seconds; the SDK heartbeats every 10
ADAM = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)  # the recipe's AdamW
# The service's adapters (conf/api.yaml), for a recipe job that trains as a client does.
SERVICE_LORA = [
    "lora.max_rank=32",
    "lora.targets=[linear_qkv,linear_proj,linear_fc1,linear_fc2,output_layer]",
]


def free_port() -> int:
    """A free port below the kernel's ephemeral range. bind(0) and outgoing connections (the
    workers' to torchrun's store) take ports from that range, and one took a port that bind(0)
    had just given back before the service could bind it ('address already in use' in CI)."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    for port in random.Random().sample(range(max(1024, low - 10000), low), 100):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 100 tried below {low}")


class Service:
    """One service process (its own process group, so a kill reaches every worker)."""

    def __init__(
        self,
        run_dir: Path,
        port: int,
        log: Path,
        nproc: int = 1,
        keys: list[str] = KEYS,
        overrides: list[str] = ("hf_dir=null",),
        slots: int = SLOTS,
    ) -> None:
        self.url, self.log = f"http://127.0.0.1:{port}", log
        env = {**os.environ, "MMLORA_API_KEYS": ",".join(keys), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [
                str(REPO / ".venv/bin/mmlora"),
                "api",
                "--run-dir",
                str(run_dir),
                "--port",
                str(port),
                "--nproc",
                str(nproc),
                f"lora.slots={slots}",
                "api.batch_window_ms=300",
                f"api.session_timeout_s={SESSION_TIMEOUT}",
                "trainer.micro_batch_tokens=512",
                "trainer.max_seq_len=128",
                *overrides,
            ],
            cwd=REPO,
            env=env,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 120
        while "api: serving" not in log.read_text():
            assert self.proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)

    def client(self, key: str = KEYS[0]) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=key)

    def kill(self) -> int:
        """SIGKILL the launcher alone, as a crash would: its workers (torchrun starts each in
        a session of its own) must die with it."""
        processes = [
            psutil.Process(self.proc.pid),
            *psutil.Process(self.proc.pid).children(recursive=True),
        ]
        assert len(processes) > 1, "no worker processes found"
        self.proc.send_signal(signal.SIGKILL)
        code = self.proc.wait(30)
        _, alive = psutil.wait_procs(processes, timeout=30)
        assert not alive, f"still running after SIGKILL: {alive}"
        return code

    def stop(self) -> None:
        """SIGTERM (torchrun passes it to the workers); none may outlive the test."""
        if self.proc.poll() is None:
            workers = psutil.Process(self.proc.pid).children(recursive=True)
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
            for p in psutil.wait_procs(workers, timeout=30)[1]:
                p.kill()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("api-data")
    write_post_training_datasets(out, n_train=4, n_eval=2, seed=0)
    return out


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    service = Service(tmp / "run", free_port(), tmp / "service.log")
    yield service
    service.stop()


def datums(data: Path, task: str) -> list[types.Datum]:
    """The task's training records as the recipe tokenizes them, each target weighed
    1 / (all loss tokens): the recipe's mean loss as a sum."""
    examples = load_dataset(data / f"{task}.train.jsonl", ByteTokenizer(), 128)
    total = sum(sum(e.loss_mask) for e in examples)
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(e.tokens[:-1])),
            loss_fn_inputs={
                "target_tokens": list(e.tokens[1:]),
                "weights": [m / total for m in e.loss_mask],
            },
        )
        for e in examples
    ]


def datums_of(tokens: list[int]) -> list[types.Datum]:
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]


def train(
    client: tinker.TrainingClient, batch: list[types.Datum], steps: int, lr: float
) -> list[float]:
    losses = []
    for _ in range(steps):
        out = client.forward_backward(batch, "cross_entropy").result(timeout=120)
        client.optim_step(types.AdamParams(learning_rate=lr, grad_clip_norm=1.0, **ADAM)).result(
            timeout=120
        )
        losses.append(out.metrics["loss:sum"])
    return losses


def sampler_tensors(path: str, run_dir: Path) -> dict:
    (folder,) = run_dir.glob(f"api/*/*/sampler_weights/{path.rsplit('/', 1)[1]}/adapter")
    return load_file(str(next(folder.glob("*.safetensors"))))


def test_an_sdk_training_loop_equals_the_recipe_job(service, data, tmp_path):
    steps, lr = 3, 3e-3
    want, _ = run_in_process(
        tmp_path / "recipe",
        [
            job(
                "seed-7",
                data,
                "add",
                steps,
                lr=lr,
                global_batch_size=4,
                warmup_steps=0,
                schedule="constant",
            )
        ],
        [f"lora.slots={SLOTS}", *SERVICE_LORA],
    )
    with service.client() as sc:
        client = sc.create_lora_training_client(base_model="tiny", rank=8, seed=7).result()
        got = train(client, datums(data, "add"), steps, lr)
        path = client.save_weights_for_sampler("final").result().path
    assert got == pytest.approx(want["seed-7"], rel=1e-5)
    mine = sampler_tensors(path, service.log.parent / "run")
    recipe = load_file(str(next((tmp_path / "recipe/adapters/seed-7").glob("*.safetensors"))))
    assert mine.keys() == recipe.keys()
    for name in recipe:  # relative to each tensor's norm: Adam magnifies rounding of ~0 gradients
        assert (mine[name] - recipe[name]).norm() <= 1e-5 * recipe[name].norm(), name


@pytest.mark.parametrize(
    "layout",
    [["parallel=tp2"], ["parallel=pp2"], ["parallel=ep2", "model=tiny_moe"]],
    ids=["tp2", "pp2", "ep2-moe"],
)
def test_a_two_process_layout_serves_the_recipe_jobs_training(tmp_path, layout):
    """Under TP, PP, or EP with data parallelism (an uneven split of 3 datums: a rank pads
    with a filler micro-batch), an SDK loop equals the recipe job trained in one process."""
    steps, lr = 2, 3e-3
    data = tmp_path / "data"
    write_post_training_datasets(data, n_train=3, n_eval=2, seed=0)
    batch = datums(data, "add")
    want, _ = run_in_process(
        tmp_path / "recipe",
        [
            job(
                "seed-7",
                data,
                "add",
                steps,
                lr=lr,
                global_batch_size=3,
                warmup_steps=0,
                schedule="constant",
            )
        ],
        [f"lora.slots={SLOTS}", *SERVICE_LORA, *layout[1:]],
    )
    service = Service(
        tmp_path / "run",
        free_port(),
        tmp_path / "service.log",
        nproc=2,
        overrides=["hf_dir=null", *layout],
    )
    try:
        with service.client() as sc:
            client = sc.create_lora_training_client(base_model="tiny", rank=8, seed=7).result()
            got = train(client, batch, steps, lr)
    finally:
        service.stop()
    assert "world 2" in service.log.read_text()
    assert got == pytest.approx(want["seed-7"], rel=1e-5)


# Each client's LoraConfig: everything (Tinker's default), no MLP, no attention, no output layer.
PARTS = [{}, {"train_mlp": False}, {"train_attn": False}, {"train_unembed": False}]


def test_four_clients_at_once_each_train_as_alone(service, data):
    """Four clients, each with its own task and LoraConfig, trained at once equal each
    trained alone; the linears a client's LoraConfig leaves out never move from zero."""
    tasks = ["add", "reverse", "sort", "uppercase"]
    alone = {}
    for key, task, parts in zip(KEYS, tasks, PARTS):
        with service.client(key) as sc:
            client = sc.create_lora_training_client(
                base_model="tiny", rank=4, seed=1, **parts
            ).result()
            alone[key] = train(client, datums(data, task), 3, 1e-2)
    before = service.log.read_text()
    together: dict[str, list[float]] = {}
    saved: dict[str, str] = {}

    def run(key: str, task: str, parts: dict) -> None:
        with service.client(key) as sc:
            client = sc.create_lora_training_client(
                base_model="tiny", rank=4, seed=1, **parts
            ).result()
            together[key] = train(client, datums(data, task), 3, 1e-2)
            saved[key] = client.save_weights_for_sampler(f"parts-{key}").result().path

    threads = [threading.Thread(target=run, args=ktp) for ktp in zip(KEYS, tasks, PARTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for key in KEYS:
        assert together[key] == pytest.approx(alone[key], rel=1e-5), key
    assert len({tuple(v) for v in alone.values()}) == 4  # the tasks differ: so do the losses
    batched = [
        int(n)
        for n in re.findall(
            r"(\d+) forward_backward in one step", service.log.read_text()[len(before) :]
        )
    ]
    assert max(batched) >= 2, batched  # some calls of different clients shared a step
    part_of = {"linear_qkv": "attn", "linear_proj": "attn", "linear_fc1": "mlp"}
    part_of |= {"linear_fc2": "mlp", "output_layer": "unembed"}
    for key, parts in zip(KEYS, PARTS):
        tensors = sampler_tensors(saved[key], service.log.parent / "run")
        moved = {
            part_of[name.split(".adapter.")[0].rsplit(".", 1)[-1]]
            for name, t in tensors.items()
            if t.any()
        }
        assert moved == {"attn", "mlp", "unembed"} - {k[6:] for k in parts}, (key, moved)


def test_a_tenants_non_finite_gradients_leave_its_neighbour_as_alone(service, data):
    """One tenant's loss and gradients are not finite (a sampler log-prob of -1e30 in its
    importance_sampling datums) while a neighbour trains in the same steps: every call of
    the tenant is refused naming why, the neighbour's are answered and it trains exactly as
    alone; the service log shows their calls shared steps."""
    neighbour = datums(data, "sort")
    poisoned = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": [-1e30] * len(d.loss_fn_inputs["target_tokens"].data),
                "advantages": [1.0] * len(d.loss_fn_inputs["target_tokens"].data),
            },
        )
        for d in datums(data, "add")
    ]
    with service.client(KEYS[2]) as sc:
        client = sc.create_lora_training_client(base_model="tiny", rank=4, seed=11).result()
        alone = train(client, neighbour, 3, 1e-2)
    before = service.log.read_text()
    together, refusals, done = {}, [], threading.Event()

    def tenant() -> None:
        with service.client(KEYS[0]) as sc:
            bad = sc.create_lora_training_client(base_model="tiny", rank=4, seed=12).result()
            while not done.is_set():
                try:
                    bad.forward_backward(poisoned, "importance_sampling").result(timeout=120)
                except Exception as err:  # the SDK's error for a refused call
                    refusals.append(str(err))
                else:
                    refusals.append("answered")

    def run() -> None:
        with service.client(KEYS[2]) as sc:
            client = sc.create_lora_training_client(base_model="tiny", rank=4, seed=11).result()
            together["losses"] = train(client, neighbour, 3, 1e-2)
        done.set()

    threads = [threading.Thread(target=tenant), threading.Thread(target=run)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert together["losses"] == alone  # exactly: the poisoned pass was redone without it
    assert refusals and all("not finite" in r for r in refusals), refusals[:3]
    shared = re.findall(
        r"(\d+) forward_backward in one step", service.log.read_text()[len(before) :]
    )
    assert max(map(int, shared)) >= 2, shared  # the tenant's calls shared the neighbour's steps


def test_sampling_and_logprobs_from_a_saved_adapter(service, data):
    sc = service.client(KEYS[1])
    training = sc.create_lora_training_client(base_model="tiny", rank=8).result()
    train(training, datums(data, "reverse"), 2, 1e-2)
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([1, 70, 71, 72])
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    first = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    assert len(first.sequences) == 3
    assert all(len(s.tokens) == len(s.logprobs) for s in first.sequences)
    # The same seed: the same samples, also after the client trained on (the snapshot's).
    train(training, datums(data, "reverse"), 1, 1e-2)
    again = sampler.sample(prompt=prompt, num_samples=3, sampling_params=params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in first.sequences]
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints([1, 70, 71, 72])).result()
    assert logprobs[0] is None and all(v < 0 for v in logprobs[1:])
    # Stops: a token id or a string ends a sample where it first appears (included), as the
    # same draws would have stopped there.
    free = first.sequences[0]
    ascii_at = next(i for i, t in enumerate(free.tokens) if 32 < t - 3 < 127)  # one byte: one token
    for stop, cut in (
        (free.tokens[2], free.tokens.index(free.tokens[2]) + 1),
        (chr(free.tokens[ascii_at] - 3), ascii_at + 1),
    ):
        stopped = (
            sampler.sample(
                prompt=prompt,
                num_samples=1,
                sampling_params=types.SamplingParams(
                    max_tokens=5, temperature=1.0, seed=11, stop=[stop]
                ),
            )
            .result()
            .sequences[0]
        )
        assert stopped.tokens == free.tokens[:cut], (stop, stopped.tokens, free.tokens)
        assert stopped.stop_reason == "stop"
        assert stopped.logprobs == pytest.approx(free.logprobs[:cut], rel=1e-5)  # 1 row, not 3
    # Temperature 0: greedy decoding, whatever the seed, every sample the same.
    greedy = [
        sampler.sample(
            prompt=prompt,
            num_samples=2,
            sampling_params=types.SamplingParams(max_tokens=5, temperature=0.0, seed=seed),
        ).result()
        for seed in (1, 2)
    ]
    tokens = {tuple(s.tokens) for g in greedy for s in g.sequences}
    assert len(tokens) == 1 and 1 <= len(next(iter(tokens))) <= 5  # it may end at eos
    sc.close("success").result()


def test_get_tokenizer_works_offline_on_the_tiny_base(service):
    """The tiny base has no Hugging Face folder: the service hands the SDK its byte
    tokenizer as a local folder, so ``get_tokenizer()`` needs no Hub (before: 5 retries of
    huggingface.co/tiny and an OSError); its ids are the service's (bytes + 3, BOS 1)."""
    sc = service.client(KEYS[0])
    try:
        training = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        start = time.monotonic()
        tok = training.get_tokenizer()
        assert time.monotonic() - start < 20
        assert tok.encode("abc", add_special_tokens=False) == [100, 101, 102]
        assert tok.bos_token_id == ByteTokenizer.bos_id
        assert tok.eos_token_id == ByteTokenizer.eos_id
        assert tok.decode([100, 101, 102]) == "abc"
    finally:
        sc.close("success").result()  # the client's slot goes back for the tests after


def test_a_crashed_clients_slot_is_freed_after_the_session_timeout(service, tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        "import os, signal, tinker\n"
        f"sc = tinker.ServiceClient(base_url={service.url!r}, api_key={KEYS[2]!r})\n"
        "client = sc.create_lora_training_client(base_model='tiny', rank=4).result()\n"
        "print(client.model_id, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)  # no goodbye, no more heartbeats\n"
    )
    done = subprocess.run(
        [str(REPO / ".venv/bin/python"), str(script)], capture_output=True, text=True, timeout=120
    )
    crashed = time.monotonic()
    assert done.returncode == -signal.SIGKILL, done.stderr
    model_id = done.stdout.split()[-1]
    with service.client(KEYS[2]) as sc:
        rest = sc.create_rest_client()
        assert rest.get_training_run(model_id).result().training_run_id == model_id  # held
        while True:
            try:
                rest.get_training_run(model_id).result()
            except tinker.NotFoundError:
                break
            assert time.monotonic() - crashed < SESSION_TIMEOUT + 30, "its slot was never freed"
            time.sleep(1)
    assert time.monotonic() - crashed > SESSION_TIMEOUT - 15  # not before its time
    assert re.search(r"api: ran \d+ calls \([^)]*\bfree\b", service.log.read_text())


# Each RL loss by Tinker's documented formula (one datum), with a config that clips.
RL_LOSSES = {
    "importance_sampling": ({}, lambda lp, o, a, c: -(torch.exp(lp - o) * a).sum()),
    "ppo": (
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        lambda lp, o, a, c: (
            -torch.min(torch.exp(lp - o) * a, torch.clamp(torch.exp(lp - o), 0.9, 1.1) * a).sum()
        ),
    ),
    "cispo": (
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        lambda lp, o, a, c: -(torch.clamp(torch.exp(lp - o), 0.9, 1.1).detach() * lp * a).sum(),
    ),
    "dro": ({"beta": 0.5}, lambda lp, o, a, c: -(lp * a - 0.25 * (lp - o) ** 2).sum()),
    "gspo": (
        {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
        lambda lp, o, a, c: (
            -torch.min(
                torch.exp((lp.detach() - o).mean() + lp - lp.detach()) * a,
                torch.clamp(torch.exp((lp.detach() - o).mean() + lp - lp.detach()), 0.9, 1.1) * a,
            ).sum()
        ),
    ),
}


@pytest.mark.parametrize("loss", list(RL_LOSSES))
def test_rl_losses_are_tinkers_formulas_and_train_as_the_clients_own_loss(service, data, loss):
    """Each RL loss through the service: its loss:sum is Tinker's formula on the model's
    log-probs, and a step trains as the same loss computed by the client
    (forward_backward_custom) does."""
    config, theirs = RL_LOSSES[loss]
    gen = torch.Generator().manual_seed(3)
    plain = datums(data, "reverse")
    old = [
        (-torch.rand(len(d.loss_fn_inputs["target_tokens"].data), generator=gen) * 3) for d in plain
    ]  # a sampler's log-probs
    adv = [torch.randn(len(o), generator=gen) for o in old]
    batch = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "logprobs": o.tolist(),
                "advantages": a.tolist(),
            },
        )
        for d, o, a in zip(plain, old, adv)
    ]

    def client_loss(lps):
        return sum(theirs(lp, o, a, config) for lp, o, a in zip(lps, old, adv))

    with service.client(KEYS[3]) as sc:
        served, custom = (
            sc.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
            for _ in range(2)
        )
        adam = types.AdamParams(learning_rate=1e-2, **ADAM)
        for _ in range(2):
            lps = [
                o["logprobs"].to_torch()
                for o in served.forward(plain, "cross_entropy").result().loss_fn_outputs
            ]
            out = served.forward_backward(batch, loss, loss_fn_config=config or None).result()
            assert out.metrics["loss:sum"] == pytest.approx(float(client_loss(lps)), rel=1e-5)
            served.optim_step(adam).result()
            custom.forward_backward_custom(plain, lambda _, lps: (client_loss(lps), {})).result()
            custom.optim_step(adam).result()
        after = [
            c.forward(plain, "cross_entropy").result().loss_fn_outputs for c in (served, custom)
        ]
        for a, b in zip(*after):
            assert torch.allclose(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-5)


def test_stable_reinforce_trains_on_recorded_samples_named_by_provenance(service, data):
    """rl_loop.py's datums (target 0 at the prompt's positions, provenance naming each
    sample): answered with the truncated-IS REINFORCE loss on the recorded log-probs; a datum
    naming no recorded sample of its session, or none at all, is refused."""
    prompt = list(b"reverse: abc\n")
    with service.client(KEYS[3]) as sc:
        client = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        sampler = client.save_weights_and_get_sampling_client(record_stability_info=True)
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=1)
        sequences = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result().sequences
        batch = []
        for k, seq in enumerate(sequences):
            n = len(seq.tokens)
            datum = types.Datum(
                model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": [0] * (len(prompt) - 1) + seq.tokens,
                    "logprobs": [0.0] * (len(prompt) - 1 + n),  # the record's are used
                    "advantages": [0.0] * (len(prompt) - 1) + [k - 1.0] * n,
                },
            )
            batch.append(
                datum.with_provenance(
                    model_input=[
                        types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=n - 1),
                    ],
                    loss_fn_inputs=[
                        types.PromptProvenanceSpan(
                            sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1
                        ),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=n),
                    ],
                )
            )
        out = client.forward_backward(batch, "stable_reinforce").result()
        want = 0.0
        for k, (seq, o) in enumerate(zip(sequences, out.loss_fn_outputs)):
            lp = o["logprobs"].to_torch()[len(prompt) - 1 :]
            ratio = torch.exp(lp - torch.tensor(seq.logprobs)).clamp(max=2.0)
            want += float(-(ratio * lp * (k - 1.0)).sum())
        assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
        with pytest.raises(tinker.BadRequestError, match="stable_reinforce needs provenance"):
            client.forward_backward(
                [
                    types.Datum(
                        model_input=batch[0].model_input, loss_fn_inputs=batch[0].loss_fn_inputs
                    )
                ],
                "stable_reinforce",
            ).result()
        other = sc.create_lora_training_client(base_model="tiny", rank=4).result()
        with service.client(KEYS[3]) as sc2:  # another session: its samples are not this one's
            stranger = sc2.create_lora_training_client(base_model="tiny", rank=4).result()
            with pytest.raises(
                tinker.RequestFailedError, match="names no recorded sample of this session"
            ):
                stranger.forward_backward(batch, "stable_reinforce").result()
        assert other.forward_backward(batch, "stable_reinforce").result().metrics["loss:sum"]


def test_forward_backward_custom_trains_as_its_loss_written_as_cross_entropy(service, data):
    """The SDK's forward_backward_custom (a forward, the client's loss and its gradient, then
    a weighted cross_entropy backward): a custom loss equal to the weighted negative
    log-likelihood trains a client as cross_entropy trains its twin."""

    def nll(batch, logprobs):
        loss = sum(
            -(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(batch, logprobs)
        )
        return loss, {"nll": float(loss)}

    batch = datums(data, "sort")
    with service.client(KEYS[3]) as sc:
        custom, twin = (
            sc.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
            for _ in range(2)
        )
        adam = types.AdamParams(learning_rate=1e-2, **ADAM)
        for _ in range(2):
            mine = custom.forward_backward_custom(batch, nll)
            custom.optim_step(adam).result()
            theirs = twin.forward_backward(batch, "cross_entropy").result()
            twin.optim_step(adam).result()
            assert mine.result().metrics["nll"] == pytest.approx(
                theirs.metrics["loss:sum"], rel=1e-5
            )
        after = [c.forward(batch, "cross_entropy").result() for c in (custom, twin)]
        for a, b in zip(*(out.loss_fn_outputs for out in after)):
            assert torch.allclose(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-5)


def test_a_key_reaches_only_its_own_clients_checkpoints_and_samplers(service, data):
    alice_sc = service.client(KEYS[0])
    alice = alice_sc.create_lora_training_client(base_model="tiny", rank=4).result()
    path = alice.save_state("mine").result().path
    sampler_path = alice.save_weights_for_sampler("mine-s").result().path
    bob = service.client(KEYS[1])
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=sampler_path).sample(
            prompt=types.ModelInput.from_ints([1, 2]),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=2),
        ).result()
    answer = httpx.post(
        f"{service.url}/api/v1/get_info",
        headers={"X-API-Key": KEYS[1]},
        json={"model_id": alice.model_id, "type": "get_info"},
    )
    assert answer.status_code == 404
    unknown = httpx.post(
        f"{service.url}/api/v1/get_info",
        headers={"X-API-Key": "tml-eve"},
        json={"model_id": alice.model_id, "type": "get_info"},
    )
    assert unknown.status_code == 401
    assert alice.forward_backward(datums(data, "add"), "cross_entropy").result()  # unharmed
    alice_sc.close("success").result()
    bob.close("success").result()


def test_listings_show_a_key_its_own_runs_and_checkpoints_and_only_the_owner_deletes(service):
    alice_sc, bob_sc = service.client(KEYS[0]), service.client(KEYS[1])
    alice = alice_sc.create_lora_training_client(
        base_model="tiny", rank=4, user_metadata={"task": "listing"}
    ).result()
    state = alice.save_state("listed").result().path
    sampler = alice.save_weights_for_sampler("listed-s").result().path
    rest, bob_rest = alice_sc.create_rest_client(), bob_sc.create_rest_client()
    run = rest.get_training_run(alice.model_id).result()
    assert (run.lora_rank, run.user_metadata, run.base_model) == (4, {"task": "listing"}, "tiny")
    assert (run.last_checkpoint.tinker_path, run.last_sampler_checkpoint.tinker_path) == (
        state,
        sampler,
    )
    listed = {c.tinker_path: c for c in rest.list_checkpoints(alice.model_id).result().checkpoints}
    assert set(listed) == {state, sampler} and listed[state].size_bytes > 0
    assert {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints} >= {
        state,
        sampler,
    }
    assert alice.model_id in [
        r.training_run_id for r in rest.list_training_runs().result().training_runs
    ]
    assert rest.get_weights_info_by_tinker_path(state).result().lora_rank == 4
    # Bob sees none of it and cannot delete it.
    assert alice.model_id not in [
        r.training_run_id for r in bob_rest.list_training_runs().result().training_runs
    ]
    assert state not in {
        c.tinker_path for c in bob_rest.list_user_checkpoints().result().checkpoints
    }
    for call in (
        lambda: bob_rest.get_training_run(alice.model_id).result(),
        lambda: bob_rest.list_checkpoints(alice.model_id).result(),
        lambda: bob_rest.delete_checkpoint_from_tinker_path(state).result(),
        lambda: bob_rest.get_weights_info_by_tinker_path(state).result(),
    ):
        with pytest.raises(tinker.NotFoundError):
            call()
    assert alice.load_state(state).result()  # still there
    # Alice deletes it: gone from the listing and the disk, and loading it is a 404.
    (folder,) = (service.log.parent / "run/api").glob("*/*/weights/listed")
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert not folder.exists()
    assert {c.tinker_path for c in rest.list_checkpoints(alice.model_id).result().checkpoints} == {
        sampler
    }
    with pytest.raises(tinker.NotFoundError):
        alice.load_state(state).result()
    alice_sc.close("success").result()
    bob_sc.close("success").result()


@pytest.mark.parametrize(
    "what", ["token outside the vocabulary", "too long", "unknown loss", "an input not read"]
)
def test_bad_training_requests_are_refused_and_change_nothing(service, data, what):
    sc = service.client(KEYS[2])
    client = sc.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    batch = datums(data, "add")
    before = (
        client.forward_backward(
            batch,
            "cross_entropy",
        )
        .result()
        .metrics["loss:sum"]
    )
    bad, loss = batch[:1], "cross_entropy"
    if what == "token outside the vocabulary":
        bad = [
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 10**6]),
                loss_fn_inputs={"target_tokens": [10**6, 2], "weights": [1.0, 1.0]},
            )
        ]
    elif what == "too long":
        bad = [
            types.Datum(
                model_input=types.ModelInput.from_ints([5] * 300),
                loss_fn_inputs={"target_tokens": [5] * 300, "weights": [1.0] * 300},
            )
        ]
    elif what == "unknown loss":
        loss = "custom"  # computed by the SDK's forward_backward_custom, never sent
    else:
        bad = [
            types.Datum(
                model_input=types.ModelInput.from_ints([1, 5, 6]),
                loss_fn_inputs={
                    "target_tokens": [5, 6, 7],
                    "weights": [1.0] * 3,
                    "mask": torch.ones(3),
                },
            )
        ]
    with pytest.raises(tinker.BadRequestError) as refused:
        client.forward_backward(bad, loss).result()
    # Refused with its reason, and the refusal is in the service's log with its key.
    reason = {
        "token outside the vocabulary": "is outside the vocabulary",
        "too long": "trainer.max_seq_len",
        "unknown loss": "loss_fn 'custom'",
        "an input not read": "mask: not served with cross_entropy",
    }[what]
    assert reason in str(refused.value)
    refusals = re.findall(
        r"api: refused POST /api/v1/forward_backward of tenant-\w+: 400 (.*)",
        service.log.read_text(),
    )
    assert any(reason in line for line in refusals), refusals
    # Nothing accumulated: the same forward-only loss, and training goes on.
    after = client.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert after == pytest.approx(before, rel=1e-6)
    sc.close("success").result()


def test_ranks_beyond_the_run_are_refused_and_clients_beyond_its_slots_paged(service):
    """A client past the device slots is served (its adapter paged between calls); the
    bound of api.max_training_clients answers 429 (tests/recipe/test_api_paging.py)."""
    with service.client(KEYS[3]) as sc:
        with pytest.raises(tinker.BadRequestError, match="ranks 1 to 32"):
            sc.create_lora_training_client(base_model="tiny", rank=64).result()
        with pytest.raises(tinker.BadRequestError, match="trains 'tiny'"):
            sc.create_lora_training_client(base_model="llama-70b", rank=4).result()
        clients = [
            sc.create_lora_training_client(base_model="tiny", rank=4).result()
            for _ in range(SLOTS + 1)
        ]
        for client in (clients[0], clients[-1]):
            assert client.forward(datums_of([1, 2, 3]), "cross_entropy").result()


def test_sigkill_then_a_data_parallel_restart_resumes_a_client_from_its_saved_state(data, tmp_path):
    """Killed (every process), restarted on the same run folder with 2 data-parallel ranks:
    a client made from its saved state repeats the uninterrupted run's losses and every
    datum's log-probs (datums split over the ranks, gathered back in order)."""
    run_dir, port = tmp_path / "run", free_port()
    batch = datums(data, "sort") + datums(data, "add")  # 8 datums: 4 per rank
    first = Service(run_dir, port, tmp_path / "first.log")
    client = first.client().create_lora_training_client(base_model="tiny", rank=8, seed=5).result()
    train(client, batch, 2, 1e-2)
    path = client.save_state("after-2").result().path
    want = train(client, batch, 2, 1e-2)
    want_logprobs = client.forward(batch, "cross_entropy").result().loss_fn_outputs
    assert first.kill() == -signal.SIGKILL
    second = Service(run_dir, port, tmp_path / "second.log", nproc=2)
    try:
        assert "data parallel 2" in second.log.read_text()
        resumed = second.client().create_training_client_from_state_with_optimizer(path).result()
        assert train(resumed, batch, 2, 1e-2) == pytest.approx(want, rel=1e-5)
        got = resumed.forward(batch, "cross_entropy").result().loss_fn_outputs
        for w, g in zip(want_logprobs, got, strict=True):
            assert g["logprobs"].tolist() == pytest.approx(w["logprobs"].tolist(), rel=1e-5)
        # `mmlora status` shows the service and its client; `mmlora stop` stops it.
        deadline = time.monotonic() + 60  # the status file is rewritten at most once a second
        while True:
            report = json.loads(mmlora("status", "--run-dir", str(run_dir), "--json").stdout)
            rows = report["jobs"]
            if (rows and rows[0]["steps_done"] == 2) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert report["trainer"]["service"]["url"] == second.url and report["trainer_alive"]
        (row,) = rows
        assert (row["name"], row["steps_done"]) == (resumed.model_id, 2)
        assert row["loss"] == pytest.approx(want[-1], rel=1e-5)
        assert "the training service stops" in mmlora("stop", "--run-dir", str(run_dir)).stdout
        assert second.proc.wait(60) == 0
        assert "api: stopped" in second.log.read_text()
        assert "training service stopped" in mmlora("status", "--run-dir", str(run_dir)).stdout
    finally:
        second.stop()


def mmlora(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(REPO / ".venv/bin/mmlora"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_the_service_refuses_to_start_without_keys(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MMLORA_API_KEYS"}
    done = subprocess.run(
        [str(REPO / ".venv/bin/mmlora"), "api", "--run-dir", str(tmp_path / "run"), "hf_dir=null"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no API keys" in done.stderr and not (tmp_path / "run" / "api").exists()


def test_a_taken_port_fails_the_launch_instead_of_serving(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                str(REPO / ".venv/bin/mmlora"),
                "api",
                "--run-dir",
                str(tmp_path / "run"),
                "--port",
                str(port),
                "hf_dir=null",
            ],
            cwd=REPO,
            env={**os.environ, "MMLORA_API_KEYS": KEYS[0]},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stdout + done.stderr
    assert "api: serving" not in done.stdout
