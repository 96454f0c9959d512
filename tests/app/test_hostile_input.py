"""Hostile values for every flag and config key of ``python -m hpcpax.train``, and hostile
config and plan files (issue 70, item 5): each is one line naming the key, exit status 2,
no traceback, well under 10 s, and nothing is built (the trainer is never constructed).

The bulk calls the CLI's ``main`` in-process (serial, no MPI job); a few real processes
check the process boundary: ``python -m hpcpax.train`` alone and under ``mpirun -n 2``
(one line for the job, not one per rank).
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

import hpcpax.app.trainer as trainer_module
from hpcpax import train
from hpcpax.app.config import FLAGS, MODEL_FLAGS, resolve
from hpcpax.engine.plan_requests import load_plan_file, normalize_plan
from hpcpax.errors import ConfigError
from hpcpax.input_checks import MAX_NESTING
from hpcpax.plan.plan import Plan

pytestmark = pytest.mark.timeout(120)

HUGE = "1" + "0" * 30                 # 10**30
U64 = str(1 << 64)                    # 18446744073709551616
DIGITS = "9" * 5000                   # past int()'s 4300-digit limit

#: Command-line values no flag of the kind may take.
CLI_VALUES = {
    "int": ["1e8", "inf", "nan", HUGE, U64, "-" + U64, DIGITS, "", "1.5", "0x10"],
    "float": ["inf", "-inf", "nan", "1e309", "-1e309", DIGITS, "", "one"],
    "str": ["a\x00b", "a\nb", "\udcff", "x" * 70_000],
    "sizes": ["1e8", HUGE, U64, "1," * 2000 + "1", "0", "nan", "-1", DIGITS, "8,inf"],
    "plan": ["a\x00b", "x" * 70_000],  # and the hostile plan files below
}
#: More for the str flags with a grammar of their own.
SPEC_VALUES = {
    "straggler": ["1:1e308", "1:inf", "1:nan", U64 + ":2", "1:" + DIGITS, "1"],
    "stalls": ["0.5:1e308", "nan:2", "0.5:inf", "1e308:2", "0.5"],
    "emulate_compute": ["1e308", "inf", "nan", "1e308/sample", "-1", "no-such-preset"],
    "consistency": ["ssp:1e308", "ssp:" + U64, "psp:" + U64 + ",1", "psp:2,inf", "ssp:nan",
                    "ssp:1; a=asp; a=bsp"],
    "dense_period": ["1e308", U64, "auto:" + U64, "auto:inf", "nan", "0"],
    "batch_shares": ["nan,1", "1e308,1", U64 + ",1", "inf"],
    "server_memory_budget": ["inf", "nan", "1e308", HUGE + "G", DIGITS],
}
#: TOML values (as written in the file) every key refuses.
TOML_COMMON = ["inf", "nan", "-inf", HUGE, '"a\\u0000b"', "{ a = { b = 1 } }"]
TOML_VALUES = {
    "int": ['"inf"', "1e8", "[1]", U64, "-9223372036854775809"],
    "float": ['"nan"', "[1.0]", "1e309"],
    "str": ['["a"]', "1", "true"],
    "bool": ['"maybe"', "[true]", "1.5"],
    "sizes": ["[0]", "[100000000000000000000]", "[[1]]", '"1e8"'],
    "plan": ["[1]", "{ x = { partitions = 100000000 } }", "{ x = { partitions = 1e8 } }",
             '{ x = { method = ["ps"] } }', "{ x = { owners = [100000000000000000000] } }"],
}


def _deep_json(depth):
    return "[" * depth + "]" * depth


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """Hostile config and plan files: ``{name: path}``."""
    root = tmp_path_factory.mktemp("hostile")
    texts = {
        "deep.json": _deep_json(100_000),
        "deep_objects.json": '{"a":' * 50_000 + "1" + "}" * 50_000,
        "deep_plan.json": json.dumps({"embedding": {"method": "ps", "facts": [[[[[[[[[[[[
            [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
        ]]]]]]]]]]]]}}),
        "list_name.json": json.dumps({"variables": [{"name": ["embedding"], "kind": "sparse",
                                                     "method": "ps"}]}),
        "list_table.json": json.dumps({"embedding": ["ps"]}),
        "top_list.json": "[1, 2]",
        "infinity.json": '{"embedding": {"method": "ps", "partitions": Infinity}}',
        "nan.json": '{"embedding": {"method": "ps", "predicted_s": NaN}}',
        "overflow.json": '{"embedding": {"method": "ps", "facts": 1e999}}',
        "huge_int.json": '{"embedding": {"method": "ps", "partitions": ' + HUGE + "}}",
        "digits.json": '{"embedding": {"partitions": ' + DIGITS + "}}",
        "partitions.json": '{"embedding": {"method": "ps", "partitions": 100000000}}',
        "owners.json": '{"embedding": {"method": "ps", "owners": [' + U64 + "]}}",
        "deep.toml": "a = " + _deep_json(100_000) + "\n",
        "deep_tables.toml": "a = " + "{ b = " * 2_000 + "1" + " }" * 2_000 + "\n",
        "deep_keys.toml": "a" + ".b" * 5_000 + " = 1\n",
        "list_name.toml": 'model = ["lm"]\n',
        "plan_list_name.toml": '[plan]\nvariables = [{ name = ["embedding"] }]\n',
        "inf.toml": "fabric_seconds = inf\n",
        "nan.toml": "time_dilation = nan\n",
        "emulate_inf.toml": 'emulate_compute = "inf"\n',
        "partitions.toml": "[plan.embedding]\npartitions = 100000000\n",
        "date.toml": "steps = 1979-05-27\n",
    }
    paths = {}
    for name, text in texts.items():
        paths[name] = root / name
        paths[name].write_text(text, encoding="utf-8")
    for name, data in {"bad_utf8.json": b'{"embedding": {"method": "\xff\xfe"}}',
                       "bad_utf8.toml": b"steps = 3\nrun_dir = '\xff\xfe'\n"}.items():
        paths[name] = root / name
        paths[name].write_bytes(data)
    paths["directory"] = root / "a_directory"
    paths["directory"].mkdir()
    paths["missing"] = root / "missing.json"
    if os.path.exists("/dev/zero"):
        paths["dev_zero"] = "/dev/zero"  # endless: read only up to the size bound
    return {name: str(path) for name, path in paths.items()}


@pytest.fixture
def cli(monkeypatch, capsys):
    """``cli(argv)`` -> ``(status, stderr)`` of ``python -m hpcpax.train`` run in-process;
    a config that gets past parsing fails the test (nothing may be built)."""
    class Refused:
        def __init__(self, config, **kwargs):
            raise AssertionError(f"accepted; a trainer was built for {config!r:.300}")

    monkeypatch.setattr(trainer_module, "Trainer", Refused)

    def run(argv):
        capsys.readouterr()
        began = time.perf_counter()
        try:
            status = train.main(argv)
        except AssertionError as exc:  # got past parsing: the caller names the case
            status = str(exc)
        seconds = time.perf_counter() - began
        captured = capsys.readouterr()
        assert seconds < 10, (argv[:4], seconds)
        return status, captured.err + captured.out

    return run


def _one_line_error(status, text, names):
    """Whether the output is one ``hpcpax.train: error:`` line holding one of ``names``."""
    lines = text.splitlines()
    return (status == 2 and len(lines) == 1 and lines[0].startswith("hpcpax.train: error: ")
            and "Traceback" not in text and any(name in lines[0] for name in names))


def _renderings(value):
    """How a message may show ``value``: as given, quoted, or as the float it parses to."""
    out = {value, repr(value)}
    try:
        out.add(repr(float(value)))
    except ValueError:
        pass
    return out


def _context(flag):
    """Flags that make ``flag`` apply: ctr's model flags need ``--model ctr``."""
    return ["--model", "ctr"] if flag.key in MODEL_FLAGS["ctr"] and \
        flag.key not in MODEL_FLAGS["lm"] else []


