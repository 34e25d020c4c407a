"""The load engine: which checkpoint a load reads (``checkpoint.py``, one classification),
DCP's load planner with quicksave's checks and its steps (``planner.py``, ``steps.py``),
the reader and each chunk's read (``reader.py``, ``chunks.py``); and the tools around
loads: listing checkpoints (``catalog.py``, ``run_folder.py``), verifying their bytes
(``verify*.py``), stock DCP folders (``dcp_stock.py``)."""
