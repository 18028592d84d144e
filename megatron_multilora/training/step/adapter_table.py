"""The paged adapter table: more adapters than device slots.

Each adapter (a trainer job, a service client) has a key. While it has work it sits in one of
the step's device slots; when a slot is needed for another, the least recently used adapter
is paged out: its rows of :mod:`.slot_rows`' matrices (the parameters, fp32 masters where
they differ, both AdamW moments, and the gradients it is accumulating) and each layer's
rank, alpha and dropout are copied to host memory (pinned on a GPU, on a side stream), and
copied back into whichever slot is free when it has work again. A copy is exact, so a paged
adapter trains bit for bit as a resident one; its optimizer's step count and schedule stay
in its :class:`~.slot_optimizer.SlotOptimizer`, which :meth:`AdapterTable.place` moves to
the new slot.

A page-in writes the slot's rows and, per layer, three buffers and the slot's scale: no read
back to the host, O(slot) work whatever the number of adapters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from megatron_multilora.layers.lifecycle import multi_lora_modules
from megatron_multilora.training.step.slot_adamw import MOMENTS
from megatron_multilora.training.step.slot_optimizer import SlotOptimizer
from megatron_multilora.training.step.slot_step import SlotStep


@dataclasses.dataclass
class Page:
    """One paged-out adapter: its rows by matrix (``"values/dense"``, ``"exp_avg/expert"``,
    ...) and each layer's (rank, alpha, dropout)."""

    rows: dict[str, torch.Tensor]
    banks: list[tuple[int, float, float]]
    accumulated: bool  # it holds gradients not yet applied (a service client's)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.rows.values())


@dataclasses.dataclass
class PagingStats:
    """What paging cost so far: adapters moved each way, bytes, seconds on the host."""

    pages_in: int = 0
    pages_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0


class TableFull(RuntimeError):
    """More adapters asked to be resident at once than there are device slots."""


