import pytest
import torch

from megatron_multilora import destroy_parallel, init_parallel, support_megatron_here


@pytest.fixture(autouse=True)
def single_gpu_parallel():
    """Each test runs in a world of one on the GPU (an NCCL group), built afresh."""
    if not torch.cuda.is_available():
        yield
        return
    support_megatron_here()
    init_parallel(seed=0)
    yield
    destroy_parallel()


@pytest.fixture(scope="session", autouse=True)
def default_group_destroyed_at_the_end():
    """The default (NCCL) group too, once every test is done: NCCL warns of a leak otherwise."""
    yield
    if torch.distributed.is_initialized():
        destroy_parallel(destroy_process_group=True)
