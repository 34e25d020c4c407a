"""APIs compatible with other checkpointing libraries."""
