"""Process groups and RNG for one parallel layout, and their teardown.

``init_parallel`` is the single entry point a recipe or test calls: it starts
``torch.distributed`` from the torchrun environment (or as a one-process group), builds
megatron's ``parallel_state`` for the requested layout and seeds megatron's RNG trackers.
``destroy_parallel`` undoes the layout so a test can build another one in the same process.
"""

from __future__ import annotations

import datetime
import os
import random

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_multilora.platform.cpu_support import cpu_support_active
from megatron_multilora.validation import INIT_NAMES, layout_problems


def collective_device() -> torch.device:
    """Where a small host-built tensor must live for a collective: the current CUDA device
    under NCCL (which takes no CPU tensors), the CPU under gloo."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def data_parallel_sum(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU ``tensor`` summed over the data-parallel group (itself without one)."""
    if parallel_state.get_data_parallel_world_size() == 1:
        return tensor
    on_device = tensor.to(collective_device())
    dist.all_reduce(on_device, group=parallel_state.get_data_parallel_group())
    return on_device.cpu()


def _init_process_group(timeout_s: float) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        # A group of one on a free local port, without touching os.environ (child
        # processes must not mistake themselves for torchrun ranks).
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    sequence_parallel: bool = False,
    seed: int = 1234,
    timeout_s: float = 120.0,
    virtual_pipeline_model_parallel_size: int | None = None,
) -> None:
    """Initialize torch.distributed, megatron's parallel_state and RNG for one layout.

    The layout is checked against the world size first (the rules of
    :func:`~megatron_multilora.validation.layout_problems`); ``sequence_parallel`` is otherwise a
    model-config setting. ``virtual_pipeline_model_parallel_size`` (interleaved schedule:
    model chunks per pipeline rank) needs ``pipeline_model_parallel_size > 1``. Without CUDA,
    :func:`~megatron_multilora.platform.support_megatron_here` must have run.
    ``timeout_s`` bounds every collective, so a mismatched rank fails instead of hanging.
    Call :func:`destroy_parallel` before initializing another layout.

    Every rank's default generator gets ``seed`` (megatron's training loop adds
    ``100 * pipeline rank``; we do not, so that a model built after this call has the same
    base weights per global layer on any pipeline layout, see ``build_model_chunks``).
    """
    tp, pp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        expert_model_parallel_size,
    )
    vpp = virtual_pipeline_model_parallel_size
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    problems = layout_problems(world, tp, ep, pp, sequence_parallel, vpp, INIT_NAMES)
    if problems:
        raise ValueError("invalid parallel layout: " + "; ".join(problems))
    if not torch.cuda.is_available() and not cpu_support_active():
        raise RuntimeError(
            "megatron-core needs its CPU support on a machine without CUDA: call "
            "megatron_multilora.support_megatron_here() first (the recipe, the "
            "scripts and the tests do)"
        )
    _init_process_group(timeout_s)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=ep,
        # Expert LoRA segments rows by whole experts: experts are never tensor-split.
        expert_tensor_parallel_size=1,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        create_gloo_process_groups=torch.cuda.is_available(),
    )
    # The same default-generator seed on every rank (see above); the tracker adds the
    # per-TP-rank and expert streams.
    random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _layout_groups() -> list[dist.ProcessGroup]:
    """The process groups megatron's ``parallel_state`` holds for the current layout, but its
    ``*_GLOO`` ones, which ``destroy_model_parallel`` destroys itself (they are listed again
    in its list of every group it made, so they are left out by identity, not by name)."""
    found: dict[int, dist.ProcessGroup] = {}
    gloo: set[int] = set()
    for name, value in vars(parallel_state).items():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if not isinstance(item, dist.ProcessGroup) or item is dist.GroupMember.WORLD:
                continue
            if "GLOO" in name:
                gloo.add(id(item))
            else:
                found[id(item)] = item
    return [group for key, group in found.items() if key not in gloo]


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Tear down the parallel layout and its process groups; optionally the default process
    group too."""
    if parallel_state.model_parallel_is_initialized():
        groups = _layout_groups()
        parallel_state.destroy_model_parallel()
        # megatron forgets its groups without destroying them: torch keeps each alive, with
        # its gloo threads, for the life of the process. Tests that build one layout after
        # another then slow down to a crawl (thousands of gloo threads).
        for group in groups:
            dist.destroy_process_group(group)
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
