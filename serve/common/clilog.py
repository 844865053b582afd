"""Logging set-up shared by the pipeline CLIs (data, train, merge, quantize, pipeline).

Called once, in each entry point's ``main``; library modules only use
``logging.getLogger(__name__)``.
"""
from __future__ import annotations

import logging
import sys
import warnings

__all__ = ["setup_cli_logging"]

# TorchRec's planner banners, FBGEMM's dry-run notices and torch.fx's notice per traced
# forward would drown the progress lines a person watches.
_NOISY = ("torchrec", "fbgemm_gpu", "torch.fx._symbolic_trace")


def setup_cli_logging(fmt: str = "%(asctime)s %(message)s", level: int = logging.WARNING,
                      force: bool = False) -> None:
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr, force=force)
    # TorchRec/DDP deprecation notices: not actionable for our users.
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in _NOISY:
        logging.getLogger(name).setLevel(logging.ERROR)
