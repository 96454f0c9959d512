"""The sync methods' registry: one class per method name, properties as the old string sets."""

import pytest

from hpcpax.errors import ConfigError
from hpcpax.plan.cost_model import PREDICT_METHODS, predict_key
from hpcpax.plan.plan import METHODS as PLAN_METHODS
from hpcpax.plan.plan import VariablePlan
from hpcpax.sync import METHODS, REPLICATED_METHODS
from hpcpax.sync.methods import SyncMethod, method_of, methods, names

#: The string sets the code tested before the registry (the reference).
OLD_METHODS = ("allreduce", "allgather", "ps")
OLD_ON_SERVERS = {"ps"}                      # method == "ps"
OLD_REPLICATED = {"allgather", "allreduce"}  # method != "ps", REPLICATED_METHODS
OLD_GATHERS = {"allgather"}                  # method == "allgather"
OLD_DENSIFIED = {"allreduce"}                # method == "allreduce"
OLD_RELAXED = {"ps"}                         # relaxed consistency: var.method != "ps" refused
OLD_DENSE_OK = {"allreduce", "ps"}           # allgather on a dense variable refused
OLD_PREDICT = ("allreduce", "allgather", "ps", "ps_no_local_aggregation")


def test_every_plan_method_is_one_registered_class():
    assert METHODS == PLAN_METHODS == names() == OLD_METHODS
    instances = [method_of(name) for name in OLD_METHODS]
    assert all(isinstance(m, SyncMethod) for m in instances)
    assert len({type(m) for m in instances}) == len(OLD_METHODS)
    assert [m.name for m in instances] == list(OLD_METHODS)
    assert tuple(methods()) == tuple(instances)
    for m in instances:
        assert method_of(m) is m and method_of(m.name) is m


@pytest.mark.parametrize("bad", ["gossip", "PS", "", None, 3, "ps_no_local_aggregation"])
def test_unknown_names_are_refused_naming_the_known_ones(bad):
    with pytest.raises(ConfigError) as info:
        method_of(bad)
    text = str(info.value)
    assert repr(bad) in text
    assert all(repr(name) in text for name in OLD_METHODS)


def test_dense_is_refused_with_its_hint():
    with pytest.raises(ConfigError, match=r"not 'dense' \(a densified sparse table is "
                                          r"'allreduce'\)"):
        method_of("dense", "plan['x'].method")


def test_properties_match_the_old_string_sets():
    def having(flag):
        return {m.name for m in methods() if getattr(m, flag)}

    assert having("on_servers") == OLD_ON_SERVERS
    assert having("replicated") == OLD_REPLICATED == set(REPLICATED_METHODS)
    assert having("gathers") == OLD_GATHERS
    assert having("densified") == OLD_DENSIFIED
    assert having("relaxed") == OLD_RELAXED
    assert having("dense_ok") == OLD_DENSE_OK
    for m in methods():  # every method is exactly one of: on servers, replicated
        assert m.on_servers != m.replicated
        assert m.batch is not None


def test_prediction_names_and_keys():
    assert PREDICT_METHODS == OLD_PREDICT
    assert predict_key("ps", True) == "ps"
    assert predict_key("ps", False) == "ps_no_local_aggregation"
    for name in ("allreduce", "allgather"):
        assert predict_key(name, False) == predict_key(name, True) == name


def test_plan_entries_keep_their_strings():
    entry = VariablePlan(name="e", kind="sparse", shape=(4, 2), dtype="float32",
                         method="allgather")
    assert entry.method == "allgather" and entry.sync_method is method_of("allgather")
    assert entry.to_dict()["method"] == "allgather"
    with pytest.raises(ConfigError, match=r"plan variable 'e': method must be one of"):
        VariablePlan(name="e", kind="sparse", shape=(4, 2), dtype="float32", method="gossip")
