"""Size classes: log2 buckets of a call's work, so latency and op time are compared like with like.

The detector judges each sample against its class's healthy latency; a capture records each step's work and
is compared with a baseline of the same majority class (``compare.compare_basis``).
"""

from __future__ import annotations

__all__ = ["MAX_SIZE_CLASS", "class_label", "size_class"]

#: Size classes are log2 buckets of a call's work; the last one holds everything from 2^MAX_SIZE_CLASS up.
MAX_SIZE_CLASS = 30


def size_class(size: int | None) -> int:
    """A call's size class: 0 when its work is unknown or at most 1, else ``floor(log2(size))``+1
    (1: 2-3, 2: 4-7, ... items or elements), capped at ``MAX_SIZE_CLASS``."""
    if size is None or size <= 1:
        return 0
    return min(int(size).bit_length() - 1, MAX_SIZE_CLASS)


def class_label(cls: int) -> str:
    """The ``size_class`` label of a class: "1" for class 0, else "lo-hi" (``2^c``..``2^(c+1)-1``)."""
    if cls <= 0:
        return "1"
    if cls >= MAX_SIZE_CLASS:
        return f"{1 << MAX_SIZE_CLASS}+"
    return f"{1 << cls}-{(1 << (cls + 1)) - 1}"
