"""Sync and SSP settings (``SyncConfig``); the chief's side of them is in
:mod:`zmqps.roles.chief.modes`, the PS's in :mod:`zmqps.roles.ps.modes`."""

from zmqps.roles.configs import SyncConfig

__all__ = ["SyncConfig"]
