"""Exceptions the plugin raises; each carries a one-line message meant for an operator."""

from __future__ import annotations


class GpuhostError(Exception):
    """Base of every error this plugin reports as one line."""


class TargetError(GpuhostError):
    """A target description is malformed (URL, scheme, container spec, inventory)."""


class ConnectError(GpuhostError):
    """A target cannot be reached: unreachable, authentication refused, host key mismatch."""


class AgentError(GpuhostError):
    """The agent on a target died or an agent operation failed."""


class CommandTimeout(GpuhostError):
    """A command ran past its timeout and was killed on the target."""
