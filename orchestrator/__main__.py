from orchestrator.cli import entry

raise SystemExit(entry())
