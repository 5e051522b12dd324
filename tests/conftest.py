"""Fixtures shared by the plugin's own tests."""

from __future__ import annotations

pytest_plugins = ["pytester", "tests.helpers.sshd", "tests.helpers.s3server", "gpulab.pytest_fixtures"]
