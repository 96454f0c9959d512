"""Hot rows travel once: trees for the rows that many nodes touch.

* :mod:`~hpcpax.ps.hot_rows.routing`: :class:`HotRows` (the setting), the
  pull reply down broadcast trees and the push up reduction chains;
* :mod:`~hpcpax.ps.hot_rows.groups`: an owner's received ids grouped by
  their exact set of sources, and the shape of each group's tree (pure);
* :mod:`~hpcpax.ps.hot_rows.trees`: the point-to-point traffic among
  exactly the ranks of each tree.

Nothing is imported here, so the pure planning
(:mod:`hpcpax.plan.hot_rows_cost`) can use :mod:`~hpcpax.ps.hot_rows.groups`
without the communication modules.
"""
