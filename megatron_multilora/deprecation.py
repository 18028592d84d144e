"""Renamed public names keep working for a while: users' code depends on them."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any


def renamed_arguments(**renames: str) -> Callable:
    """A function whose keyword arguments were renamed (``old="new"``): a call with an old
    name still works, with a DeprecationWarning naming the new one."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{fn.__qualname__}() got {old}= and {new}=: give {new}= only")
                warnings.warn(
                    f"{fn.__qualname__}({old}=...) is deprecated: it is now {new}=",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call

    return decorate


def renamed_property(old: str, new: str) -> property:
    """A read-only attribute renamed from ``old`` to ``new``: the old name still reads it,
    with a DeprecationWarning."""

    def get(self: Any) -> Any:
        warnings.warn(
            f"{type(self).__name__}.{old} is deprecated: read .{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self, new)

    return property(get, doc=f"Deprecated: :attr:`{new}`.")
