"""The lines our optional libraries log when imported that tell a user nothing: kept out of the output.

transformers and peft import torchao when it is installed, and torchao's import logs one
``Failed to load .../torchao/_C_*.so`` warning for each prebuilt kernel library this machine
cannot load (CUDA or another Python's builds: NF4, the only torchao feature used here, is
plain PyTorch), and torch's pytree logs a deprecation warning for each Enum torchao
registers. A user can do nothing about either. :func:`drop_import_noise` filters exactly
those records at their loggers; every other message of those loggers still shows.
"""

from __future__ import annotations

import logging
import re

# logger name -> the messages dropped (re.search on the formatted message)
IMPORT_NOISE = {
    "torchao": re.compile(r"^Failed to load \S*torchao[/\\]_C[^/\\\s]*\.so: "),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"),
}


class _DropImportNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def drop_import_noise() -> None:
    """Install the filters (once per process; a second call changes nothing)."""
    for name, pattern in IMPORT_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropImportNoise) for f in logger.filters):
            logger.addFilter(_DropImportNoise(pattern))