@pytest.mark.parametrize("flag", FLAGS, ids=[f.key for f in FLAGS])
def test_every_flag_refuses_hostile_values_in_one_line(flag, cli, hostile):
    option = "--" + flag.key.replace("_", "-")
    if flag.kind == "bool":  # a switch takes no value: one given is argparse's error
        values = ["inf", "nan", HUGE, "[1]"]
        cases = [[f"{option}={v}"] for v in values]
    else:
        values = CLI_VALUES[flag.kind] + SPEC_VALUES.get(flag.key, [])
        if flag.kind == "plan":
            values += [hostile[name] for name in sorted(hostile)]
        elif flag.choices:
            values += ["inf", "nan", "Lm" if "lm" in flag.choices else "x"]
        cases = [[f"{option}={v}"] for v in values]
    failures = []
    for argv in cases:
        status, text = cli(_context(flag) + argv)
        value = argv[0].partition("=")[2]
        # the flag, its key (a spec's own parser) or, for a plan file, the file is named
        named = _one_line_error(status, text, [option, flag.key] + (
            [value] if flag.kind == "plan" and value.startswith("/") else []))
        # short printable values are quoted back (huge or unprintable ones are shortened)
        if named and flag.kind in ("int", "float", "sizes") and len(value) <= 40:
            named = any(r in text for r in _renderings(value)) or "finite" in text
        if not named:
            failures.append((argv[0][:80], status, text[-300:]))
    assert not failures, failures


