"""Multi-rank saving: planning with a plan cache (``planning``, ``exchange``) and the
commit records that let a checkpoint commit without gathering write results
(``records``). Keep this package's import light: the torch-free worker process imports
``quicksave.ranks.records``."""
