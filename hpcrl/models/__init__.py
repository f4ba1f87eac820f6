"""Locally built models (no hub downloads): see :mod:`hpcrl.models.tiny`."""
