"""Ready recipes of lightning_accel, one YAML per model x accelerator x technique."""
