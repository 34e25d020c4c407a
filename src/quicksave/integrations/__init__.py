"""Integrations with training frameworks (imported explicitly, not by ``import quicksave``)."""
