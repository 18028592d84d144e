"""A checkpoint's RNG: on a GPU machine the CUDA generator is saved and restored too (LoRA and
attention dropout on replicated values draw from it), simulated here on the CPU."""

import torch

from megatron_multilora.training.checkpoints import restore_rng_state, rng_state


def test_the_cuda_generator_is_saved_and_restored_where_there_is_one(monkeypatch):
    cuda_state = torch.arange(16, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **kw: cuda_state.clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, *a, **kw: restored.append(state))
    state = rng_state()
    assert torch.equal(state["cuda"], cuda_state)
    want = torch.rand(4)
    restore_rng_state(state)
    assert torch.equal(torch.rand(4), want)  # the CPU generator too
    assert len(restored) == 1 and torch.equal(restored[0], cuda_state)


def test_a_cpu_checkpoint_restores_on_a_gpu_machine_without_touching_its_generator(monkeypatch):
    state = rng_state()  # saved without CUDA
    assert state["cuda"] is None
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, *a, **kw: restored.append(s))
    restore_rng_state(state)
    assert restored == []


def test_checkpoints_of_earlier_versions_name_their_jobs_by_slot():
    """Before the paged table a checkpoint kept each training job's file by its slot; the
    queue's progress names the job in each slot. Both forms read as name -> (file, meta)."""
    from megatron_multilora.training.checkpoints import saved_jobs

    queue = [
        {"name": "rev", "status": "active", "slot": 1},
        {"name": "add", "status": "done", "slot": None},
        {"name": "srt", "status": "active", "slot": 0},
    ]
    old = {"slots": {0: {"rank": 4}, 1: {"rank": 8}}, "trainer": {"queue": queue}}
    assert saved_jobs(old) == {
        "srt": ("slot0.safetensors", {"rank": 4}),
        "rev": ("slot1.safetensors", {"rank": 8}),
    }
    new = {"jobs": {"rev": {"rank": 8}}, "trainer": {"queue": queue}}
    assert saved_jobs(new) == {"rev": ("job.rev.safetensors", {"rank": 8})}
