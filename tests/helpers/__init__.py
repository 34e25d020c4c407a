"""Shared helpers for quicksave's tests (state dicts, bit-exact comparison, checks)."""
