"""Tiers of checkpoints beyond the job's folder: node memory that outlives a trainer
(:mod:`.node_memory`, held by a per-node agent), and the pieces that read the fastest
copy of a step on recovery.

A tier is a location with its own commit rule, retention and reader; the manager's
session holds the list (:class:`~quicksave.manager.tiers.Tier`). This package sits above
saving and loading (a tier saves and loads through them) and below the front ends.
"""
