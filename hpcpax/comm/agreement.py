"""Agreement checks: things every rank must hold identically, compared once.

A plan, a config or a list of tensors that differs between ranks would make
the first collective deadlock or silently mix up buffers. :func:`check_same`
compares a hash of each named field with one small ``allgather`` and raises
:class:`~hpcpax.errors.MismatchError` on every rank together, naming the first
field that differs and which ranks hold which value.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["check_same", "fingerprint"]


def fingerprint(value) -> str:
    """A short stable hash of a JSON-able value (keys sorted)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _short(value, limit=120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_same(comm, what: str, fields: dict) -> None:
    """Raise on every rank unless all ranks of ``comm`` pass equal ``fields``.

    **Collective** over ``comm`` (one ``allgather`` of short hashes; a second
    one with the values only when they differ).

    Args:
        comm: an mpi4py communicator, or None for a single process.
        what: what is being compared, for the message (e.g. ``"dense tensors"``).
        fields: ordered mapping field name -> JSON-able value.

    Raises:
        MismatchError: naming the first differing field, its values and ranks.
    """
    from ..errors import MismatchError

    if comm is None or comm.Get_size() == 1:
        return
    mine = [(name, fingerprint(value)) for name, value in fields.items()]
    everyone = comm.allgather(mine)
    if all(entry == everyone[0] for entry in everyone):
        return
    values = comm.allgather(list(fields.items()))
    names = [[n for n, _ in entry] for entry in everyone]
    if any(n != names[0] for n in names):
        groups = {}
        for rank, n in enumerate(names):
            groups.setdefault(tuple(n), []).append(rank)
        detail = "; ".join(f"ranks {r}: fields {list(k)}" for k, r in groups.items())
        raise MismatchError(f"ranks disagree on {what}: different field lists ({detail})")
    for index, name in enumerate(names[0]):
        hashes = [entry[index][1] for entry in everyone]
        if len(set(hashes)) > 1:
            groups = {}
            for rank, h in enumerate(hashes):
                groups.setdefault(h, []).append(rank)
            detail = "; ".join(
                f"ranks {ranks} have {_short(values[ranks[0]][index][1])}"
                for ranks in groups.values()
            )
            raise MismatchError(f"ranks disagree on {what}: field {name!r} differs ({detail})")
