"""Command implementations behind `convfirstnet <command>` and scripts/."""