class AdapterTable:
    """The adapters of ``step``'s model by key: in a device slot or paged out to host memory.

    :meth:`place` makes a set of keys resident (a new key gets a free or freed slot, which
    its owner then fills); :meth:`forget` drops a key (its slot is then free, its page gone).
    """

    def __init__(self, step: SlotStep) -> None:
        self.step = step
        self.n_slots = step.n_slots
        self.slots: dict[Hashable, int] = {}  # resident key -> device slot
        self.pages: dict[Hashable, Page] = {}  # paged-out key -> its page
        self.optimizers: dict[Hashable, SlotOptimizer] = {}  # moved with their adapter
        self._used: dict[Hashable, int] = {}  # resident key -> last use (least recent: out)
        # The owner hears where a key now is (None: paged out).
        self.on_move: Callable[[Hashable, int | None], None] = lambda key, slot: None
        self._clock = 0
        self.stats = PagingStats()
        # Host buffers of pages paged back in, by matrix: reused (a fresh one costs its page
        # faults on the CPU), at most a turn's worth.
        self._spare: dict[str, list[torch.Tensor]] = {}
        self._side = torch.cuda.Stream() if self._device.type == "cuda" else None

    @property
    def _device(self) -> torch.device:
        return self.step.adamw.rows.grad_buffer.device

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slots or key in self.pages

    def __len__(self) -> int:
        return len(self.slots) + len(self.pages)

    def slot_of(self, key: Hashable) -> int | None:
        return self.slots.get(key)

    def free_slots(self) -> list[int]:
        used = set(self.slots.values())
        return [s for s in range(self.n_slots) if s not in used]

    def place(self, keys: Sequence[Hashable], room: int = 0) -> dict[Hashable, int]:
        """Every key of ``keys`` in a device slot (paged in where it was out; a new key gets
        an empty slot its owner fills), and ``room`` slots left free; the least recently used
        other keys are paged out to make room. Returns the slot of each key."""
        keys = list(dict.fromkeys(keys))
        if len(keys) + room > self.n_slots:
            raise TableFull(
                f"{len(keys)} adapters cannot be resident at once in {self.n_slots} device slots"
                + (f" with {room} left free" if room else "")
            )
        self._clock += 1
        wanted = set(keys)
        missing = [k for k in keys if k not in self.slots]
        free = self.free_slots()
        if len(free) < len(missing) + room:
            others = sorted((k for k in self.slots if k not in wanted), key=self._used.get)
            for key in others[: len(missing) + room - len(free)]:
                self.page_out(key)
            free = self.free_slots()
        for key in missing:
            slot = free.pop(0)
            self.slots[key] = slot
            page = self.pages.pop(key, None)
            if page is not None:
                self._page_in(page, slot)
            if key in self.optimizers:
                self.optimizers[key].move_to(slot)
            self.on_move(key, slot)
        for key in keys:
            self._used[key] = self._clock
        return {k: self.slots[k] for k in keys}

    def bind(self, key: Hashable, optimizer: SlotOptimizer) -> None:
        """``key``'s optimizer (moved to the key's slot whenever it pages in)."""
        self.optimizers[key] = optimizer

    def forget(self, key: Hashable) -> int | None:
        """Drop ``key``: its page, or its slot (returned: the owner clears it)."""
        self.pages.pop(key, None)
        self.optimizers.pop(key, None)
        self._used.pop(key, None)
        return self.slots.pop(key, None)

    def page_bytes(self, with_grads: bool = False) -> int:
        """The host memory one paged-out adapter takes (``with_grads``: a service client's,
        holding accumulated gradients)."""
        return sum(m[0].numel() * m.element_size() for _, m in self._matrices(with_grads))

    def page_out(self, key: Hashable) -> None:
        """``key``'s adapter to host memory; its slot is blank (alpha 0) afterwards."""
        slot = self.slots.pop(key)
        self._used.pop(key)
        start = time.perf_counter()
        accumulated = slot in self.step._accumulated
        rows = {}
        for name, matrix in self._matrices(accumulated):
            rows[name] = self._to_host(name, matrix[slot])
        banks = []
        for layer in multi_lora_modules(self.step.model):
            bank = layer.adapters
            banks.append((bank.ranks[slot], bank.alphas[slot], bank.rates[slot]))
            bank.release(slot)
        if self._side is not None:  # the copies read the gradients drop zeroes
            torch.cuda.current_stream().wait_stream(self._side)
        self.step.drop([slot])
        page = Page(rows, banks, accumulated)
        self.pages[key] = page
        self._record(out=page.nbytes, start=start)
        self.on_move(key, None)

    def _page_in(self, page: Page, slot: int) -> None:
        start = time.perf_counter()
        side = self._side
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with (
            torch.no_grad(),
            torch.cuda.stream(side) if side is not None else contextlib.nullcontext(),
        ):
            for name, matrix in self._matrices(page.accumulated):
                matrix[slot].copy_(page.rows[name], non_blocking=side is not None)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        for name, row in page.rows.items():  # its buffers serve the next page-outs
            spare = self._spare.setdefault(name, [])
            if len(spare) < self.n_slots:
                spare.append(row)
        if not page.accumulated:
            self.step.drop([slot])
        else:
            self.step._accumulated.add(slot)
        for layer, (rank, alpha, dropout) in zip(multi_lora_modules(self.step.model), page.banks):
            layer.adapters.restore(slot, rank, alpha, dropout)
        self._record(into=page.nbytes, start=start)

    def _matrices(self, with_grads: bool) -> Iterable[tuple[str, torch.Tensor]]:
        """Every ``[N, width]`` matrix holding an adapter's state, by page name."""
        adamw = self.step.adamw
        adamw.ensure_held()
        for kind, values in adamw.rows.values.items():
            if not values.numel():
                continue
            yield f"values/{kind}", values
            if adamw.masters[kind] is not values:
                yield f"param/{kind}", adamw.masters[kind]
            for moment in MOMENTS:
                yield f"{moment}/{kind}", adamw.moments[moment][kind]
            if with_grads:
                yield f"grad/{kind}", adamw.rows.grads[kind]

    def _to_host(self, name: str, row: torch.Tensor) -> torch.Tensor:
        """``row``'s copy in host memory: a buffer a page-in gave back, or a new one (pinned
        on a GPU)."""
        spare = self._spare.get(name)
        if spare:
            out = spare.pop()
        elif self._side is None:
            return row.clone()
        else:
            out = torch.empty(row.shape, dtype=row.dtype, pin_memory=True)
        if self._side is None:
            return out.copy_(row)
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            out.copy_(row, non_blocking=True)
        return out

    def _record(self, *, start: float, into: int = 0, out: int = 0) -> None:
        s = self.stats
        s.pages_in, s.bytes_in = s.pages_in + bool(into), s.bytes_in + into
        s.pages_out, s.bytes_out = s.pages_out + bool(out), s.bytes_out + out
        s.seconds += time.perf_counter() - start