@pytest.mark.parametrize("flag", FLAGS, ids=[f.key for f in FLAGS])
def test_every_config_key_refuses_hostile_values_in_one_line(flag, cli, tmp_path):
    context = 'model = "ctr"\n' if _context(flag) else ""
    failures = []
    for index, value in enumerate(TOML_COMMON + TOML_VALUES.get(flag.kind, [])):
        if flag.kind == "sizes" and value.startswith("{"):
            continue  # a table is refused too; covered by the other kinds
        path = tmp_path / f"c{index}.toml"
        path.write_text(f"{context}{flag.key} = {value}\n", encoding="utf-8")
        status, text = cli(["--config", str(path)])
        if not _one_line_error(status, text, [flag.key]):
            failures.append((value[:60], status, text[-300:]))
    assert not failures, failures


#: The cases issue 70 names: file or flags, and words the one line must hold.
NAMED_CASES = {
    "deep JSON plan": (["--plan", "@deep.json"], ["deep.json", "nested deeper than"]),
    "deep JSON objects": (["--plan", "@deep_objects.json"], ["nested deeper than"]),
    "deep TOML": (["--config", "@deep.toml"], ["deep.toml", "nested deeper than"]),
    "deep TOML tables": (["--config", "@deep_tables.toml"], ["nested deeper than"]),
    "deep TOML keys": (["--config", "@deep_keys.toml"], ["nested deeper than"]),
    "deep plan entry": (["--plan", "@deep_plan.json"], ["deep_plan.json", "nested deeper than"]),
    "invalid UTF-8 plan": (["--plan", "@bad_utf8.json"], ["bad_utf8.json", "not UTF-8",
                                                            "byte 26"]),
    "invalid UTF-8 config": (["--config", "@bad_utf8.toml"], ["not UTF-8", "byte 21"]),
    "list as a plan name": (["--plan", "@list_name.json"], ["variables[0].name",
                                                             "['embedding']"]),
    "list as a plan entry": (["--plan", "@list_table.json"], ["'embedding'", "table"]),
    "list as the plan": (["--plan", "@top_list.json"], ["JSON object"]),
    "list as a model name": (["--config", "@list_name.toml"], ["model", "['lm']"]),
    "list as a TOML plan name": (["--config", "@plan_list_name.toml"], ["name",
                                                                         "['embedding']"]),
    "Infinity in a plan": (["--plan", "@infinity.json"], ["Infinity", "not a finite"]),
    "NaN in a plan": (["--plan", "@nan.json"], ["NaN"]),
    "1e999 in a plan": (["--plan", "@overflow.json"], ["facts", "finite", "inf"]),
    "10**30 partitions": (["--plan", "@huge_int.json"], ["partitions", "<= "]),
    "5000-digit partitions": (["--plan", "@digits.json"], ["not valid JSON"]),
    "1e8 partitions": (["--plan", "@partitions.json"], ["partitions", "<= 16384",
                                                         "100000000"]),
    "1e8 partitions in TOML": (["--config", "@partitions.toml"], ["partitions", "100000000"]),
    "2**64 owner": (["--plan", "@owners.json"], ["owners", U64]),
    "a directory as plan": (["--plan", "@directory"], ["cannot read plan file"]),
    "a directory as config": (["--config", "@directory"], ["cannot read config file"]),
    "a missing plan": (["--plan", "@missing"], ["No such file"]),
    "a NUL in the config's name": (["--config", "c\x00.toml"], ["config file name",
                                                                "control characters"]),
    "a newline in the config's name": (["--config", "c\n.toml"], ["'c\\n.toml'"]),
    "/dev/zero as config": (["--config", "@dev_zero"], ["larger than 16777216 bytes"]),
    "a date in TOML": (["--config", "@date.toml"], ["steps", "date"]),
    "fabric_seconds inf": (["--config", "@inf.toml"], ["fabric_seconds", "inf"]),
    "time_dilation nan": (["--config", "@nan.toml"], ["time_dilation", "nan"]),
    "emulate_compute inf": (["--config", "@emulate_inf.toml"], ["emulate_compute", "inf"]),
    "--fabric-seconds nan": (["--fabric-seconds", "nan"], ["--fabric-seconds", "nan"]),
    "--time-dilation inf": (["--time-dilation", "inf"], ["--time-dilation", "inf"]),
    "--emulate-compute nan": (["--emulate-compute", "nan"], ["emulate_compute", "nan"]),
    "--straggler 1:1e308": (["--straggler", "1:1e308"], ["straggler", "1e308", "FACTOR"]),
    "--emb-dim 10**30": (["--emb-dim", HUGE], ["--emb-dim", HUGE]),
    "--vocab-size 2**64": (["--vocab-size", U64], ["--vocab-size", U64]),
    "--n-fields 1e8": (["--model", "ctr", "--n-fields", "100000000"],
                       ["--n-fields", "<= 1024", "100000000"]),
    "--table-rows 2**64": (["--model", "ctr", "--table-rows", U64], ["--table-rows", U64]),
    "--run-dir -x": (["--run-dir", "-x"], ["--run-dir", "expected one argument"]),
    "--timeout 1e308": (["--timeout", "1e308"], ["--timeout", "1e+308"]),
}


