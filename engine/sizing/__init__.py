"""Sizing and pre-flight: capacities, memory formulas, sizing for the machine, TPU pre-flight."""
