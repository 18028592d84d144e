"""Multi-process tests: run all of them in one launch,
``torchrun --nproc-per-node 2 -m pytest tests/distributed``.

Every rank runs the same tests in the same order; each test initialises its own parallel
layout. Failures are gathered from all ranks before asserting (``assert_all_ranks``), so a
failure on one rank fails the test on every rank instead of hanging the others; collectives
time out after ``TIMEOUT_S`` and pytest-timeout bounds each test.
"""

import os

import pytest
import torch.distributed as dist

from megatron_multilora import destroy_parallel, init_parallel, support_megatron_here

TIMEOUT_S = 60.0
WORST_REL_ERROR: dict[str, float] = {}  # per test, printed in the summary
WORLD = int(os.environ.get("WORLD_SIZE", "0"))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Rank 0 alone writes a ``--junitxml`` report: every rank runs the same tests, and a
    failure on any rank fails the test on all of them (``assert_all_ranks``)."""
    if int(os.environ.get("RANK", "0")) != 0:
        config.option.xmlpath = None


def pytest_collection_modifyitems(config, items):
    """Each test runs in launches of its world size: ``@pytest.mark.world(4)``, else 2."""
    for item in items:
        marker = item.get_closest_marker("world")
        need = marker.args[0] if marker else 2
        if WORLD != need:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs torchrun --nproc-per-node {need} (this launch: {WORLD or 1})"
                )
            )


@pytest.fixture
def layout():
    """Call ``layout(tp=.., ep=.., sp=.., pp=.., vpp=..)`` to initialise (again, for another
    layout in the same test); torn down after the test."""

    def init(
        tp: int = 1,
        ep: int = 1,
        sp: bool = False,
        seed: int = 1234,
        pp: int = 1,
        vpp: int | None = None,
    ) -> None:
        # What init_parallel requires (expert TP is 1, experts lie within a pipeline stage).
        if WORLD % (tp * pp) or (WORLD // pp) % ep:
            pytest.skip(
                f"needs a world divisible by tp={tp} x pp={pp} and by ep={ep} x pp (world {WORLD})"
            )
        destroy_parallel()
        support_megatron_here()
        init_parallel(
            tensor_model_parallel_size=tp,
            expert_model_parallel_size=ep,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            sequence_parallel=sp,
            seed=seed,
            timeout_s=TIMEOUT_S,
        )

    yield init
    destroy_parallel()


def assert_all_ranks(failures: list[str]) -> None:
    """Fail on every rank if any rank has failures, reporting each rank's messages."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(failures))
    msgs = [f"rank {r}: {m}" for r, fs in enumerate(gathered) for m in fs]
    assert not msgs, "\n".join(msgs)


def compare(failures: list[str], got, want, rel: float, what: str) -> float:
    """Record a failure when max|got - want| > rel * max|want|; return the relative error."""
    import torch

    if got is None:  # no gradient at all: only right where the reference has none (or zeros)
        if want is not None and want.abs().max() > 0:
            failures.append(f"{what}: missing gradient")
        return 0.0
    want = torch.zeros_like(got) if want is None else want
    err = (got.float() - want.float()).abs().max().item()
    scale = max(want.float().abs().max().item(), 1e-12)
    if err > rel * scale:
        failures.append(f"{what}: max abs error {err:.3e} > {rel:g} x {scale:.3e}")
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    WORST_REL_ERROR[test] = max(WORST_REL_ERROR.get(test, 0.0), err / scale)
    return err / scale


def pytest_terminal_summary(terminalreporter):
    if WORST_REL_ERROR:
        terminalreporter.section("worst relative error per test (this rank)")
        for test, rel in WORST_REL_ERROR.items():
            terminalreporter.write_line(f"{rel:.2e}  {test}")
