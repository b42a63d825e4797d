"""The client's tests start the router's engine stand-in (tests/controlplane)."""

from tests.controlplane.conftest import processes

__all__ = ["processes"]
