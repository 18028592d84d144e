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
