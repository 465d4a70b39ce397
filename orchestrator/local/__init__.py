"""Sampling without Ray in this process: `pagefleet generate` and `pagefleet.generate`."""
