"""The authenticated HTTP service that plans, runs and exports on request."""
