"""rtp_prefork: a launcher plugin that forks restarted ranks from a pre-imported process.

Half of a new rank's start-up is importing torch, NVRx and the trainer, the same work at
every start. With this plugin the launcher starts `python -m rtp_prefork <trainer args>`
per rank instead of `python -m trainer`: the first worker group's local rank 0 also starts
one pre-imported process per node (`zygote`), and a rank the launcher starts later is forked
from it (docs/fault-tolerance.md). The trainer knows nothing of it; where the plugin is not
chosen (`resilience.prefork_workers=false`, or a launcher that does not call
`launcher_settings`), ranks start the usual way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the stand-in imports only the standard library
    from trainer.config import TrainConfig
    from trainer.launch import LauncherSettings

ENTRY_MODULE = "rtp_prefork"
"""What the launcher starts per rank when the plugin is on (`python -m rtp_prefork`)."""


def rank_module(config: TrainConfig) -> str:
    """The module a launcher starts per rank for `config`: this plugin's entry, or the trainer's."""
    return ENTRY_MODULE if config.resilience.prefork_workers else "trainer"


def launcher_settings(config: TrainConfig, settings: LauncherSettings | None = None) -> LauncherSettings:
    """`settings` (default: the launcher's defaults) with ranks started through this plugin
    when `config` asks for it."""
    import dataclasses

    from trainer.launch import LauncherSettings

    return dataclasses.replace(settings or LauncherSettings(), rank_module=rank_module(config))
