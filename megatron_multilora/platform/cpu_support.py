"""Everything megatron-core 0.16.1 needs to run on a machine without CUDA.

Active only when ``torch.cuda.is_available()`` is False; on a GPU machine
:func:`activate_cpu_support` does nothing. Each shim names the megatron-core place it
covers and why; they were checked against megatron-core 0.16.1. What TE's absence needs
on any device is in :mod:`.missing_te`; nothing else in the package patches megatron.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import types
from collections.abc import Iterator

import torch

CHECKED_MEGATRON_VERSION = "0.16.1"
_log = logging.getLogger(__name__)
_active = False


class CPURNGStatesTracker:
    """Megatron's RNG-states tracker on the CPU generator.

    megatron's ``CudaRNGStatesTracker`` stores ``torch.cuda`` generator states; on CPU the
    same named streams (data-parallel, tensor-parallel, expert-parallel) live as CPU
    generator states and ``fork`` swaps the default CPU generator in and out.
    """

    def __init__(self, **_: object) -> None:
        self.reset()

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def cpu_support_active() -> bool:
    return _active


def activate_cpu_support() -> bool:
    """Install the CPU shims once; return True when they are active.

    A no-op (returning False) when CUDA is available, so GPU runs use megatron unchanged.
    """
    global _active
    if _active:
        return True
    if torch.cuda.is_available():
        return False

    _import_megatron_with_fusions_uncompiled()
    _warn_on_another_megatron()
    _patch_devices_and_rng()
    _patch_modules()
    _active = True
    return True


def _import_megatron_with_fusions_uncompiled() -> None:
    """Import megatron with its ``jit_fuser`` (torch.compile, applied to its fused GPU kernels
    as their modules load) off, as megatron's own ``disable_jit_fuser`` leaves it: preparing
    its functions for inductor is a large part of every process's start-up, and none of them
    runs on the CPU paths. Its dynamic inference engine's optional wandb logging is left off
    too (it imports wandb if it can, which is slow; the run's own wandb logging imports it
    when asked). A no-op where megatron is already imported."""
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile
    torch.compile = _uncompiled  # type: ignore[assignment]  # what megatron.core.jit binds
    hide_wandb = "wandb" not in sys.modules
    if hide_wandb:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` fails
    try:
        jit = importlib.import_module("megatron.core.jit")  # imports megatron.core first
    finally:
        torch.compile = compile_  # type: ignore[assignment]
        if hide_wandb:
            del sys.modules["wandb"]
    jit.disable_jit_fuser()  # for megatron modules imported later


def _uncompiled(model=None, **_):
    """torch.compile's call forms, returning the function unchanged."""
    return (lambda fn: fn) if model is None else model


def _warn_on_another_megatron() -> None:
    from megatron.core import package_info

    if package_info.__version__ != CHECKED_MEGATRON_VERSION:
        _log.warning(
            "CPU support was checked on megatron-core %s; running %s",
            CHECKED_MEGATRON_VERSION,
            package_info.__version__,
        )


def _patch_devices_and_rng() -> None:
    # mappings.py, layers.py (SP buffers), rotary get_emb and the MoE router allocate on
    # torch.cuda.current_device(); returning "cpu" puts those tensors on the CPU.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # parallel_state and dist_checkpointing call torch.cuda.synchronize() unconditionally.
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    # tensor_parallel/random.py stores torch.cuda RNG states; use CPU generator states.
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute (CheckpointFunction) saves and restores the "CUDA" RNG state; on
    # CPU the default generator is the only device generator.
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _patch_modules() -> None:
    """The megatron modules that reach for CUDA or a collective where the CPU has neither."""
    # moe/token_dispatcher.py: the alltoall dispatcher creates a torch.cuda.Stream at init and
    # moves split sizes to the host on it; gloo also needs host split sizes.
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_splits

    # pipeline_parallel/schedules.py: every schedule allocates its token counter with
    # device="cuda" (a literal, not current_device); the schedule module alone sees a torch
    # whose zeros() puts "cuda" tensors on the CPU.
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    schedules.torch = _TorchWithCPUZeros()

    # tensor_parallel/cross_entropy.py all-reduces three tensors per call over the TP group,
    # a group of one rank without TP: gloo still hands each to its worker thread and waits
    # (a round trip apiece, per micro-batch); over one rank they change nothing.
    cross_entropy = importlib.import_module("megatron.core.tensor_parallel.cross_entropy")
    cross_entropy.torch = _TorchSkippingOneRankReductions()

    # models/common/language_module.py: with tied embeddings under pipelining the last stage
    # syncs its copy of the word embeddings from the first stage after
    # ``weight.data = weight.data.cuda()``, which raises without CUDA; keep it on the CPU.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _on_cpu_tensors(
        LanguageModule.setup_embeddings_and_output_layer
    )


def _on_cpu_tensors(method):
    """``method`` with ``Tensor.cuda()`` returning the tensor itself during the call."""

    def wrapped(*args, **kwargs):
        real_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *_, **__: tensor  # type: ignore[method-assign]
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = real_cuda  # type: ignore[method-assign]

    return wrapped


class _TorchWithCPUZeros(types.ModuleType):
    """``torch`` for schedules.py: the same module but ``zeros(device="cuda")`` -> CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


class _DistributedSkippingOneRankReductions(types.ModuleType):
    """``torch.distributed`` whose blocking ``all_reduce`` over a group of one returns at once."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    def __getattr__(self, name: str):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_reduce(
        tensor: torch.Tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op: bool = False
    ):
        if not async_op and torch.distributed.get_world_size(group) == 1:
            return None
        return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)


class _TorchSkippingOneRankReductions(types.ModuleType):
    """``torch`` for cross_entropy.py: the same module but its ``distributed`` skips reductions
    over one rank."""

    distributed = _DistributedSkippingOneRankReductions()

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _host_splits(dispatcher, point: str, tokens_per_expert=None):
    """CPU stand-in for ``_maybe_dtoh_and_synchronize``: split sizes as host integers."""
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(dispatcher, name, None)
        if torch.is_tensor(value):
            setattr(dispatcher, name, value.numpy())
    return tokens_per_expert
