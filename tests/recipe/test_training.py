"""Training behaviour, in process on CPU fp32: per-adapter normalisation (mixed batch equals
alone, also with bf16 base GEMMs), isolation of a diverging job, the job queue, precision
and recompute."""

import json
import math

import pytest
import torch

import megatron_multilora as mm
from megatron_multilora import cli
from megatron_multilora.training.checks import validate
from megatron_multilora.training.config import ConfigError
from tests.recipe.conftest import QUIET, compose_run, job, losses_by_adapter, run_in_process
from tests.unit.test_packed_linear import needs_bf16_gemms

REL = 1e-5


def assert_same_curve(got: list[float], want: list[float], rel: float, what: str) -> None:
    assert len(got) == len(want) > 0, f"{what}: {len(got)} vs {len(want)} steps"
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= rel, f"{what}: worst relative difference {worst:.2e} > {rel:g}"


@pytest.mark.parametrize("gemms", ["fp32", pytest.param("bf16", marks=needs_bf16_gemms)])
def test_adapter_in_a_mixed_batch_trains_as_if_alone(demo_data, tmp_path, gemms):
    setting = [f"trainer.cpu_base_gemms={gemms}"]
    mixed, _ = run_in_process(
        tmp_path / "mixed",
        [job("rev", demo_data, "reverse", 5), job("add", demo_data, "add", 5)],
        setting,
    )
    alone, _ = run_in_process(tmp_path / "alone", [job("rev", demo_data, "reverse", 5)], setting)
    assert_same_curve(mixed["rev"], alone["rev"], REL, "rev loss")
    assert_same_curve(
        losses_by_adapter(tmp_path / "mixed", "grad_norm")["rev"],
        losses_by_adapter(tmp_path / "alone", "grad_norm")["rev"],
        REL,
        "rev gradient norm",
    )
    assert mixed["rev"][-1] < mixed["rev"][0]  # it learns
    assert abs(mixed["add"][0] - mixed["rev"][0]) > 1e-3  # a different task, a different loss


def test_diverging_job_is_skipped_then_stopped_without_touching_the_others(demo_data, tmp_path):
    healthy = [job("rev", demo_data, "reverse", 6), job("add", demo_data, "add", 6)]
    boom = job("boom", demo_data, "sort", 6, lr=1e30, grad_clip="null")
    with_bad, recipe = run_in_process(
        tmp_path / "bad", healthy + [boom], ["lora.slots=3", "trainer.max_bad_steps=2"]
    )
    without, _ = run_in_process(tmp_path / "good", healthy)
    for name in ("rev", "add"):
        assert_same_curve(with_bad[name], without[name], REL, f"{name} loss")
    states = {s.name: s for s in recipe.board.jobs}
    assert states["boom"].status == "failed" and "non-finite" in states["boom"].reason
    assert states["rev"].status == states["add"].status == "done"
    assert not (tmp_path / "bad" / "adapters" / "boom").exists()


def test_queue_hands_a_finished_slot_to_the_next_job(demo_data, tmp_path):
    jobs = [
        job("first", demo_data, "reverse", 3),
        job("second", demo_data, "add", 6),
        job("third", demo_data, "sort", 4),
    ]
    queued, recipe = run_in_process(tmp_path / "queue", jobs)  # 2 slots for 3 jobs
    alone, _ = run_in_process(tmp_path / "third", [jobs[2]])
    # third reuses first's slot (weights, optimizer, schedule reset) and trains as if fresh
    assert_same_curve(queued["third"], alone["third"], REL, "third loss")
    assert [s.steps_done for s in recipe.board.jobs] == [3, 6, 4]
    assert recipe.step == 7  # third ran steps 3..6 beside second
    for name in ("first", "second", "third"):
        config = json.loads(
            (tmp_path / "queue" / "adapters" / name / "adapter_config.json").read_text()
        )
        assert (
            config["name"] == name
            and config["steps"] == {"first": 3, "second": 6, "third": 4}[name]
        )


