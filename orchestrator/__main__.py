from orchestrator.commands.cli import entry

raise SystemExit(entry())
