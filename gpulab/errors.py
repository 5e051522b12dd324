"""The lab's error type (its own module so every lab module can raise it)."""

from __future__ import annotations

__all__ = ["LabError"]


class LabError(RuntimeError):
    """A lab operation failed; the message is one line that says what and why."""
