"""``python -m lightning_accel`` is the ``lightning-accel`` command."""

import sys

from lightning_accel.cli import main

sys.exit(main())