@pytest.fixture(scope="module")
def reference(demo_data, tmp_path_factory) -> dict[str, list[float]]:
    """Two jobs of 4 steps with the default settings: each adapter's losses by step."""
    jobs = [job("rev", demo_data, "reverse", 4), job("add", demo_data, "add", 4)]
    return run_in_process(tmp_path_factory.mktemp("reference") / "run", jobs)[0]


@pytest.mark.parametrize(
    "setting,rel",
    [
        ("trainer.recompute=full", 1e-6),
        ("trainer.recompute=selective", 1e-6),
        ("trainer.precision=bf16", 3e-2),
        pytest.param("trainer.cpu_base_gemms=bf16", 3e-2, marks=needs_bf16_gemms),
    ],
)
def test_precision_and_recompute_keep_per_adapter_results(
    demo_data, reference, tmp_path, setting, rel
):
    """Each setting against the same run with the defaults (fp32, no recompute)."""
    jobs = [job("rev", demo_data, "reverse", 4), job("add", demo_data, "add", 4)]
    ref = reference
    got, recipe = run_in_process(tmp_path / "alt", jobs, [setting])
    for name in ("rev", "add"):
        assert_same_curve(got[name], ref[name], rel, f"{name} loss with {setting}")
    if "precision=bf16" in setting:
        assert recipe.model[0].embedding.word_embeddings.weight.dtype == torch.bfloat16
        assert got["rev"] != ref["rev"]  # really ran in bf16
    if "cpu_base_gemms" in setting:
        fc1 = recipe.model[0].decoder.layers[0].mlp.linear_fc1.to_wrap
        assert fc1.weight.dtype == torch.float32 and fc1._frozen_gemm_dtype == torch.bfloat16
        assert got["rev"] != ref["rev"]


def test_job_can_start_from_an_exported_adapter(demo_data, tmp_path):
    first, _ = run_in_process(tmp_path / "first", [job("rev", demo_data, "reverse", 8)])
    exported = tmp_path / "first" / "adapters" / "rev"
    again, _ = run_in_process(
        tmp_path / "again", [job("rev", demo_data, "reverse", 1, init_from=exported)]
    )
    # The same first batch (data order follows the job's name), seen by the trained adapter
    # instead of a fresh (no-op) one.
    assert again["rev"][0] < first["rev"][0] - 0.05
    # Continuing it at another rank would silently cut (or pad) it: refused up front.
    with pytest.raises(ConfigError, match=r"holds a rank-8 adapter but rank=4; set rank=8"):
        run_in_process(
            tmp_path / "cut", [job("rev", demo_data, "reverse", 1, rank=4, init_from=exported)]
        )


def test_moe_model_trains_expert_adapters(demo_data, tmp_path):
    losses, _recipe = run_in_process(
        tmp_path / "moe",
        [job("rev", demo_data, "reverse", 3), job("add", demo_data, "add", 3)],
        ["model=tiny_moe", "model.hidden_size=64"],
    )
    assert len(losses["rev"]) == 3 and losses["rev"][-1] < losses["rev"][0]
    config = json.loads((tmp_path / "moe" / "adapters" / "add" / "adapter_config.json").read_text())
    assert config["base_model"]["num_moe_experts"] == 4


def export(*argv) -> int:
    return cli.main(["export", *map(str, argv)])


