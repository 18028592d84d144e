"""Layouts built one after another in one process (as tests and sweeps do) release their
process groups: megatron's own teardown leaves every group, with its gloo threads, alive."""

import os

from megatron_multilora import destroy_parallel, init_parallel
from tests.distributed.conftest import TIMEOUT_S, assert_all_ranks


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_destroy_parallel_releases_the_layouts_process_groups():
    layouts = [
        dict(tensor_model_parallel_size=2, sequence_parallel=True),
        dict(expert_model_parallel_size=2),
        {},
    ]
    init_parallel(timeout_s=TIMEOUT_S, **layouts[0])
    destroy_parallel()
    before = _threads()
    for _ in range(4):
        for kwargs in layouts:
            init_parallel(timeout_s=TIMEOUT_S, **kwargs)
            during = _threads()
            destroy_parallel()
    after = _threads()
    # Each layout starts gloo threads for its groups (so the check can fail); teardown must
    # end them: 12 more layouts leave no more threads than one did.
    failures = (
        []
        if during > before and after <= before
        else [f"threads: {before} after one layout, {during} during one, {after} after 12 more"]
    )
    assert_all_ranks(failures)  # on the default group, which outlives the layouts
