import json

import pytest

from hpcpax.errors import ConfigError
from hpcpax.plan.plan import Plan, VariablePlan, assign_owners


def _plan():
    variables = {
        "emb": VariablePlan("emb", "sparse", (1000, 16), "float32", "ps", partitions=3, owners=[0, 1, 0],
                            local_aggregation=True, wire_dtype="float16", predicted_s=0.00125,
                            reason="ps 2.1x faster than allgather"),
        "w": VariablePlan("w", "dense", (16, 4), "float32", "allreduce", predicted_s=1.0 / 3.0,
                          reason="dense: allreduce"),
        "g": VariablePlan("g", "sparse", (50,), "float64", "allgather", reason="small"),
    }
    return Plan(variables=variables,
                fabric={"intra": {"latency_s": 1e-6, "bandwidth_Bps": 5e9},
                        "inter": {"latency_s": 2e-6, "bandwidth_Bps": 12.5e9}, "allreduce_bucket_bytes": 1 << 20},
                measurements={"emb": {"alpha": 0.0123456789, "alpha_node": 0.04, "steps": 5}},
                topology={"num_nodes": 2, "workers_per_node": 3, "servers_per_node": 1},
                search={"emb": {"samples": [[2, 0.5], [4, 0.25]], "fit": (1.0, 2.0, 3.0)}, "mode": "auto"})


def test_json_round_trip_is_exact():
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.variables["emb"].shape == (1000, 16)
    assert again.to_json() == plan.to_json()
    assert again.fingerprint() == plan.fingerprint()


def test_save_load(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary left behind


def test_fingerprint_ignores_predictions_but_not_decisions():
    plan, other = _plan(), _plan()
    other.variables["emb"].predicted_s = 9.0
    other.measurements = {}
    assert other.fingerprint() == plan.fingerprint()
    other.variables["emb"].owners = [1, 1, 0]
    assert other.fingerprint() != plan.fingerprint()


def _bad(tmp_path, mutate):
    data = json.loads(_plan().to_json())
    mutate(data["variables"][0])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as info:
        Plan.load(path)
    return str(info.value)


def test_load_rejects_unknown_method(tmp_path):
    message = _bad(tmp_path, lambda v: v.update(method="broadcast"))
    assert "'emb'" in message and "method" in message and "broadcast" in message


def test_load_rejects_zero_partitions(tmp_path):
    message = _bad(tmp_path, lambda v: v.update(partitions=0, owners=[]))
    assert "'emb'" in message and "partitions" in message


def test_load_rejects_owner_count_mismatch(tmp_path):
    message = _bad(tmp_path, lambda v: v.update(owners=[0, 1]))
    assert "'emb'" in message and "owners" in message


def test_load_rejects_bad_json_and_missing_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Plan.load(path)
    with pytest.raises(ConfigError, match="cannot read"):
        Plan.load(tmp_path / "missing.json")


def test_non_str_keys_are_refused():
    with pytest.raises(TypeError, match="keys must be str"):
        Plan(variables={}, search={"samples": {4: 1.0}})


def test_table_lists_every_variable_aligned():
    text = _plan().table()
    lines = text.splitlines()
    for header in ("variable", "method", "parts", "local agg", "wire dtype", "pred ms/step", "reason"):
        assert header in lines[0]
    assert any(line.startswith("emb ") and "ps" in line and "float16" in line and "1.250" in line for line in lines)
    assert any(line.startswith("w ") and "333.333" in line for line in lines)
    assert "fingerprint" in lines[-1]
    # the method column starts at the same offset on every row
    column = lines[0].index("method")
    assert lines[2][column:].startswith("ps")


def test_assign_owners_balances_and_is_deterministic():
    sizes = [10, 10, 10, 10, 9, 1, 7, 3]
    owners = assign_owners(sizes, 3)
    assert owners == assign_owners(sizes, 3)
    loads = [sum(s for s, o in zip(sizes, owners) if o == k) for k in range(3)]
    assert sorted(loads) == [20, 20, 20]
    assert assign_owners([5] * 8, 4) == [0, 1, 2, 3, 0, 1, 2, 3]
    assert assign_owners([], 2) == []
    assert assign_owners([3, 2, 1], 1) == [0, 0, 0]
    with pytest.raises(ValueError):
        assign_owners([1], 0)