def test_mmlora_export_from_adapter_folder_and_checkpoint(demo_data, tmp_path, capsys):
    from safetensors.torch import load_file

    _, _recipe = run_in_process(
        tmp_path / "run",
        [job("rev", demo_data, "reverse", 4), job("add", demo_data, "add", 8)],
        ["checkpoint.save_interval=4"],
    )
    assert export(tmp_path / "run" / "adapters" / "rev", tmp_path / "a") == 0
    # at step 4 "add" was still training: export it from that checkpoint
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    capsys.readouterr()
    assert export(ckpt, tmp_path / "x", "--job", "rev") == 2
    assert "was not training" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert export(ckpt, tmp_path / "x") == 2
    assert "name the adapter with --job" in capsys.readouterr().err
    assert export(ckpt, tmp_path / "b", "--job", "add") == 0
    a = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 2 * 2 * 7  # 2 layers x 7 HF modules x (A, B)
    config = json.loads((tmp_path / "b" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16.0)
    capsys.readouterr()
    assert export(tmp_path / "run" / "adapters" / "rev", tmp_path / "a") == 2
    assert "--overwrite" in capsys.readouterr().err
    assert export(tmp_path / "nowhere", tmp_path / "c") == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err and not (tmp_path / "c").exists()


def test_hf_base_model_run_exports_peft_adapters_peft_can_load(demo_data, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    import megatron_multilora as mm
    from megatron_multilora.checkpoint.peft_format import import_peft
    from megatron_multilora.models.hf_import import load_hf_model
    from megatron_multilora.models.tiny_hf import write_tiny_llama

    base = write_tiny_llama(tmp_path / "tiny-llama", hidden_size=64)
    losses, recipe = run_in_process(
        tmp_path / "run", [job("rev", demo_data, "reverse", 3)], [f"hf_dir={base}"]
    )
    assert recipe.model[0].config.hidden_size == 64  # the architecture came from config.json
    folder = tmp_path / "run" / "peft" / "rev"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == 8

    mm.init_parallel()
    model, cfg = load_hf_model(str(base))
    mm.apply_multi_lora(model, 2, 8, 1.0)
    import_peft(model, 1, folder, cfg, "llama")
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    mm.set_tokens_per_adapter_slot(model, [0, 12])
    with torch.no_grad():
        want = model(ids, torch.arange(12)[None], None)
        got = (
            peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(folder))
            .eval()(ids)
            .logits
        )
    mm.destroy_parallel()
    assert (got - want).abs().max() <= 1e-4

    # A job can start from that PEFT folder: its first batch sees the trained adapter.
    again, _ = run_in_process(
        tmp_path / "again",
        [job("rev", demo_data, "reverse", 1, init_from=folder)],
        [f"hf_dir={base}"],
    )
    assert again["rev"][0] < losses["rev"][0] - 0.05


def test_a_run_without_eval_datasets_finishes_and_plots_its_loss_curves(
    demo_data, tmp_path, capsys
):
    run_in_process(
        tmp_path / "run",
        [job("rev", demo_data, "reverse", 2, eval_dataset="null")],
        ["logging.plots=true"],
    )
    out = capsys.readouterr().out
    assert "no job has an eval_dataset: no adapter x task table" in out
    assert "job rev: done after 2 steps" in out
    assert (tmp_path / "run" / "loss_curves.png").is_file()
    assert not (tmp_path / "run" / "adapter_task_loss.png").exists()


def test_a_run_cut_short_by_max_steps_exports_what_it_trained(demo_data, tmp_path, capsys):
    jobs = [
        job("rev", demo_data, "reverse", 6),
        job("add", demo_data, "add", 2),
        job("sort", demo_data, "sort", 3),
        job("late", demo_data, "sort", 3, start_step=9),
    ]
    _, recipe = run_in_process(tmp_path / "run", jobs, ["trainer.max_steps=4"])
    assert recipe.step == 4  # the run really stopped early, with rev and sort mid-budget
    out = capsys.readouterr().out
    adapters = tmp_path / "run" / "adapters"
    for name, steps, total, finished in (
        ("rev", 4, 6, False),
        ("add", 2, 2, True),
        ("sort", 2, 3, False),
    ):
        config = json.loads((adapters / name / "adapter_config.json").read_text())
        assert (config["steps"], config["total_steps"], config["finished"]) == (
            steps,
            total,
            finished,
        )
    assert not (adapters / "late").exists()
    assert (
        f"job rev: UNFINISHED: 4 of 6 steps (trainer.max_steps=4 reached), exported as is "
        f"-> {adapters / 'rev'}"
    ) in out
    assert "job late: not started (trainer.max_steps=4 reached) -> -" in out
    assert "set trainer.steps_per_job instead" in out
    assert "held-out loss of each adapter" in out  # unfinished adapters are evaluated too


def test_steps_per_job_shortens_every_job_with_a_complete_schedule(demo_data, tmp_path):
    jobs = [
        job("rev", demo_data, "reverse", 50, schedule="linear", warmup_steps=0),
        job("add", demo_data, "add", "null", epochs=3),
    ]
    _, recipe = run_in_process(tmp_path / "run", jobs, ["trainer.steps_per_job=3"])
    assert [(s.steps_done, s.status) for s in recipe.board.jobs] == [(3, "done"), (3, "done")]
    lrs = losses_by_adapter(tmp_path / "run", "lr")["rev"]
    assert lrs == pytest.approx([3e-3, 2e-3, 1e-3])  # the linear decay ran over 3 steps
    # Throughput counts every token processed; completion (loss) tokens are a part of them.
    rates = losses_by_adapter(tmp_path / "run", "tokens_per_s")["add"]
    loss_rates = losses_by_adapter(tmp_path / "run", "loss_tokens_per_s")["add"]
    assert all(r > 2 * lr > 0 for r, lr in zip(rates, loss_rates))


def test_init_from_keeps_the_adapters_alpha_project_and_rslora_peft(demo_data, tmp_path):
    first, _ = run_in_process(tmp_path / "first", [job("rev", demo_data, "reverse", 3, alpha=4)])
    exported = tmp_path / "first" / "adapters" / "rev"
    # The same adapter as a PEFT rsLoRA folder: lora_alpha / sqrt(r) is the same scale 4 / 8.
    peft_dir = tmp_path / "peft"
    assert export(exported, peft_dir) == 0
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    config.update(use_rslora=True, lora_alpha=4 / math.sqrt(8))
    (peft_dir / "adapter_config.json").write_text(json.dumps(config))

    again = {}
    for name, folder in (("project", exported), ("peft", peft_dir)):
        again[name], _ = run_in_process(
            tmp_path / name, [job("rev", demo_data, "reverse", 1, alpha="null", init_from=folder)]
        )
        saved = json.loads(
            (tmp_path / name / "adapters" / "rev" / "adapter_config.json").read_text()
        )
        assert saved["alpha"] == pytest.approx(4.0, rel=1e-6), name
    # Both continue the trained adapter at its own scale: the same first loss.
    assert again["peft"]["rev"][0] == pytest.approx(again["project"]["rev"][0], rel=1e-5)
    assert again["project"]["rev"][0] < first["rev"][0] - 0.05
    # A job alpha that differs from the adapter's is refused, naming the alpha to use.
    for folder in (exported, peft_dir):
        with pytest.raises(ConfigError, match=r"alpha=4 but alpha=16; set alpha=4 or leave"):
            run_in_process(
                tmp_path / "clash", [job("rev", demo_data, "reverse", 1, init_from=folder)]
            )


def test_export_peft_from_a_checkpoint_of_an_hf_run_uses_the_hf_architecture(demo_data, tmp_path):
    """The HF base (hidden 64) differs from the `model` group (tiny_dense, hidden 128)."""
    import peft
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from megatron_multilora.models.tiny_hf import write_tiny_llama

    base = write_tiny_llama(tmp_path / "tiny-llama", hidden_size=64)
    overrides = [f"hf_dir={base}", "checkpoint.save_interval=2"]
    jobs = [job("rev", demo_data, "reverse", 2), job("add", demo_data, "add", 4, dropout=0.05)]
    run_in_process(tmp_path / "run", jobs, overrides)
    # What a CLI run also leaves: the composed config (model group tiny_dense, hf_dir set).
    (tmp_path / "run" / "hydra").mkdir()
    OmegaConf.save(
        OmegaConf.structured(compose_run(overrides)), tmp_path / "run" / "hydra" / "config.yaml"
    )
    out = tmp_path / "add-peft"
    assert export(tmp_path / "run" / "checkpoints" / "step_00000002", out, "--job", "add") == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())
    assert config["lora_dropout"] == 0.05  # the job's value, not its float32 copy
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(out))
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_A[
        "default"
    ].weight.shape == (8, 64)
    # The run's own PEFT export records the job's exact dropout too.
    run_config = json.loads((tmp_path / "run" / "peft" / "add" / "adapter_config.json").read_text())
    assert run_config["lora_dropout"] == 0.05


