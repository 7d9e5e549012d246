"""Benchmarks registered with ``lightning-accel bench``; importing a module registers it."""
