"""Agreement checks: things every rank must hold identically, compared once.

A plan, a config or a list of tensors that differs between ranks would make
the first collective deadlock or silently mix up buffers. :func:`check_same`
compares a hash of each named field with one small ``allgather`` and raises
:class:`~hpcpax.errors.MismatchError` on every rank together, naming the first
field that differs and which ranks hold which value.

Bad input is agreed the same way: a collective operation whose input failed
a check on one rank must fail on every rank, before any data moves.
:func:`refuse_together` is the one protocol for that (the parameter server
carries the status codes in its operation header; other collectives
exchange them with :func:`agree_input`).

Settings are agreed like data: :func:`check_options` compares the
``HPCPAX_*`` options that shape the job (marked ``agree`` in
:mod:`hpcpax.options`), so an MPMD launch with another environment on some
ranks stops at :func:`hpcpax.init`, naming the variable, instead of building
two layouts.
"""

from __future__ import annotations

import hashlib
import json

__all__ = ["check_same", "check_options", "fingerprint", "status_of", "refuse_together",
           "agree_input", "STATUS_OK", "STATUS_NONFINITE"]

STATUS_OK, STATUS_BAD_INDEX, STATUS_NONFINITE, STATUS_BAD_TYPE, STATUS_BAD_VALUE = range(5)


def _status_errors():
    from ..errors import NonFiniteError, SparseIndexError

    return {STATUS_BAD_INDEX: SparseIndexError, STATUS_NONFINITE: NonFiniteError,
            STATUS_BAD_TYPE: TypeError, STATUS_BAD_VALUE: ValueError}


def status_of(error) -> int:
    """Status code of a local input error (``STATUS_OK`` when None)."""
    if error is None:
        return STATUS_OK
    for status, cls in _status_errors().items():
        if isinstance(error, cls):
            return status
    return STATUS_BAD_VALUE


def refuse_together(comm, statuses, labels, error, what, raise_here=True) -> None:
    """Raise on every rank of ``comm`` if any rank's status is not OK.

    **Collective** over ``comm`` on the error path only (one ``bcast`` of the
    first offender's message); returns at once when every status is OK.

    Args:
        comm: the communicator of the operation.
        statuses: status code of each rank of ``comm`` (from :func:`status_of`).
        labels: how messages name each rank of ``comm`` (e.g. world ranks).
        error: this rank's own error, or None; re-raised here as it is.
        what: the refused operation, e.g. ``"push of 'emb'"``.
        raise_here: False on ranks that only take part (servers).
    """
    bad = [i for i, status in enumerate(statuses) if status != STATUS_OK]
    if not bad:
        return
    first = bad[0]
    message = comm.bcast(str(error) if comm.Get_rank() == first else None, root=first)
    if not raise_here:
        return
    if error is not None:
        raise error
    raise _status_errors()[int(statuses[first])](
        f"{what} refused on every rank: rank {labels[first]} sent bad input ({message}); "
        f"ranks with bad input: {[labels[i] for i in bad]}")


def agree_input(comm, error, what, labels=None) -> None:
    """:func:`refuse_together` for a collective without a header of its own.

    **Collective** over ``comm``: one small ``allgather`` of status codes
    (non-blocking, completed by the one wait policy).
    """
    import numpy as np
    from mpi4py import MPI

    from .polling import wait

    mine = np.array([status_of(error)], np.int64)
    statuses = np.empty(comm.Get_size(), np.int64)
    wait([comm.Iallgather([mine, MPI.INT64_T], [statuses, MPI.INT64_T])])
    refuse_together(comm, statuses, labels or list(range(comm.Get_size())), error, what)


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


def _plain(value):
    """NumPy scalars as Python ones: ``2`` and ``np.int64(2)`` hash alike."""
    return value.item() if hasattr(value, "item") and hasattr(value, "dtype") else value


def check_options(comm, arguments=None) -> None:
    """Raise on every rank unless all ranks of ``comm`` hold the same job-shaping options.

    **Collective** over ``comm`` (one small ``allgather``; a second one only on
    a mismatch). Compares :meth:`hpcpax.options.Options.agreed_values`; a
    value that fails to parse on some ranks is compared as its text, so the
    ranks disagree (or all raise the parse error later) together.

    Args:
        comm: an mpi4py communicator, or None for a single process.
        arguments: ``{variable: value}`` given in code that stands in for a
            variable (``hpcpax.init``'s ``servers_per_node``...); None entries
            leave the variable's own value.

    Raises:
        MismatchError: ``ranks disagree on HPCPAX_* settings: field
            'HPCPAX_X' differs (ranks [..] have a; ranks [..] have b)``.
    """
    from ..options import options

    fields = options.agreed_values()
    for variable, value in (arguments or {}).items():
        if value is not None:
            fields[variable] = value
    check_same(comm, "HPCPAX_* settings",
               {k: "unset" if v is None else _plain(v) for k, v in fields.items()})
