"""The run directory's durable state: manifest, run directory, locks, results, batch files, events."""
