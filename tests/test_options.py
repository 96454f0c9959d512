"""hpcpax.options: one object for every HPCPAX_* setting."""

import warnings
from pathlib import Path

import pytest

import hpcpax
from hpcpax.errors import ConfigError
from hpcpax.options import OPTIONS, Options

README = Path(__file__).resolve().parent.parent / "README.md"


def test_environment_is_read_when_used_and_code_wins(monkeypatch):
    options = Options()
    monkeypatch.delenv("HPCPAX_TIMEOUT", raising=False)
    assert options.timeout == 600.0 and options.source("timeout") == "default"
    monkeypatch.setenv("HPCPAX_TIMEOUT", "12.5")
    assert options.timeout == 12.5 and options.source("timeout") == "environment"
    options.timeout = 3
    assert options.timeout == 3.0 and options.source("timeout") == "code"
    del options.timeout
    assert options.timeout == 12.5


@pytest.mark.parametrize("variable, text, expected", [
    ("HPCPAX_TIMEOUT", "soon", "HPCPAX_TIMEOUT must be a number of seconds >= 0, not 'soon'"),
    ("HPCPAX_THREADS", "-1", "HPCPAX_THREADS must be an integer >= 0, not '-1'"),
    ("HPCPAX_CUDA_AWARE_MPI", "yes", "HPCPAX_CUDA_AWARE_MPI must be 0 or 1, not 'yes'"),
    ("HPCPAX_DEVICE", "tpu", "HPCPAX_DEVICE must be cpu, gpu or auto, not 'tpu'"),
    ("HPCPAX_SERVER_MEMORY", "lots", "HPCPAX_SERVER_MEMORY must be a positive size such as "
                                     "512M or 8G, not 'lots'"),
])
def test_bad_values_name_the_variable(monkeypatch, variable, text, expected):
    monkeypatch.setenv(variable, text)
    name = variable[len("HPCPAX_"):].lower()
    with pytest.raises(ConfigError) as info:
        getattr(Options(), name)
    assert str(info.value) == expected


def test_values_parse(monkeypatch):
    monkeypatch.setenv("HPCPAX_SERVER_MEMORY", "3M")
    monkeypatch.setenv("HPCPAX_RANKS_PER_NODE", "0")  # 0: whole hosts
    monkeypatch.setenv("HPCPAX_NUMBA", "0")
    monkeypatch.setenv("HPCPAX_DEVICE", "CPU")
    options = Options()
    assert options.server_memory == 3 << 20 and options.ranks_per_node is None
    assert options.numba is False and options.device == "cpu"
    with pytest.raises(ConfigError, match=r"hpcpax.options.threads must be an integer >= 0"):
        options.threads = -2
    with pytest.raises(AttributeError, match="hpcpax has no option 'timout'"):
        options.timout = 3


def test_unknown_variables_warn_once(monkeypatch):
    options = Options()
    monkeypatch.setenv("HPCPAX_TIMOUT", "5")
    monkeypatch.setenv("HPCPAX_TEST_GPU", "1")  # the test suite's own: no warning
    unknown = options.unknown_variables()
    assert "HPCPAX_TIMOUT" in unknown and "HPCPAX_TEST_GPU" not in unknown
    with pytest.warns(UserWarning, match="unknown hpcpax environment variable.*HPCPAX_TIMOUT"):
        options.warn_unknown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options.warn_unknown()  # once per process


def test_every_option_is_in_the_readme_table():
    text = README.read_text()
    missing = [o.variable for o in OPTIONS if f"`{o.variable}`" not in text]
    assert not missing, missing


def test_the_package_exposes_the_options():
    assert hpcpax.options.as_dict().keys() == {o.name for o in OPTIONS}


#: Values another program, a typo or a hostile job script may leave in the environment.
HOSTILE = ("inf", "-inf", "nan", "1e308", str(10 ** 30), "18446744073709551616", "-1", " ",
           "x" * 10000, "1\n2", "\x1b[2J", "0x10")


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.variable)
def test_hostile_environment_values_parse_or_stop_in_one_line(monkeypatch, option):
    """Every option, every hostile value: a finite, bounded value or one ``ConfigError``
    line naming the variable (never inf, nan, a Python traceback or a huge int)."""
    for text in HOSTILE:
        monkeypatch.setenv(option.variable, text)
        try:
            value = getattr(Options(), option.name)
        except ConfigError as error:
            message = str(error)
            assert message.startswith(f"{option.variable} must be "), message
            assert "\n" not in message.replace("\\n", ""), message
            continue
        if isinstance(value, float):
            assert value == value and abs(value) < 1e10, (option.variable, text, value)
        elif isinstance(value, int) and not isinstance(value, bool):
            assert abs(value) < 1 << 63, (option.variable, text, value)
