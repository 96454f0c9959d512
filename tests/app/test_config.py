"""Config: flags, TOML, precedence and named errors (serial, no MPI needed)."""

import pytest

from hpcpax.app.config import load_toml, model_kwargs, parse_args, resolve
from hpcpax.errors import ConfigError


def test_defaults_and_flags():
    config = parse_args(["--steps", "7", "--no-local-aggregation", "--hidden", "32,16"])
    assert config["steps"] == 7 and config["local_aggregation"] is False
    assert config["hidden"] == [32, 16] and config["model"] == "lm"
    assert model_kwargs(config)["hidden"] == (32, 16)


def test_toml_then_flags_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 9\nglobal_batch = 24\nlr = 1\nhidden = [8, 8]\n'
                    'plan = "allgather"\nlocal_aggregation = false\n')
    config = parse_args(["--config", str(path), "--steps", "3"])
    assert config["steps"] == 3 and config["global_batch"] == 24
    assert config["lr"] == 1.0 and config["hidden"] == [8, 8]
    assert config["plan"] == "allgather" and config["config"] == str(path)


def test_toml_unknown_key_is_named(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("steps = 3\nlearning_rate = 0.1\n")
    with pytest.raises(ConfigError, match="learning_rate"):
        load_toml(path)


@pytest.mark.parametrize("text, key", [("steps = 'many'", "steps"), ("steps = 0", "steps"),
                                       ("model = 'rnn'", "model"), ("quiet = 3", "quiet"),
                                       ("hidden = [8, -1]", "hidden")])
def test_toml_bad_values_are_named(tmp_path, text, key):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=key):
        resolve(config_file=path)


def test_bad_toml_and_cross_model_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("steps = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(path)
    with pytest.raises(ConfigError, match="n_fields"):
        resolve({"model": "lm", "n_fields": 3})
    with pytest.raises(ConfigError, match="run_dir"):
        resolve({"resume": True})
    with pytest.raises(ConfigError, match="unknown config key"):
        resolve({"stepz": 3})


@pytest.mark.parametrize("value", ["lots", "0", "-8G"])
def test_a_bad_memory_budget_is_refused_with_the_flags(value):
    """Refused where the flags are read (exit 2 on the command line), not after start-up."""
    with pytest.raises(ConfigError, match=f"server_memory_budget must be a .*'{value}'"):
        parse_args([f"--server-memory-budget={value}"])
    assert resolve({"server_memory_budget": "8G"})["server_memory_budget"] == "8G"


def test_plan_tables(tmp_path):
    config = resolve({"plan": {"embedding": {"method": "allreduce"},
                               "softmax_w": {"method": "ps", "partitions": 4}}})
    assert config["plan"]["embedding"] == {"method": "allreduce", "partitions": None,
                                           "owners": None, "local_aggregation": None}
    assert config["plan"]["softmax_w"]["partitions"] == 4
    with pytest.raises(ConfigError, match="method"):
        resolve({"plan": {"embedding": {"method": "gossip"}}})
    # one name per method: a densified sparse table is "allreduce", nowhere "dense"
    with pytest.raises(ConfigError, match=r"not 'dense' \(a densified sparse table is "
                                          r"'allreduce'\)"):
        resolve({"plan": {"embedding": {"method": "dense"}}})
    with pytest.raises(ConfigError, match=r"not 'dense' \(a densified sparse table is "
                                          r"'allreduce'\)"):
        resolve({"plan": "dense"})
