"""Load: discover checkpoints, read and verify their bytes."""
