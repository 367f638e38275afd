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
    """Larger than any node could ever hold, even with every device free."""
