"""Tools over checkpoints: inspect, convert, export, verify folders (used by the CLI)."""
