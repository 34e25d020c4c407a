"""The checkpoint worker: persists staged bytes in the background (torch-free at start)."""
