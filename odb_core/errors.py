"""Exception types. Every error names the offending value."""

from __future__ import annotations


class ODBError(Exception):
    """Base class of every error raised by odb_core."""


class ConfigError(ODBError, ValueError):
    """An invalid configuration value, rejected before anything is applied."""


class SampleError(ODBError, ValueError):
    """A sample whose cost or identity is invalid."""


class OversizeSampleError(SampleError):
    """A sample larger than the budget under the `error` oversize policy."""


class DuplicateSampleError(SampleError):
    """A sample id observed twice in one epoch on one rank."""


class ProtocolError(ODBError, RuntimeError):
    """An event that is illegal in the rank's current protocol phase."""


class ODBPeerError(ODBError, RuntimeError):
    """A peer rank died, hung past `peer_timeout`, or sent an inconsistent message."""
