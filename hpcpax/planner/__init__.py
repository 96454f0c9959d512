"""Planner: measurements, cost model, partition search, plans."""
