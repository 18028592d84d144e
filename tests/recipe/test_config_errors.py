"""A run that cannot work fails before any process-group work, naming every problem."""

import pytest

from megatron_multilora.training.config import ConfigError, validate
from tests.recipe.conftest import compose_run, job


def test_all_problems_reported_at_once(demo_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a=", "completion": "b"}\n\n{"prompt": "a="\n')
    run = compose_run([
        "hf_dir=null", "lora.max_rank=7", "lora.fully_sharded=true", "parallel.tp=2", "model.num_attention_heads=3", "model.num_query_groups=1",
        f"adapters=[{job('big', demo_data, 'reverse', 3, rank=16)},"
        f"{job('nofile', demo_data, 'add', 3, dataset='/no/such/file.jsonl')},"
        f"{job('broken', demo_data, 'sort', 3, dataset=bad)}]",
        "lora.slots=2", "trainer.queue_jobs=false"])
    with pytest.raises(ConfigError) as err:
        validate(run)
    msg = str(err.value)
    assert "adapters.0 (big): rank=16 is outside 1..lora.max_rank=7" in msg
    assert "lora.max_rank=7 must be a multiple of it" in msg
    assert "num_attention_heads=3 is not divisible by tensor parallel size 2" in msg
    assert "/no/such/file.jsonl" in msg
    assert f"{bad}:3:" in msg  # the malformed line, by number
    assert "3 adapter jobs but lora.slots=2 and trainer.queue_jobs=false" in msg

    run = compose_run([f"hf_dir={tmp_path}/nowhere", f"adapters=[{job('a', demo_data, 'add', 3)}]"])
    with pytest.raises(ConfigError, match="hf_dir: .*nowhere/config.json not found"):
        validate(run)


def test_unknown_key_and_bad_type():
    with pytest.raises(ConfigError, match="bogus"):
        compose_run(["+trainer.bogus=1"])
    with pytest.raises(ConfigError, match="could not be converted"):
        compose_run(["trainer.max_seq_len=long"])


def test_recipe_validates_before_touching_the_process_group(demo_data, tmp_path):
    from recipes.multi_lora_finetune import MultiLoRAFinetuneRecipe

    run = compose_run([f"run_dir={tmp_path}", "hf_dir=null",
                       f"adapters=[{job('a', demo_data, 'add', 3, lr=-1)}]"])
    with pytest.raises(ConfigError, match="alpha and lr must be positive"):
        MultiLoRAFinetuneRecipe(run)
