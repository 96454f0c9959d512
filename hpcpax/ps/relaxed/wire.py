"""The messages of the message-driven (relaxed) parameter server.

Every message is one contiguous byte buffer: a header of int64 words, then
the payload. Data messages (pull, push, reply) carry sections, one per
variable, each ``(variable index, rows)``; a pull's payload is the ids of
every section back to back, a push's the ids then the value rows, a reply's
the rows. Control messages are a header alone.

Header: ``[kind, phase, clock, sections, argument]`` then ``sections`` pairs
``(variable index, rows)``. ``phase`` numbers the relaxed phases (between
two checkpoint barriers), so nothing of an earlier phase is taken for
this one.

Tags: workers send everything to servers with :data:`TAG_REQUEST` (one tag,
so MPI's non-overtaking rule keeps each worker's messages in the order it
sent them: a push is applied before the same worker's next pull is read);
servers answer pulls with :data:`TAG_REPLY` and send control messages with
:data:`TAG_CONTROL`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TAG_REQUEST", "TAG_REPLY", "TAG_CONTROL", "KIND_NAMES", "pack", "unpack",
           "control", "HEADER_WORDS"]

TAG_REQUEST, TAG_REPLY, TAG_CONTROL = 7401, 7402, 7403

# worker -> server
PULL, PUSH, DRAIN, STOP_REQUEST, CLOCK_REPORT = 1, 2, 3, 4, 5
# server -> worker
REPLY, STOP_QUERY, STOP_AT, DRAINED = 11, 12, 13, 14
KIND_NAMES = {PULL: "pull", PUSH: "push", DRAIN: "drain", STOP_REQUEST: "stop request",
              CLOCK_REPORT: "clock report", REPLY: "reply", STOP_QUERY: "stop query",
              STOP_AT: "stop at", DRAINED: "drained"}
HEADER_WORDS = 5


def pack(kind, phase, clock, sections, argument=0) -> np.ndarray:
    """One message as a uint8 buffer.

    Args:
        kind, phase, clock, argument: the header words.
        sections: ``[(variable index, ids or None, values or None)]``; the
            rows of a section is ``len(ids)`` (or ``len(values)``). Every
            section's ids come first, then every section's values.
    """
    head = [kind, phase, clock, len(sections), argument]
    blocks = []
    for index, ids, values in sections:
        rows = len(ids) if ids is not None else len(values)
        head += [index, rows]
    words = np.asarray(head, np.int64)
    for _, ids, _ in sections:
        if ids is not None:
            blocks.append(np.ascontiguousarray(ids, np.int64).view(np.uint8).reshape(-1))
    for _, _, values in sections:
        if values is not None:
            blocks.append(np.ascontiguousarray(values).view(np.uint8).reshape(-1))
    return np.concatenate([words.view(np.uint8)] + blocks) if blocks else words.view(np.uint8)


def header(buffer) -> tuple:
    """``(kind, phase, clock, argument, [(variable index, rows)])`` of a message."""
    words = np.frombuffer(buffer, np.int64, count=HEADER_WORDS)
    kind, phase, clock, count, argument = (int(w) for w in words)
    pairs = np.frombuffer(buffer, np.int64, count=2 * count,
                          offset=HEADER_WORDS * 8).reshape(count, 2)
    return kind, phase, clock, argument, [(int(i), int(n)) for i, n in pairs]


def unpack(buffer, row_formats, with_ids=True, with_values=False) -> tuple:
    """Header and payload of a data message.

    Args:
        buffer: the received bytes.
        row_formats: ``{variable index: (dim, dtype)}``.
        with_ids, with_values: which blocks the payload holds.

    Returns:
        ``(kind, phase, clock, argument, sections)`` with sections
        ``[(variable index, ids or None, values or None)]`` (views of ``buffer``).
    """
    kind, phase, clock, argument, pairs = header(buffer)
    offset = (HEADER_WORDS + 2 * len(pairs)) * 8
    ids = []
    for _, rows in pairs:
        if with_ids:
            ids.append(np.frombuffer(buffer, np.int64, count=rows, offset=offset))
            offset += rows * 8
        else:
            ids.append(None)
    sections = []
    for (index, rows), section_ids in zip(pairs, ids):
        values = None
        if with_values:
            dim, dtype = row_formats[index]
            dtype = np.dtype(dtype)
            values = np.frombuffer(buffer, dtype, count=rows * dim, offset=offset).reshape(rows,
                                                                                         dim)
            offset += rows * dim * dtype.itemsize
        sections.append((index, section_ids, values))
    if offset != len(buffer):
        raise ValueError(f"relaxed PS message of {len(buffer)} bytes holds {offset} bytes "
                         f"of {KIND_NAMES.get(kind, kind)} sections")
    return kind, phase, clock, argument, sections


def reply_bytes(pairs, row_formats) -> int:
    """Size of the reply to a pull of ``[(variable index, rows)]``."""
    size = (HEADER_WORDS + 2 * len(pairs)) * 8
    for index, rows in pairs:
        dim, dtype = row_formats[index]
        size += rows * dim * np.dtype(dtype).itemsize
    return size


def control(kind, phase, value=0) -> np.ndarray:
    """A control message (no sections): ``value`` in the clock word."""
    return pack(kind, phase, value, [])
