"""pytest plugin entry point: options, fixtures and hook wiring (filled in by the foundation)."""

from __future__ import annotations
