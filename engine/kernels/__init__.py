"""Attention kernels: the reference, the native CPU kernel and the Pallas TPU kernel's sizing."""
