"""Talking to other ranks: the one module that calls ``torch.distributed`` collectives
(``collectives``), the central round every cross-rank decision goes through
(``exchange``) and per-rank values (``replicas``)."""