def test_a_peft_export_says_its_prompt_format_and_generates_in_it(demo_data, tmp_path, capsys):
    """Each PEFT export carries a model card with the prompt format it trained on; its
    Python snippet and ``mmlora generate`` build the prompt exactly as training did
    (``record_forms.prompt_ids``: BOS, then the prompt) and generate the same text."""
    from transformers import AutoTokenizer

    from megatron_multilora.checkpoint.prompt_format import python_snippet
    from megatron_multilora.data.record_forms import prompt_ids
    from megatron_multilora.data.tokenizer import HFTokenizer
    from megatron_multilora.models.tiny_hf import write_tiny_llama

    base = write_tiny_llama(tmp_path / "tiny-llama", hidden_size=64)
    run_in_process(tmp_path / "run", [job("rev", demo_data, "reverse", 2)], [f"hf_dir={base}"])
    out = capsys.readouterr().out
    folder = tmp_path / "run" / "peft" / "rev"
    assert f"mmlora generate --adapter {folder}" in out and "[bos] + tok.encode(prompt" in out
    card = (folder / "README.md").read_text()
    assert "## Prompt format" in card and f"base_model: {base.resolve()}" in card

    prompt = "abc ="
    assert cli.main(["generate", "--adapter", str(folder), "--max-new-tokens", "6", prompt]) == 0
    generated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert generated["prompt"] == prompt

    snippet = python_snippet(str(base), str(folder)).replace("apple river stone =", prompt)
    snippet = snippet.replace("max_new_tokens=32", "max_new_tokens=6")
    scope: dict = {}
    exec(snippet, scope)  # the card's own snippet, as a user runs it
    printed = capsys.readouterr().out.strip()
    want = prompt_ids(prompt, HFTokenizer(AutoTokenizer.from_pretrained(base)))
    assert scope["ids"] == want and want[0] == 1  # the byte tokenizer's BOS, then the prompt
    assert printed == generated["completion"]


