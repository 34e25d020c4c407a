"""Save: collect → plan → stage → hand off to the worker; the engine orchestrates."""
