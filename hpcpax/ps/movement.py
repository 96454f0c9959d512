"""The data movement of pulls and pushes, with local aggregation written once.

A pull or push of ``K`` variables is a chain of :class:`Hop` s, each one
all-to-all exchange of every variable's rows at once:

- with local aggregation, a *node hop* first: each worker packs its rows by
  the node worker that aggregates their partition (the partition's
  *delegate*, ``p % node_workers``) and exchanges them inside the node; the
  delegate deduplicates (pull) or sums (push) the node's share;
- then the *owner hop*: rows packed by the rank owning their partition.

Packing is :func:`~hpcpax.ops.partition_pack` on the device where the rows
are (a CUDA kernel on GPU workers, a Numba counting sort on the CPU), so
only packed buffers cross to the host for MPI. A pull goes back along the
same hops (:meth:`Hop.reply`), each undoing its packing. Every operation is
**collective** over ``topology.comm`` (servers pass empty arrays).
"""

from __future__ import annotations

import numpy as np

from ..backend import to_host
from ..comm.exchange import alltoallv_many, exchange_counts_many
from ..ops import dedup_sum, partition_pack
from .hot_rows import relays
from .hot_rows.routing import HotRows, pull_reply, push_chain
from .memory import MemoryBudgetError

__all__ = ["Hop", "DataMovement"]


def _unpack(values, order):
    """Rows back in the order they had before packing."""
    out = np.empty_like(values)
    out[order] = values
    return out


class Hop:
    """One all-to-all hop of ``K`` variables over ``comm``.

    Packs each variable's rows by destination (on their device), moves the
    packed buffers to the host and exchanges the counts (one ``Alltoall``
    for all ``K``). **Collective** over ``comm`` from construction on.

    Args:
        comm: the communicator of this hop.
        accounting: where bytes are counted; ``phase`` and ``names`` say how.
        phase: accounting phase (``pull``, ``push``, ``intra_node``).
        names: the ``K`` variable names.
        packs: ``K`` tuples ``(partitioning, ids, values or None,
            destination of each partition)``.
        ranks: world rank of each peer of ``comm`` (for the intra/inter split).
    """

    def __init__(self, comm, accounting, phase, names, packs, ranks=None):
        self.comm, self.accounting, self.phase, self.names, self.ranks = (
            comm, accounting, phase, list(names), ranks)
        size = comm.Get_size()
        self.send_counts = np.zeros((size, len(packs)), np.int64)
        self.orders, self.arrays = [], []
        for k, (partitioning, ids, values, dest_of_part) in enumerate(packs):
            # ids were checked against the table's rows before anything moved
            packed = partition_pack(ids, values, partitioning, dest_of_part, size, in_range=True)
            self.send_counts[:, k] = packed.counts
            self.orders.append(to_host(packed.order))
            self.arrays.append([to_host(packed.indices)] if values is None else
                               [to_host(packed.indices), to_host(packed.values)])
        #: Bytes of one packed row of each variable (its arrays together).
        self.widths = np.array([sum(a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
                                    for a in arrays) for arrays in self.arrays], np.int64)
        self.recv_counts = exchange_counts_many(comm, self.send_counts, accounting, phase,
                                                self.names, ranks)

    def send(self) -> list:
        """Send the packed rows; ``K`` lists of received arrays (rows by source rank)."""
        return alltoallv_many(self.comm, self.send_counts, self.recv_counts, self.arrays,
                              self.accounting, self.phase, self.names, ranks=self.ranks)

    def reply(self, arrays) -> list:
        """Answer what :meth:`send` received, one array per variable, row for row.

        Returns each variable's answers in the order its rows had before
        packing (the sender's input order).
        """
        back = alltoallv_many(self.comm, self.recv_counts, self.send_counts,
                              [[a] for a in arrays], self.accounting, self.phase, self.names,
                              ranks=self.ranks)
        return [_unpack(b[0], order) for b, order in zip(back, self.orders)]


