"""The point-to-point facade (``hpcpax.comm.messages``): what is sent is what arrives."""

import numpy as np
import pytest

from hpcpax.comm import polling
from hpcpax.comm.messages import ANY, Mailbox, done_now, tag_limit, wait_some


def _until(take, *args):
    backoff = polling.Backoff()
    while True:
        got = take(*args)
        if isinstance(got, np.ndarray) or (isinstance(got, tuple) and got[0]):
            return got
        backoff.pause()


@pytest.mark.mpi(min_size=2)
def test_bytes_and_objects_reach_rank_0_from_every_rank(comm, all_ok):
    rank, size = comm.Get_rank(), comm.Get_size()
    box = Mailbox(comm.Dup())
    if rank:
        box.send_bytes(np.arange(rank * 3, dtype=np.int64), 0, tag=11)
        box.send_object({"rank": rank, "text": "x" * rank}, 0, tag=12)
        box.flush()
        ok = box.reap() == 0
    else:
        got, objects = {}, {}
        for _ in range(size - 1):
            buffer = _until(box.take_bytes, 11)
            got[box.last_source] = buffer.view(np.int64)
            _, payload = _until(box.take_object, 12)
            objects[box.last_source] = payload
        ok = (all(np.array_equal(got[r], np.arange(r * 3)) for r in range(1, size))
              and objects == {r: {"rank": r, "text": "x" * r} for r in range(1, size)})
        ok = ok and box.take_bytes(11) is None and box.take_object(12, ANY) == (False, None)
    box.comm.Barrier()
    box.comm.Free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
def test_posted_receives_complete_with_wait_some(comm, all_ok):
    rank, size = comm.Get_rank(), comm.Get_size()
    box = Mailbox(comm.Dup())
    if rank == 0:
        arrays = [np.zeros(5, np.float32) for _ in range(1, size)]
        requests = [box.receive_into(a, r, tag=3) for r, a in enumerate(arrays, start=1)]
        done = set(done_now(requests))
        while len(done) < len(requests):
            done.update(wait_some(requests))
        ok = all(np.array_equal(a, np.full(5, r, np.float32))
                 for r, a in enumerate(arrays, start=1))
    else:
        box.send_bytes(np.full(5, rank, np.float32), 0, tag=3)
        box.flush()
        ok = True
    box.comm.Free()
    assert all_ok(ok and tag_limit(comm) >= 32767)
