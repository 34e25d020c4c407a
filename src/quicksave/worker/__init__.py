"""The checkpoint writer: persists staged bytes in the background (torch-free at start).

Trainer side: ``persisters`` (``ThreadPersister``, ``ProcessPersister``; settings in
``config``; hang detection in ``liveness``). Worker side: ``main`` (the process and its
message loop) → ``execute`` (one ``job``) → ``files`` (write, commit) and, for a
multi-rank save, ``multirank``; ``calls`` runs the NVRx-compatible API's calls (pickled
with ``fnpickle``). ``persist`` writes a rank's files straight from
tensors, without a staging pool (the DCP storage writer, the NVRx-compatible file writer).
"""
