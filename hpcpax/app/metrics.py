"""Run outputs on rank 0: ``metrics.jsonl`` lines and the progress bar.

One JSON object per line, flushed as written, so a killed run keeps every
finished step and ``python -m hpcpax.report`` can read a run still going.
Nothing here is collective.
"""

from __future__ import annotations

import json
import math
import os
import sys

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

    Lines are only ever appended. A resumed run first appends a marker
    ``{"resumed_at": S}``: steps after ``S`` logged by the interrupted run
    (after its last checkpoint) are then superseded by the resumed run's
    lines, which :func:`read_metrics` applies.

    Args:
        path: the ``metrics.jsonl`` file.
        enabled: True on the one rank that writes.
        resumed_at: the checkpoint step a resumed run continues after.
        job_id: recorded in the resume marker.
    """

    def __init__(self, path, enabled=True, resumed_at=None, job_id=None):
        self.path = os.fspath(path)
        self.enabled = enabled
        self._file = None
        if not enabled:
            return
        self._file = open(self.path, "a", encoding="utf-8")
        if resumed_at is not None:
            self.write({"resumed_at": int(resumed_at), "job_id": job_id})

    def write(self, record: dict) -> None:
        """Append ``record`` as one JSON line (nothing on ranks that do not write)."""
        if self._file is None:
            return
        self._file.write(json.dumps(json_safe(record), sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file; later writes are dropped."""
        if self._file is not None:
            self._file.close()
            self._file = None


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
    """Write ``value`` (made JSON-safe) to ``path``, indented."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(json_safe(value), handle, indent=2)
