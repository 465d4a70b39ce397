"""Sampling: each row's settings on the host and token selection on the device."""
