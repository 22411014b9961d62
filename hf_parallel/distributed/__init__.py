"""Ranks and what passes between them: the mesh of process groups (pp x sp x tp, ep), autograd
collectives as conjugate pairs (TP's f/g now; SP's all-to-all and PP's send/recv beside them),
the shared-memory channel for ranks on one host, and the bound on a rank that stops answering."""
