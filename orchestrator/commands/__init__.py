"""The command line (`pagefleet ...`) and the commands that are not a run."""
