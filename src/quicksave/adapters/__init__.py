"""Adapters over quicksave's pipeline for other APIs (DCP's StorageWriter / StorageReader)."""
