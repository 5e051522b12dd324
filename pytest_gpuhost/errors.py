"""Exceptions the plugin raises; each carries a one-line message meant for an operator.

Every error the plugin raises derives from `GpuhostError`, so the one-line error path (a usage
error at configure time, a one-line failure in a test) catches all of them. What happened is
decided from the type, never from the message text: `Unreachable` and its subclasses mean the
connection to one target (a host, or a container through its host) is gone or cannot be made;
every other error means an operation on a reachable target failed.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "AgentLost",
    "CommandTimeout",
    "ConnectError",
    "GpuhostError",
    "TargetError",
    "Unreachable",
]


class GpuhostError(Exception):
    """Base of every error this plugin reports as one line."""


class TargetError(GpuhostError):
    """A target description is malformed (URL, scheme, container spec, inventory)."""


class Unreachable(GpuhostError):
    """The connection to one target is gone or cannot be made (per connection, not per host)."""


class ConnectError(Unreachable):
    """A target cannot be reached: unreachable, authentication refused, host key mismatch."""


class AgentError(GpuhostError):
    """An agent operation failed on a target that still answers."""


class AgentLost(Unreachable, AgentError):
    """The agent died, its channel closed, or it stopped answering within the reply timeout."""


class CommandTimeout(GpuhostError):
    """A command ran past its timeout and was killed on the target."""
