"""pagefleet's orchestrator: Ray head, slice actors, manifests, tracking, service, command line."""
