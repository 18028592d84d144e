"""Each model family through the recipe as users launch it (torchrun CLI), from a tiny random
transformers model of the family saved with a tokenizer: two jobs train on two slots under
one layout, checkpoint, resume under another layout (the resumed run repeats the
uninterrupted one's losses and exports), and the PEFT exports load with peft without a
warning about their keys. (``mmlora api`` serving each family: test_api_model_families.py.)

Layouts: TP=2 (with sequence parallelism) then DP=2 for the dense families, EP=2 then TP=2
for the MoE ones. Tolerances: the two layouts reduce in different orders (observed per-step
loss differences around 1e-7 relative).
"""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_multilora.models.tiny_hf import byte_level_tokenizer
from tests.hf_models import make_hf_model
from tests.recipe.conftest import job, losses_by_adapter
from tests.recipe.test_cli import TORCHRUN, finish, launch

LAYOUTS = {
    "deepseek_v3": ("parallel=ep2", "parallel=tp2"),
    "glm4_moe": ("parallel=ep2", "parallel=tp2"),
    "gpt_oss": ("parallel=ep2", "parallel=tp2"),
    "qwen3_5_moe_text": ("parallel=ep2", "parallel=tp2"),
}
DENSE_LAYOUTS = ("parallel=tp2", "parallel=dp")
NEW_FAMILIES = [
    "llama3",
    "mistral",
    "phi3",
    "gemma3_text",
    "smollm3",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "qwen3_5_text",
    "qwen3_5_moe_text",
]
STEPS, SAVE_AT = 4, 2
LOSS_RTOL, TENSOR_RTOL = 1e-5, 1e-4


def write_base(folder: Path, family: str) -> Path:
    """The family's tiny test model with the byte tokenizer's vocabulary and special ids."""
    model = make_hf_model(family, vocab_size=264, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return folder


def command(run_dir: Path, base: Path, layout: str, demo: Path, extra: list[str] = ()) -> list:
    jobs = [
        job("rev", demo, "reverse", STEPS, dropout=0.0),
        job("add", demo, "add", STEPS, rank=4, alpha=8, dropout=0.0),
    ]
    return [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "--local-ranks-filter=0",
        "recipes/multi_lora_finetune.py",
        f"run_dir={run_dir}",
        f"hf_dir={base}",
        layout,
        f"adapters=[{','.join(jobs)}]",
        "lora.slots=2",
        "trainer.log_interval=1",
        "trainer.eval_interval=0",
        "trainer.micro_batch_tokens=256",
        "trainer.max_seq_len=32",
        f"checkpoint.save_interval={SAVE_AT}",
        "logging.wandb_mode=disabled",
        "logging.plots=false",
        *extra,
    ]


def assert_close(want: Path, got: Path) -> None:
    """The same tensors to TENSOR_RTOL; an expert that routed no token keeps B at zero."""
    a, b = load_file(str(want)), load_file(str(got))
    assert sorted(a) == sorted(b), got
    assert sum(bool(t.any()) for t in a.values()) > len(a) // 2, f"{want}: mostly zeros"
    for k in a:
        diff = ((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-30)).item()
        assert diff < TENSOR_RTOL or torch.equal(a[k], b[k]), f"{got}: {k} differs by {diff:.2e}"


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_family_trains_resumes_under_another_layout_and_exports(family, demo_data, tmp_path):
    base = write_base(tmp_path / "base", family)
    first, second = LAYOUTS.get(family, DENSE_LAYOUTS)
    whole = tmp_path / "whole"
    out = finish(
        launch(command(whole, base, first, demo_data), tmp_path / "a.log"), tmp_path / "a.log"
    )
    assert "job rev: done after 4 steps" in out and "job add: done after 4 steps" in out

    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    for folder in ("adapters", "peft"):
        shutil.rmtree(resumed / folder)
    checkpoint = resumed / "checkpoints" / f"step_{SAVE_AT:08d}"
    log = tmp_path / "b.log"
    extra = [f"checkpoint.resume={checkpoint}"]
    out = finish(launch(command(resumed, base, second, demo_data, extra), log), log)
    assert f"resumed from {checkpoint} at step {SAVE_AT}" in out

    want, got = losses_by_adapter(whole), losses_by_adapter(resumed)
    assert set(want) == set(got) == {"rev", "add"}
    for name in want:
        assert len(want[name]) == len(got[name]) == STEPS
        worst = max(abs(g - w) / abs(w) for g, w in zip(got[name], want[name]))
        assert worst < LOSS_RTOL, f"{family} {name}: losses differ by {worst:.2e}"
    for name in want:
        assert_close(
            whole / "peft" / name / "adapter_model.safetensors",
            resumed / "peft" / name / "adapter_model.safetensors",
        )
    assert_peft_loads_quietly(base, resumed / "peft" / "rev")


def assert_peft_loads_quietly(base: Path, folder: Path) -> None:
    """peft loads the export onto the transformers model, every key used, and the adapter
    changes the logits. The export names no rank or alpha pattern (peft 0.21 adds one for
    transformers 5's fused expert ``gate_up_proj`` when it converts per-expert adapters,
    and warns of it itself: that warning is allowed)."""
    import peft
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        before = plain(ids).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = peft.PeftModel.from_pretrained(plain, str(folder)).eval()
    config = json.loads((folder / "adapter_config.json").read_text())
    assert "rank_pattern" not in config and "alpha_pattern" not in config
    peft_own = (
        "_pattern keys did not match any targeted module and were ignored: ['.*\\\\.gate_up_proj']"
    )
    noisy = [
        str(w.message)
        for w in caught
        if ("match" in str(w.message) or "missing" in str(w.message))
        and peft_own not in str(w.message)
    ]
    assert not noisy, noisy
    with torch.no_grad():
        assert (wrapped(ids).logits - before).abs().max() > 1e-3


def test_deepseek_at_tp2_without_sequence_parallelism_is_refused_before_the_launch(
    demo_data, tmp_path, monkeypatch
):
    """megatron-core 0.16.1's MLA leaves the shared RoPE key's gradient partial over TP ranks
    without SP: the config check refuses the layout, naming the fix."""
    from megatron_multilora.training.checks import validate
    from megatron_multilora.training.config import ConfigError
    from tests.recipe.conftest import compose_run

    monkeypatch.setenv("WORLD_SIZE", "2")
    base = write_base(tmp_path / "base", "deepseek_v3")
    run = [
        f"hf_dir={base}",
        f"adapters=[{job('a', demo_data, 'add', 3)}]",
        "trainer.max_seq_len=32",
    ]
    with pytest.raises(ConfigError, match=r"needs sequence parallelism.*parallel.sp=true"):
        validate(compose_run([*run, "parallel.tp=2", "parallel.sp=false"]))
    validate(compose_run([*run, "parallel=tp2"]))
