"""Nightly health checks of GPU hosts: one test per check, parametrized per target.

The tests are made here from the checks' declarations (`DECLARED` in
pytest_gpuhost/modules/health/checks.py), one `test_NAME` each, in their order, with the
declaration's one line as the docstring; a check is added there, not here
(docs/health-checks.md, "Adding a health check").

All checks of a host are judged from one `health` facts request (suites/health/conftest.py);
thresholds come from the inventory's host and group variables (defaults:
pytest_gpuhost.modules.health.checks.THRESHOLDS, docs/fleet.md). Checks only report unless a safe fix
is allowed with `--fix=persistence` / `--fix=service`; under `--check-only` those show as
"would fix" with the exact command.

    pytest suites/health --inventory=fleet.yaml -n 16 --check-only --limit 'rack1 and not gpu-07'
"""

from __future__ import annotations

from collections.abc import Callable

from pytest_gpuhost.modules.health.checks import DECLARED, HealthCheck

Judge = Callable[[str], None]


def _test_of(check: HealthCheck) -> Callable[[Judge], None]:
    """Return the suite's test of one declared check: it judges that check on the target."""

    def test(judge: Judge) -> None:
        judge(check.name)

    test.__name__ = test.__qualname__ = f"test_{check.name}"
    test.__doc__ = check.holds
    return test


for _check in DECLARED:
    globals()[f"test_{_check.name}"] = _test_of(_check)
del _check
