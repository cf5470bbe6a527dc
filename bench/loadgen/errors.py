"""The load generator's exceptions. Per-request failures are data (`RequestResult.error`),
never exceptions; these are for configurations and targets the tool refuses."""

from __future__ import annotations


class LoadgenError(Exception):
    """Root of every error the load generator raises on purpose."""


class ConfigError(LoadgenError, ValueError):
    """A configuration value is out of range or malformed."""


class NonLocalTargetError(ConfigError):
    """The target URL is not on this machine; the tool only loads 127.0.0.1 / localhost."""


class TargetError(LoadgenError):
    """The target could not be queried before the run (e.g. model discovery failed)."""
