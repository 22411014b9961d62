"""Whether a peer rank's process on this host still runs, read from /proc.

A rank waiting on shared memory spins on a flag its peer will never set if that peer has died: gloo
notices a closed socket, a flag in /dev/shm cannot. So a shared-memory wait looks at its peers' processes
now and then and names the one that exited, seconds after, instead of waiting out ``HF_PARALLEL_TIMEOUT``.
A process is known by its pid and its start time (a pid the kernel hands out again later has another),
and looked at only where every peer was visible when the channel was made (one pid namespace): elsewhere
the wait keeps its timeout alone.
"""

from __future__ import annotations

import os

Identity = tuple  # (pid, start time in clock ticks after boot)


def _stat(pid: int | str) -> tuple[str, int] | None:
    """A process's state letter and start time, or None where it is gone (or /proc is not there)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the name, which may hold spaces or ')'
    except OSError:
        return None
    return fields[0], int(fields[19])  # stat(5)'s fields 3 (state) and 22 (starttime)


def identity() -> Identity | None:
    """This process's ``(pid, start time)``, for its peers to look at; None without /proc."""
    stat = _stat("self")
    return None if stat is None else (os.getpid(), stat[1])


def exited(peer: Identity) -> bool:
    """Whether the process ``peer`` names has ended: gone, another process under its pid, or a zombie."""
    stat = _stat(peer[0])
    return stat is None or stat[1] != peer[1] or stat[0] in ("Z", "X")


def watchable(peers: dict) -> dict | None:
    """``{rank: identity}`` where this process can see every one of them running (so an exit seen later is
    one), else None: a peer in another pid namespace, or no /proc, leaves its waits to the timeout."""
    if any(peer is None or exited(tuple(peer)) for peer in peers.values()):
        return None
    return {rank: tuple(peer) for rank, peer in peers.items()}


def exit_message(peers: dict | None, ranks) -> str | None:
    """"rank(s) [..] exited (process ..)" for those of ``ranks`` whose process has ended, or None."""
    if peers is None:
        return None
    dead = [rank for rank in ranks if exited(peers[rank])]
    if not dead:
        return None
    return f"rank(s) {dead} exited (process {', '.join(str(peers[rank][0]) for rank in dead)})"
