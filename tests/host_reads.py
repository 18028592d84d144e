"""A CPU stand-in for what a CUDA graph capture refuses: any op whose result, or whose
output's shape, depends on tensor values the host would have to read back.

On a GPU such an op syncs with the device ("operation not permitted when stream is
capturing"); on the CPU it just runs, and ``.tolist()`` / ``int(t)`` of a CPU tensor do not
even pass through torch's dispatcher, so counting ``aten::_local_scalar_dense`` in a
profile misses them. Inside :func:`refuse_host_reads` each of them raises :class:`HostRead`:
Python-side reads of a tensor's values (``tolist``, ``item``, ``int``, ``float``, ``bool``,
use as an index, ``numpy``) and the data-dependent aten ops (``nonzero`` and what is built
on it: boolean-mask indexing, ``masked_select``; ``repeat_interleave`` without
``output_size``; ``unique``, ``bincount``, ``_local_scalar_dense``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostRead(RuntimeError):
    """An op that reads tensor values back to the host (a CUDA graph capture refuses it)."""


_DATA_DEPENDENT = {
    aten.nonzero,
    aten.masked_select,
    aten._local_scalar_dense,
    aten.bincount,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
}
_PYTHON_READS = ("tolist", "item", "numpy", "__int__", "__float__", "__bool__", "__index__")


class _RefuseDataDependent(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _DATA_DEPENDENT:
            raise HostRead(f"{func} reads tensor values back to the host")
        if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
            raise HostRead(f"{func} without output_size reads the repeats back to the host")
        if packet in (aten.index, aten.index_put, aten.index_put_) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        ):
            raise HostRead(f"{func} with a boolean mask reads the mask's count to the host")
        return func(*args, **kwargs)


def _refuse(name: str):
    def read(self: torch.Tensor, *args, **kwargs):
        raise HostRead(f"Tensor.{name} reads a tensor of shape {tuple(self.shape)} to the host")

    return read


@contextlib.contextmanager
def refuse_host_reads() -> Iterator[None]:
    """Raise :class:`HostRead` at any host read of a tensor's values while inside."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in _PYTHON_READS}
    try:
        for name in _PYTHON_READS:
            setattr(torch.Tensor, name, _refuse(name))
        with _RefuseDataDependent():
            yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
