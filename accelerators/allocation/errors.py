"""Typed allocation errors. Each carries a sentence a user can act on (`str(error)`)."""

from __future__ import annotations


class AllocationError(Exception):
    """Base class: the request cannot be allocated as asked. Nothing was changed."""


class InvalidResourceRequest(AllocationError):
    """The request itself is malformed (unknown slot, negative amount, wrong mode)."""


class NotMultipleOfQuantum(AllocationError):
    """An fGPU amount that is not a whole number of quanta (Backend.AI's error of that name)."""


class InsufficientResource(AllocationError):
    """Not enough free capacity right now; it may fit later, when sessions end."""


class NeverSchedulable(AllocationError):
    """Larger than any node could ever hold, even with every device free. `parts`, where the
    reason has them: `{"asked", "most", "advice"}`, what was asked, the most any node can give
    and what to do, each a sentence (the message holds them too)."""

    def __init__(self, message: str, *, parts: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.parts = parts or {}


class UnknownDevice(NeverSchedulable):
    """A pinned device (`devices`: a UUID or a node's index) that no node in reach has: not too
    large, but nothing to place on. `pins`: those pins, as the request gave them."""

    def __init__(self, message: str, *, pins: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.pins = pins
