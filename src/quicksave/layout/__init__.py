"""Where every byte of a checkpoint goes, decided before any is written: the per-rank
file plan (``plan``), the manifest skeleton it fixes (``skeleton``) and the DCP
``Metadata`` codec (``dcp_metadata``). Pure data and functions, shared by the save
paths, the staging pool and the torch-free worker (which imports ``layout.plan`` only)."""
