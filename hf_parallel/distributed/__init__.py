"""Ranks and what passes between them: the mesh's shape (``shape.py``, pure) and its process groups
(``mesh.py``: pp x sp x tp, ep), autograd collectives as conjugate pairs (``comm.py``: TP's f/g, SP's
all-to-all, the batch broadcast), the shared-memory channel for ranks on one host, point-to-point
message tags, and the bound on a rank that stops answering."""
