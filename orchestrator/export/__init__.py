"""Exporting a run's records in corpus order."""
