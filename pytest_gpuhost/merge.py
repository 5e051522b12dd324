"""`python -m pytest_gpuhost.merge`: the fleet merge CLI (code in `pytest_gpuhost.report.merge`)."""

from pytest_gpuhost.report.merge import *  # noqa: F403
from pytest_gpuhost.report.merge import __all__, main  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())
