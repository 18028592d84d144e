"""``mmlora api`` serves each model family added with test_model_families.py: on a tiny random
transformers model of the family (saved with a tokenizer), a Tinker SDK client trains an
adapter, its loss falls, and it samples from the adapter."""

from pathlib import Path

import pytest
from tinker import types

from tests.recipe.test_api_service import Service, datums_of, free_port, train
from tests.recipe.test_model_families import NEW_FAMILIES, write_base


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_service_trains_and_samples_the_family(family: str, tmp_path: Path) -> None:
    base = write_base(tmp_path / "base", family)
    service = Service(
        tmp_path / "run",
        free_port(),
        tmp_path / "service.log",
        overrides=[f"hf_dir={base}", "trainer.max_seq_len=32"],
    )
    try:
        with service.client() as sc:
            client = sc.create_lora_training_client(base_model=base.name, rank=4).result()
            losses = train(client, datums_of([1, *range(40, 60)]), 3, 1e-2)
            sampler = client.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3)
            prompt = types.ModelInput.from_ints([1, 40, 41])
            out = sampler.sample(prompt=prompt, num_samples=2, sampling_params=params).result()
    finally:
        service.stop()
    assert losses[-1] < losses[0], losses
    assert [len(s.tokens) for s in out.sequences] == [4, 4]
