"""Scripts a test starts in processes of their own (Lightning's launcher, or Lightning-style env vars), run by path.

A worker imports what it shares with its test from ``tests.support``; whoever starts it puts the repository root on
its ``PYTHONPATH`` (:func:`tests.support.user_script.run_user_script` does). A test imports a worker's constants and
reference helpers as ``tests.support.workers.<worker>``.
"""

from __future__ import annotations

from pathlib import Path

WORKERS = Path(__file__).resolve().parent
"""This folder: ``WORKERS / "<worker>.py"`` is the script to start."""
