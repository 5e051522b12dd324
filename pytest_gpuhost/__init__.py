"""pytest-gpuhost: verify GPU hosts and repair them as they go."""

from __future__ import annotations

__version__ = "0.1.0"
