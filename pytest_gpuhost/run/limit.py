"""`--limit EXPR`: which targets a run keeps, by name or inventory group, applied to every target list.

The option is declared with the plugin's others (`run/settings.py`, ini `gpuhost_limit`); the
pattern language (Ansible's `a:b`, `a,b`, `a:&b`, `a:!b`, `all`, globs, `~regex`, subscripts,
`@file`, and our `and`/`or`/`not`) is the inventory's, `exec/inventory/pattern.py`. It is applied
in a `pytest_gpuhost_targets` wrapper that runs after every other implementation, in every process
alike, so every xdist worker collects the same hosts in the same order.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_gpuhost.exec.inventory.pattern import HostPattern, PatternError, compile_pattern
from pytest_gpuhost.run import settings
from pytest_gpuhost.run.scheduling import TARGET_NAMES

__all__ = ["matcher"]

_LIMIT = pytest.StashKey[HostPattern]()


def _option(config: pytest.Config) -> tuple[str | None, str]:
    """Return (the --limit value, where it came from)."""
    s = settings.read(config)
    return (str(s.limit), str(s.sources["limit"])) if s.limit else (None, "")


def matcher(config: pytest.Config) -> HostPattern | None:
    """Return the compiled --limit (compiled once; the targets hook may run before our configure)."""
    if _LIMIT in config.stash:
        return config.stash[_LIMIT]
    limit, where = _option(config)
    if not limit:
        return None
    try:
        config.stash[_LIMIT] = compile_pattern(limit)
    except PatternError as exc:
        raise pytest.UsageError(
            f"{where}={limit!r}: {exc}; write an Ansible pattern or and/or/not, "
            "e.g. --limit 'rack1:!gpu-node-07' or --limit 'rack1 and not gpu-node-07'"
        ) from None
    return config.stash[_LIMIT]


def pytest_configure(config: pytest.Config) -> None:
    matcher(config)  # a bad pattern is a usage error before anything connects


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_gpuhost_targets(config: pytest.Config, targets: list[Any]) -> Any:
    """Apply --limit after every other implementation, and record the final target names."""
    result = yield
    match = matcher(config)
    if match is not None and targets:  # no target at all is the "no target" usage error, said elsewhere
        try:
            targets[:] = match.select(targets)
        except PatternError as exc:
            limit, where = _option(config)
            raise pytest.UsageError(f"{where}={limit!r}: {exc}") from None
    config.stash[TARGET_NAMES] = [str(t.name) for t in targets]
    return result
