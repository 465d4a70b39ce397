"""The head's run: the loop over batches (driver) and the run directory's durable state."""
