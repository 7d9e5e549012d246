"""Hydra plumbing: where the configs live, their schemas, recipe catalog and validation."""