def test_the_card_snippet_reproduces_the_held_out_tables_exact_matches(demo_data, tmp_path):
    """The held-out table's exact matches are what a user gets with the PEFT export and the
    card's snippet: held-out records whose answers are the snippet's own generations (every
    other one spoiled) score exactly half in the run's table (a snippet that generated from
    another prompt, or a table that did, would score less)."""
    from megatron_multilora.checkpoint.prompt_format import python_snippet
    from megatron_multilora.models.tiny_hf import write_tiny_llama
    from megatron_multilora.training.trainer import Trainer

    base = write_tiny_llama(tmp_path / "tiny-llama", hidden_size=64)
    # fp32 frozen GEMMs, as transformers runs the snippet: greedy choices then agree on every
    # CPU (a random model's top two logits lie far apart next to fp32's rounding).
    fp32 = ["trainer.cpu_base_gemms=fp32"]
    run_in_process(
        tmp_path / "run", [job("rev", demo_data, "reverse", 4)], [f"hf_dir={base}", *fp32]
    )
    records = [json.loads(line) for line in (demo_data / "reverse.eval.jsonl").open()]
    answers = []
    for record in records:
        snippet = python_snippet(str(base), str(tmp_path / "run" / "peft" / "rev"))
        snippet = snippet.replace('"apple river stone ="', json.dumps(record["prompt"]))
        snippet = snippet.replace("max_new_tokens=32", "max_new_tokens=12")  # the trainer's
        snippet = snippet.replace("print(", "answer = (")
        scope: dict = {}
        exec(snippet, scope)
        answers.append(scope["answer"])
    assert len(set(answers)) > 1  # generations that depend on the prompt
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(
        "".join(
            json.dumps({"prompt": r["prompt"], "completion": a if i % 2 == 0 else a + " x"}) + "\n"
            for i, (r, a) in enumerate(zip(records, answers))
        )
    )
    check = job("check", demo_data, "reverse", 1, eval_dataset=str(held_out))
    run = compose_run(
        [*QUIET, f"run_dir={tmp_path / 'check'}", f"adapters=[{check}]", f"hf_dir={base}", *fp32]
    )
    validate(run)
    trainer = Trainer(run)
    trainer.setup()
    try:
        tables = trainer.tasks.tables([tmp_path / "run" / "adapters" / "rev"], trainer.board.jobs)
    finally:
        mm.destroy_parallel()
    assert tables.accuracy == [[0.5]], tables.accuracy
