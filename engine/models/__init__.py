"""The model: shared layers, one file per model family, its configuration, weights and presets."""
