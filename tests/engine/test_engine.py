"""The engine layer: one factory for the trainer and ModelSync, typed settings, plan requests.

Serial (one rank, real MPI on COMM_WORLD of size 1 or a rank's COMM_SELF):
the trainer and ModelSync hold an :class:`~hpcpax.engine.Engine` made by
:func:`~hpcpax.engine.build_engine`, built from the settings they were
given, and the planner's host is that engine.
"""

import numpy as np
import pytest

import hpcpax
from hpcpax import ModelSync, SparseVariableSpec
from hpcpax.app.config import resolve
from hpcpax.engine import (Engine, EngineSettings, PlanRequest, PlanSettings, build_engine,
                           resolve_plan)
from hpcpax.errors import ConfigError


def specs():
    return [SparseVariableSpec("emb", 30, 4, initializer="uniform"),
            SparseVariableSpec("tag", 10, 2)]


def test_train_flags_become_typed_settings():
    config = resolve({"plan_steps": 7, "replan_every": 20, "local_aggregation": False,
                      "server_memory_budget": "2MiB", "seed": 3, "bucket_bytes": 0,
                      "steps": 99, "hot_rows": "off", "timeout": 12.5})
    settings = EngineSettings.from_config(config)
    assert settings == EngineSettings(
        local_aggregation=False, seed=3, server_memory_budget=2 << 20, timeout=12.5,
        dense_op="mean", bucket_bytes=None, overlap=False,
        plan=PlanSettings(plan_steps=7, partition_search=False, replan_every=20,
                          replan_threshold=config["replan_threshold"],
                          fabric_seconds=config["fabric_seconds"],
                          plan_calibrate=config["plan_calibrate"], hot_rows="off",
                          hot_rows_trial=config["hot_rows_trial"], steps=99, resume=False))


@pytest.mark.parametrize("bad, message", [
    ({"plan_steps": 0}, "plan_steps must be a positive int, not 0"),
    ({"plan_steps": True}, "plan_steps must be a positive int, not True"),
    ({"replan_every": -1}, "replan_every must be >= 0, not -1"),
])
def test_bad_plan_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        PlanSettings(**bad)


def test_a_bad_dense_op_is_refused():
    with pytest.raises(ValueError, match="dense_op must be 'mean' or 'sum', not 'max'"):
        EngineSettings(dense_op="max")


@pytest.mark.parametrize("spec, mode, methods, label", [
    ("auto", "auto", {"emb": "ps", "tag": "ps"}, "auto"),
    ("allgather", None, {"emb": "allgather", "tag": "allgather"}, "allgather"),
    ({"tag": {"method": "allreduce"}}, None, {"emb": "ps", "tag": "allreduce"}, "table"),
])
def test_a_plan_spec_becomes_one_request_per_variable(spec, mode, methods, label):
    request = resolve_plan(spec, ["emb", "tag"])
    assert request.mode == mode and request.label == label
    assert {n: r["method"] for n, r in request.requests.items()} == methods


def test_a_plan_naming_an_unknown_variable_is_refused():
    with pytest.raises(ConfigError, match="plan names unknown sparse variable 'word'"):
        resolve_plan({"word": {"method": "ps"}}, ["emb", "tag"])
    with pytest.raises(ConfigError, match="plan file everywhere: .*No such file"):
        resolve_plan("everywhere", ["emb"])  # neither a mode nor a method: a file


def test_the_factory_builds_every_part_from_its_settings():
    topo = hpcpax.init(servers_per_node=0)
    try:
        settings = EngineSettings(seed=5, local_aggregation=False, dense_op="sum",
                                  server_memory_budget=1 << 30)
        engine = build_engine(topo, specs(), resolve_plan("ps", ["emb", "tag"]), settings,
                              dense={"w": ((3, 2), "float32")})
        try:
            assert isinstance(engine, Engine) and engine.settings is settings
            assert engine.ps.memory_budget == 1 << 30 and engine.ps.watchdog is engine.watchdog
            assert engine.methods() == {"emb": "ps", "tag": "ps"}
            assert engine.dense["w"].shape == (3, 2) and engine.dense["w"].dtype == np.float32
            assert engine.dense_sync.op == "sum"
            assert engine.planning.engine is engine  # the planner's host
            assert {"switch", "hot_rows"} <= set(engine.commands.handlers)
            engine.sync.register_collective()
            got = engine.sync.pull({"emb": np.array([3, 1, 3])})["emb"]
            assert np.array_equal(got[0], [1, 3]) and got[1].shape == (2, 4)
        finally:
            engine.close()
    finally:
        topo.free()


def test_model_sync_and_the_trainer_run_on_an_engine(tmp_path):
    sync = ModelSync(specs(), {"w": ((4,), "float64")}, plan="ps", quiet=True,
                     plan_steps=3, seed=2)
    try:
        assert isinstance(sync.engine, Engine)
        assert sync.engine.settings.plan.plan_steps == 3 and sync.engine.settings.seed == 2
        assert sync.ps is sync.engine.ps and sync.sync is sync.engine.sync
    finally:
        sync.finish()
    from hpcpax.app.trainer import Trainer
    from mpi4py import MPI

    trainer = Trainer({"steps": 2, "run_dir": str(tmp_path / "run"), "quiet": True,
                       "servers_per_node": 0}, comm=MPI.COMM_SELF)
    trainer.run()
    assert isinstance(trainer.engine, Engine)
    assert trainer.engine.settings == EngineSettings.from_config(trainer.config)
    assert trainer.loop.last == 2 and len(trainer.losses) == 2


def test_a_plan_request_is_a_plain_value():
    request = PlanRequest(None, {"emb": {"method": "ps"}}, "ps")
    assert request == resolve_plan("ps", ["emb"])
