"""Scheduling: sequences, the scheduler and its plain-data output for the runner."""