@pytest.mark.parametrize("case", NAMED_CASES, ids=list(NAMED_CASES))
def test_the_cases_of_issue_70_are_one_line_each(case, cli, hostile):
    argv, words = NAMED_CASES[case]
    if "@dev_zero" in argv and "dev_zero" not in hostile:
        pytest.skip("no /dev/zero")
    status, text = cli([hostile[a[1:]] if a.startswith("@") else a for a in argv])
    assert _one_line_error(status, text, ["error"]), text[-500:]
    missing = [w for w in words if w not in text]
    assert not missing, (missing, text)


def test_plan_readers_refuse_hostile_plans_with_a_config_error(hostile, tmp_path):
    """Plan.from_json / Plan.load / load_plan_file / normalize_plan: a ConfigError, never
    another exception, for every hostile plan; a good plan still round-trips."""
    for name in ("deep.json", "deep_objects.json", "bad_utf8.json", "list_name.json",
                 "infinity.json", "nan.json", "overflow.json", "huge_int.json", "digits.json",
                 "partitions.json", "owners.json", "top_list.json", "deep_plan.json"):
        for reader in (Plan.load, load_plan_file):
            with pytest.raises(ConfigError):
                reader(hostile[name])
    saved = {"format": 1, "variables": [{"name": "e", "kind": "sparse", "shape": [8, 2],
                                         "dtype": "float32", "method": "ps", "partitions": 2,
                                         "owners": [0, 0]}]}
    for bad, words in [({"name": ["e"]}, "name"), ({"shape": [8, "x"]}, "shape"),
                       ({"shape": 8}, "shape"), ({"owners": ["a", 0]}, "owners"),
                       ({"partitions": 100_000_000, "owners": [0] * 3}, "partitions"),
                       ({"owners": [0, 1 << 40]}, "owners"), ({"predicted_s": "x"}, "predicted_s"),
                       ({"shape": [8, 1 << 64]}, "shape")]:
        entry = {**saved["variables"][0], **bad}
        with pytest.raises(ConfigError, match=words):
            Plan.from_json(json.dumps({**saved, "variables": [entry]}))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(saved))
    assert Plan.load(path).variables["e"].partitions == 2
    assert load_plan_file(path) == {"e": {"method": "ps", "partitions": 2, "owners": [0, 0],
                                          "local_aggregation": None}}
    with pytest.raises(ConfigError, match="nested deeper than"):
        nested = 1
        for _ in range(MAX_NESTING + 2):
            nested = [nested]
        normalize_plan({"e": {"facts": nested}})
    with pytest.raises(ConfigError, match="partitions must be <= 16384"):
        resolve({"plan": {"embedding": {"partitions": 100_000_000}}})


