"""Every slot's copy of one LoRA factor in one contiguous ``[N, ...]`` buffer.

Each slot keeps its own leaf Parameter (what its optimizer, gradient buffer and checkpoint
keys see), but the Parameter's data is a view ``buffer[i]``. The forward then reads the
active slots' factors as one view of the buffer (a copy only when the active slots are not
contiguous) instead of stacking N tensors, and backward hands each active slot its gradient
as a slice of one ``[G, ...]`` tensor: an idle slot is neither read nor given a gradient.

Anything that re-points a Parameter's data elsewhere (a dtype or device conversion, a
wrapper's own parameter buffer) breaks the aliasing; :meth:`SlotFactorBuffer.gather` then
falls back to stacking the Parameters, so results never depend on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_multilora.layers.factors import Factor


class _SlotFactors(torch.autograd.Function):
    """Identity on ``w`` (the active slots' factors, read from the buffer) whose backward
    gives the gradient to the slots' own Parameters, zero-padded to their full rank; or, where
    the buffer has a ``main_grad`` (``target``: its rows of these slots, or the whole of it
    with ``rows``, their indices), adds it there in one op (as megatron's gradient
    accumulation fusion adds a weight's gradient to its ``main_grad`` in backward)."""

    @staticmethod
    def forward(
        ctx,
        read: Callable[[], torch.Tensor],
        rank_index: tuple,  # type: ignore[override]
        full_shape: torch.Size,
        target: torch.Tensor | None,
        rows: torch.Tensor | None,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.rank_index, ctx.full_shape, ctx.target, ctx.rows = rank_index, full_shape, target, rows
        ctx.n_params = len(params)
        # Read here, not passed in: an input returned as the output would cost a view op.
        return read()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        cut = grad.shape[1:] != ctx.full_shape  # cut to a lower rank in forward
        if ctx.target is not None and ctx.rows is None:
            (ctx.target[ctx.rank_index] if cut else ctx.target).add_(grad)
            return (None,) * (5 + ctx.n_params)
        if cut:
            full = grad.new_zeros((grad.size(0), *ctx.full_shape))
            full[ctx.rank_index] = grad
            grad = full
        else:
            grad = grad.contiguous()  # each slot's slice then matches its Parameter's layout
        if ctx.target is not None:
            ctx.target.index_add_(0, ctx.rows, grad.to(ctx.target.dtype))
            return (None,) * (5 + ctx.n_params)
        return (None, None, None, None, None, *grad.unbind(0))


class SlotFactorBuffer:
    """One factor (:data:`~.factors.A` or :data:`~.factors.B`) of every slot of a layer, held
    contiguously; ``factor`` says where its rank dim is.
    The slots' Parameters are passed in on every call (the layer's current ones), so a
    Parameter replaced or re-pointed since is noticed rather than read stale.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], factor: Factor) -> None:
        self.factor = factor
        self.main_grad: torch.Tensor | None = None  # [N, ...] fp32 rows the gradients add to
        self._views: dict[tuple[int, int], tuple] = {}
        self._indices: dict[tuple, torch.Tensor] = {}
        self.realias(params)

    def realias(
        self, params: Sequence[torch.nn.Parameter], into: torch.Tensor | None = None
    ) -> None:
        """Copy ``params`` (every slot's, in slot order, one shape) into a fresh buffer, or
        into ``into`` (``[N, *shape]``, e.g. rows of the optimizer's parameter matrices), and
        point their data at it (after construction, and after a conversion such as
        ``module.to()`` replaced their data)."""
        with torch.no_grad():
            stacked = torch.stack([p.detach() for p in params])
            self.buffer = stacked if into is None else into.copy_(stacked)
        for i, p in enumerate(params):
            p.data = self.buffer[i]
        self._step = self.buffer.stride(0) * self.buffer.element_size()

    def _aliased(self, slots: Sequence[int], params: Sequence[torch.nn.Parameter]) -> bool:
        base = self.buffer.data_ptr()
        return all(
            p.data_ptr() == base + s * self._step and p.dtype == self.buffer.dtype
            for s, p in zip(slots, params)
        )

    def _rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Views of rows ``lo:hi`` of the buffer and of ``main_grad``, made once per span
        (a slice is an op on every call: every layer would pay it every micro-batch)."""
        views = self._views.get((lo, hi))
        if views is None or views[0] is not self.buffer or views[1] is not self.main_grad:
            grads = None if self.main_grad is None else self.main_grad[lo:hi]
            views = (self.buffer, self.main_grad, self.buffer[lo:hi], grads)
            self._views[(lo, hi)] = views
        return views[2], views[3]

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        """``slots`` as an index on the buffer's device, made once per set of slots (a list
        index is a host-to-device copy on every call)."""
        key = (tuple(slots), self.buffer.device)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) >= 64:  # a bounded cache: the sets in use come back
                self._indices.clear()
            index = self._indices[key] = torch.tensor(key[0], device=self.buffer.device)
        return index

    def gather(
        self, slots: Sequence[int], params: Sequence[torch.nn.Parameter], r: int
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor] | None]:
        """The factors of ``slots`` (ascending; ``params`` their Parameters) cut to rank
        ``r``: ``[G, ..., r, in]`` (A) or ``[G, ..., out, r]`` (B), differentiable w.r.t.
        ``params``; and, when it is a fresh copy rather than a view of the long-lived
        buffer, a function that rebuilds it (for :func:`.grouped_gemm.grouped_linear`)."""
        index = (slice(None), *self.factor.rank_index(r))
        full = r == self.buffer.size(self.factor.rank_dim)  # no cut: no slicing op

        def cut(w: torch.Tensor) -> torch.Tensor:
            return w if full else w[index]

        if not self._aliased(slots, params):

            def stack() -> torch.Tensor:
                return cut(torch.stack(list(params)))

            return stack(), stack
        lo, hi = slots[0], slots[-1] + 1
        contiguous = hi - lo == len(slots)
        values, grads = self._rows(lo, hi) if contiguous else (None, None)
        picked = None if contiguous else self._index(slots)

        def read() -> torch.Tensor:
            return cut(values if contiguous else self.buffer[picked])

        target = rows = None
        if self.main_grad is not None:
            target, rows = (grads, None) if contiguous else (self.main_grad, picked)
        w = _SlotFactors.apply(read, index, self.buffer.shape[1:], target, rows, *params)
        return w, None if contiguous else read
