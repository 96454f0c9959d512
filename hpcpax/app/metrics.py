"""Run outputs on rank 0: ``metrics.jsonl`` lines and the progress bar.

One JSON object per line, written whole with one ``write`` as it comes, so a
killed run keeps every finished step and ``python -m hpcpax.report`` can read
a run still going. A write that fails (a full disk) is taken back to the last
whole line and ends the run with one line; a resumed run first drops a line
cut off by a crash. Nothing here is collective.
"""

from __future__ import annotations

import json
import math
import os
import sys

from ..errors import CheckpointError

__all__ = ["MetricsWriter", "ProgressBar", "read_metrics", "json_safe", "write_json"]


def json_safe(value):
    """``value`` with NumPy scalars and non-finite floats made JSON-plain."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Append-only JSON-lines writer (a no-op when ``enabled`` is False).

    Lines are only ever appended, each whole or not at all. A resumed run
    first appends a marker ``{"resumed_at": S}``: steps after ``S`` logged
    by the interrupted run (after its last checkpoint) are then superseded by
    the resumed run's lines, which :func:`read_metrics` applies. Before the
    marker, a last line the interrupted run left cut off is dropped (one
    line printed says so), so the marker starts a line of its own.

    Args:
        path: the ``metrics.jsonl`` file.
        enabled: True on the one rank that writes.
        resumed_at: the checkpoint step a resumed run continues after.
        job_id: recorded in the resume marker.
        log: prints the repair note (default ``print``).

    Raises:
        CheckpointError: a line could not be written whole (the file then
            ends with the line before it).
    """

    def __init__(self, path, enabled=True, resumed_at=None, job_id=None, log=None):
        self.path = os.fspath(path)
        self.enabled = enabled
        self._file = None
        if not enabled:
            return
        self._file = self._guard(lambda: open(self.path, "ab", buffering=0))
        if resumed_at is not None:
            note = self._guard(self._repair_tail)
            if note:
                (log or (lambda text: print(text, flush=True)))(note)
            self.write({"resumed_at": int(resumed_at), "job_id": job_id})

    def write(self, record: dict) -> None:
        """Append ``record`` as one JSON line (nothing on ranks that do not write)."""
        if self._file is None:
            return
        line = (json.dumps(json_safe(record), sort_keys=False) + "\n").encode("utf-8")
        fd = self._file.fileno()
        start = os.fstat(fd).st_size
        try:
            done = os.write(fd, line)  # unbuffered: the kernel gets the whole line at once
            while done < len(line):  # a short write: the rest fails too on a full disk
                written = os.write(fd, line[done:])
                if written == 0:
                    raise OSError(28, os.strerror(28))
                done += written
        except OSError as exc:
            try:
                os.ftruncate(fd, start)  # back to the last whole line
            except OSError:
                pass  # the next --resume drops the cut-off line
            raise self._error(exc) from None

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _repair_tail(self) -> str | None:
        """Drop a cut-off last line (or end a whole one); a note saying so, or None."""
        fd = self._file.fileno()
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        with open(self.path, "rb") as handle:
            handle.seek(max(0, size - (1 << 16)))
            tail = handle.read()
        if tail.endswith(b"\n"):
            return None
        cut = tail.rfind(b"\n")
        if cut < 0 and size > len(tail):  # a last line longer than 64 KiB: read it all
            with open(self.path, "rb") as handle:
                tail = handle.read()
            cut = tail.rfind(b"\n")
        piece = tail[cut + 1:]
        try:
            json.loads(piece)
            os.write(fd, b"\n")  # whole but for its newline: keep it
            return None
        except ValueError:
            pass
        os.ftruncate(fd, size - len(piece))
        return (f"resume: {self.path} ended in a line cut off mid-write ({len(piece)} bytes); "
                "dropped it")

    def _guard(self, action):
        try:
            return action()
        except OSError as exc:
            raise self._error(exc) from None

    def _error(self, exc) -> CheckpointError:
        return CheckpointError(f"writing {self.path} failed: {exc.strerror or exc} (the file "
                               "ends with its last whole line); free space or choose another "
                               "--run-dir, then --resume")


def read_metrics(path, raw=False) -> list:
    """The records of a ``metrics.jsonl`` as the run stands (a torn line is skipped).

    A ``resumed_at`` marker supersedes the step and eval records after its
    step written before it (the interrupted run's steps that the resumed run
    trained again); ``raw=True`` gives every line as ``(record, text)``.
    """
    out = []
    with open(path, encoding="utf-8") as handle:
        for text in handle:
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                continue
            if raw:
                out.append((record, text))
            elif "resumed_at" in record:
                out = [r for r in out if r.get("step", 0) <= record["resumed_at"]]
            else:
                out.append(record)
    return out


class ProgressBar:
    """tqdm bar with loss and samples/s; silent unless ``enabled`` and stderr is a TTY."""

    def __init__(self, total, initial=0, enabled=True):
        self._bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                             leave=True)

    @property
    def active(self) -> bool:
        """Whether a progress bar is shown on this rank."""
        return self._bar is not None

    def update(self, steps, loss, samples_per_s) -> None:
        """Advance by ``steps`` and show the loss and samples/s."""
        if self._bar is None:
            return
        self._bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{samples_per_s:,.0f}",
                              refresh=False)
        self._bar.update(steps)

    def write(self, text) -> None:
        """Print ``text`` above the bar (or plainly without one)."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Remove the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def write_json(path, value) -> None:
    """Write ``value`` (made JSON-safe) to ``path``, indented.

    Raises:
        CheckpointError: the file could not be written (one line, no traceback).
    """
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(json_safe(value), handle, indent=2)
    except OSError as exc:
        raise CheckpointError(f"writing {path} failed: {exc.strerror or exc}; free space or "
                              "choose another --run-dir") from None
