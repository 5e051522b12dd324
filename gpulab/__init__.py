"""gpulab: emulated GPU hosts for pytest-gpuhost's tests and demo (see gpulab/host/lab.py).

``gpulab.Lab().up(profile, name=None, delay_ms=0) -> LabHost``; the names load lazily so that
``python -m gpulab.kernel.sysfs`` and the other entry points import only what they use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Lab", "LabError", "LabHost"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from gpulab.host import lab

        return getattr(lab, name)
    raise AttributeError(f"module 'gpulab' has no attribute {name!r}")
