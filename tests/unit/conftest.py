import pytest

from megatron_multilora import destroy_parallel, init_parallel, support_megatron_here


@pytest.fixture(scope="session", autouse=True)
def single_process_parallel():
    """Unit tests run as a world of one (TP=1)."""
    support_megatron_here()
    init_parallel(seed=1234)
    yield
    destroy_parallel(destroy_process_group=True)