class DataMovement:
    """Pull and push data movement of the parameter server (workers and servers).

    Args:
        topology: from :func:`hpcpax.init`.
        reduce: ``mean`` or ``sum`` of the workers' gradients at the owner.
        hot_rows: the :class:`~hpcpax.ps.hot_rows.routing.HotRows` setting (the
            same on every rank): rows many nodes touch travel once.
    """

    def __init__(self, topology, reduce="mean", hot_rows=None):
        self.topology = topology
        self.reduce = reduce
        self.hot = HotRows(hot_rows)
        #: ``on_owner_error(error)``: where an owner's table that cannot grow is
        #: reported (the protocol's ``defer``); None raises at once.
        self.on_owner_error = None
        nw = topology.node_workers
        self._node_ranks = (np.array(nw.allgather(topology.rank), np.int64)
                            if nw is not None else None)

    def _node_hop(self, phase_names, variables, ids, values):
        nw = self.topology.node_workers
        size = nw.Get_size()
        packs = [(v.layout.partitioning, i, val, v.layout.delegate_of_part(size))
                 for v, i, val in zip(variables, ids, values)]
        return Hop(nw, self.topology.accounting, "intra_node", phase_names, packs,
                   ranks=self._node_ranks)

    def _owner_hop(self, phase, variables, ids, values):
        packs = [(v.layout.partitioning, i, val, v.layout.owner_rank_of_part)
                 for v, i, val in zip(variables, ids, values)]
        return Hop(self.topology.comm, self.topology.accounting, phase,
                   [v.spec.name for v in variables], packs)

    def pull(self, variables, id_lists, aggregate) -> list:
        """Rows of each variable's unique ids (host arrays, in the ids' order).

        Args:
            variables: the :class:`~hpcpax.ps.variable.PsVariable` s.
            id_lists: unique ids per variable (host or device; empty on servers).
            aggregate: per variable, whether the node aggregates first.
        """
        requests = list(id_lists)
        la = [k for k, on in enumerate(aggregate) if on]
        if la:
            node = self._node_hop([variables[k].spec.name for k in la],
                                  [variables[k] for k in la], [requests[k] for k in la],
                                  [None] * len(la))
            inverses = []
            for j, (got,) in zip(range(len(la)), node.send()):
                requests[la[j]], inverse = np.unique(got, return_inverse=True)
                inverses.append(inverse.reshape(-1))
        owner = self._owner_hop("pull", variables, requests, [None] * len(variables))
        wanted = owner.send()
        names = [v.spec.name for v in variables]
        if self.hot.classify_pull(names):
            reply = relays.pull_reply if self.hot.route(names) == "relays" else pull_reply
            result, chose = reply(self.topology, variables, owner, wanted, self.hot,
                                  self._gather)
            self.hot.pulled(names, chose)
        else:
            rows = [self._gather(v, ids) for v, (ids,) in zip(variables, wanted)]
            result = owner.reply(rows)
            self.topology.accounting.record_owner("egress", sum(
                owner.send_counts[:, k] * v.spec.row_bytes for k, v in enumerate(variables)))
        if la:
            back = node.reply([result[k][inverse] for k, inverse in zip(la, inverses)])
            for k, rows_k in zip(la, back):
                result[k] = rows_k
        return result

    def push(self, variables, id_lists, value_lists, aggregate) -> None:
        """Move deduplicated gradients to their owners, who apply the optimizer.

        Args:
            variables: the :class:`~hpcpax.ps.variable.PsVariable` s.
            id_lists, value_lists: unique ids and their gradient rows per
                variable (host or device; empty on servers).
            aggregate: per variable, whether the node aggregates first.
        """
        acct = self.topology.accounting
        ids, values = list(id_lists), list(value_lists)
        la = [k for k, on in enumerate(aggregate) if on]
        if la:
            node = self._node_hop([variables[k].spec.name for k in la],
                                  [variables[k] for k in la], [ids[k] for k in la],
                                  [values[k] for k in la])
            for k, (got_ids, got_values) in zip(la, node.send()):
                with acct.timer("aggregate", variables[k].spec.name):
                    ids[k], values[k] = dedup_sum(got_ids, got_values)
        names = [v.spec.name for v in variables]
        if self.hot.chain_push(names):
            hop = self._owner_hop("push", variables, ids, [None] * len(variables))
            push = relays.push_relayed if self.hot.route(names) == "relays" else push_chain
            push(self.topology, variables, hop, ids, values, self.hot, self._apply)
            return
        owner = self._owner_hop("push", variables, ids, values)
        acct.record_owner("ingress", owner.send_counts @ owner.widths)
        for var, (got_ids, got_values) in zip(variables, owner.send()):
            self._apply(var, got_ids, got_values)

    def _owner_failed(self, error) -> None:
        if self.on_owner_error is None:
            raise error
        self.on_owner_error(error)

    def _gather(self, var, ids):
        """Owner side of a pull; zeros (and a deferred error) when the table cannot grow."""
        if not len(ids):
            return np.zeros((0, var.spec.dim), var.spec.dtype)
        try:
            return var.shard.gather(ids)
        except MemoryBudgetError as exc:
            self._owner_failed(exc)
            return np.zeros((len(ids), var.spec.dim), var.spec.dtype)

    def _apply(self, var, ids, values) -> None:
        """Owner side of a push: sum (or mean) the received rows, run the optimizer."""
        if var.shard is None:
            return
        with self.topology.accounting.timer("apply", var.spec.name):
            unique, summed = dedup_sum(ids, values)
            workers = self.topology.num_workers
            if self.reduce == "mean" and workers > 1:
                summed /= workers
            try:
                var.shard.apply(unique, summed)
            except MemoryBudgetError as exc:  # nothing applied on this owner
                self._owner_failed(exc)
