"""Platform support: what megatron-core needs to run where CUDA or Transformer Engine is absent."""

import os
import warnings


def quiet_missing_accelerator_warnings() -> None:
    """Silence megatron's import-time notices that TE/Apex are absent, expected without an
    NVIDIA GPU. Runs on ``import megatron_multilora`` (the ``mmlora`` command line's too), so
    the GPU is looked for without importing torch: no NVIDIA driver device, no CUDA."""
    if os.path.exists("/dev/nvidiactl"):
        return
    for message in (
        r"Apex is not installed",
        r"Transformer Engine and Apex are not installed",
        r"full scope is deprecated",
    ):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def support_megatron_here() -> None:
    """Make megatron-core run on this machine: the CPU shims where CUDA is absent
    (:mod:`.cpu_support`), stand-ins for what it names from Transformer Engine where TE is
    absent, on any device (:mod:`.missing_te`)."""
    from megatron_multilora.platform.cpu_support import activate_cpu_support
    from megatron_multilora.platform.missing_te import define_missing_te_names

    activate_cpu_support()
    define_missing_te_names()
