"""What a run shows: progress lines and progress.json, status, the throughput plot, tracking."""
