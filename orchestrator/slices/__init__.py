"""Slices: the Ray cluster, the slice actors and their layout, slices waiting for resources."""
