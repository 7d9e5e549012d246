"""Hydra config groups of lightning_accel, shipped as package data (see config/locate.py)."""
