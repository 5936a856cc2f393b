"""Pure codemods (source text in, source text out) that add dynamic speculation disable to SGLang.

Nothing here knows about hosts, SSH or the terminal.
"""

from dynspec_patch.transforms.eagle_hooks import HookEagleWorkerCommand, HookEagleWorkerV2Command
from dynspec_patch.transforms.runtime_install import InstallRuntimeModuleCommand
from dynspec_patch.transforms.server_args_threshold import (
    AddDisableThresholdArgCommand,
    AddDisableThresholdSpecFieldsCommand,
)

# In write order: the runtime module exists before any hook imports it.
CODEMODS = (
    InstallRuntimeModuleCommand,
    AddDisableThresholdArgCommand,
    AddDisableThresholdSpecFieldsCommand,
    HookEagleWorkerCommand,
    HookEagleWorkerV2Command,
)

__all__ = [
    "CODEMODS",
    "AddDisableThresholdArgCommand",
    "AddDisableThresholdSpecFieldsCommand",
    "HookEagleWorkerCommand",
    "HookEagleWorkerV2Command",
    "InstallRuntimeModuleCommand",
]
