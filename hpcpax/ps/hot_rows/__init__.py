"""Hot rows travel once: trees or relays for the rows that many nodes touch.

* :mod:`~hpcpax.ps.hot_rows.routing`: :class:`HotRows` (the setting), the
  pull reply down broadcast trees and the push up reduction chains;
* :mod:`~hpcpax.ps.hot_rows.groups`: an owner's received ids grouped by
  their exact set of sources, and the shape of each group's tree (pure);
* :mod:`~hpcpax.ps.hot_rows.trees`: the point-to-point traffic among
  exactly the ranks of each tree (and of each relay's messages);
* :mod:`~hpcpax.ps.hot_rows.relays`: the other route, every row two or more
  nodes off its owner touch sent once, to one of them, which forwards it.

Nothing is imported here, so the pure planning
(:mod:`hpcpax.plan.hot_rows_cost`) can use :mod:`~hpcpax.ps.hot_rows.groups`
without the communication modules.
"""
