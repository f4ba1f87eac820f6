"""Locally built models (no hub downloads): see :mod:`hpcrl.compute.models.tiny`."""