def test_models_check_sizes_before_allocating():
    """The size bounds hold for the models built directly too (no 8.88 PiB triu_indices)."""
    from hpcpax.models import build_model

    for name, kwargs, words in [("ctr", {"n_fields": 100_000_000}, "n_fields must be <= 1024"),
                                ("ctr", {"emb_dim": 10**30, "bottom": (10**30,)}, "emb_dim"),
                                ("lm", {"hidden": (8,) * 1000}, "at most 64 sizes"),
                                ("lm", {"vocab_size": 1 << 64}, "vocab_size"),
                                ("ctr", {"table_rows": "1," * 5000}, "at most 1024 sizes")]:
        began = time.perf_counter()
        with pytest.raises(ConfigError, match=words):
            build_model(name, **kwargs)
        assert time.perf_counter() - began < 1.0


def _run(argv, **kwargs):
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)


def test_the_process_boundary_alone_and_under_mpirun(hostile, tmp_path):
    """Real processes, started together: each exits 2 with its one line, no traceback; under
    ``mpirun -n 2`` the job prints the line once."""
    python = [sys.executable, "-m", "hpcpax.train"]
    env = {**os.environ, "HPCPAX_TIMEOUT": "60"}
    runs = {
        "deep config": (python + ["--config", hostile["deep.toml"]], "nested deeper than"),
        "bad UTF-8 plan": (python + ["--plan", hostile["bad_utf8.json"]], "not UTF-8"),
        "n_fields": (python + ["--model", "ctr", "--n-fields", "100000000"], "--n-fields"),
        "straggler": (python + ["--straggler", "1:1e308"], "FACTOR"),
    }
    mpirun = shutil.which("mpirun")
    if mpirun:
        runs["mpirun -n 2"] = ([mpirun, "-n", "2", sys.executable, "-m", "mpi4py", "-m",
                                "hpcpax.train", "--plan", hostile["list_name.json"]],
                               "variables[0].name")
    started = {name: _run(argv, env=env, cwd=tmp_path) for name, (argv, _) in runs.items()}
    failures = []
    for name, process in started.items():
        out, err = process.communicate(timeout=60)
        lines = (out + err).splitlines()
        if process.returncode != 2 or len(lines) != 1 or runs[name][1] not in lines[0] \
                or "Traceback" in out + err:
            failures.append((name, process.returncode, (out + err)[-800:]))
    assert not failures, failures
