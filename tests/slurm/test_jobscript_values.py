"""Job script values are data, never code: quoting, word lists, and hostile values run under bash.

The end-to-end test renders every template with a hostile value in every
flag, runs the script with ``bash`` under stub ``srun``/``mpirun``/``scontrol``
(first on PATH; they record their argv as JSON) and checks that nothing the
values spell out ran (no marker files) and that ``srun`` got exactly the
intended words.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from hpcpax.app.jobscript import _AT_LEAST, load_template, main, render
from hpcpax.app.jobscript_values import (check_template_lines, sbatch_word, shell_word,
                                         split_words)
from hpcpax.errors import ConfigError

TEMPLATES = ["single_node", "multi_node", "script"]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")

#: Strings a renderer must keep as data: shell syntax of every kind, quotes, spaces, unicode.
NASTY = ["plain", "", "a b", "  two  spaces ", "it's", 'say "hi"', "$HOME", "${HOME}", "$(touch m)",
         "`touch m`", "a; touch m", "a && touch m", "a | touch m", "a > m", "<m", "a & b",
         "(sub)", "{a,b}", "*", "~", "~/x", "#not a comment", "a#b", "\\", "a\\b", "\\'",
         "'\"'\"'", "-n", "--flag=1", "!", "!!", "\t tab", "é ü 中", "%x-%j", "=", "a=b c"]


def run_bash(script, cwd, env=None):
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True,
                          timeout=60)


def test_shell_word_round_trips_through_bash(tmp_path):
    script = "printf '%s\\0' " + " ".join(shell_word(s) for s in NASTY)
    result = run_bash(script, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode().split("\0")[:-1] == NASTY
    assert not (tmp_path / "m").exists()


def test_plain_words_stay_bare():
    for word in ["pmi2", "runs/a-1", "slurm-%x-%j.out", "01:00:00", "B:USR1@120", "--steps"]:
        assert shell_word(word) == word and sbatch_word(word) == word


def slurm_directive_arguments(rest):
    """The arguments Slurm's ``#SBATCH`` parser reads from the text after ``#SBATCH``.

    A model of sbatch's directive parser as Slurm 22.05 behaves (checked with
    sbatch and squeue): whitespace outside quotes separates arguments (a
    backslash does not join them), an unquoted ``#`` ends the line, quotes
    group, and a backslash makes the next character literal.
    """
    arguments, i = [], 0
    while i < len(rest):
        while i < len(rest) and rest[i].isspace():
            i += 1
        if i == len(rest):
            break
        argument, quote = [], ""
        while i < len(rest) and (quote or not rest[i].isspace()):
            char = rest[i]
            if char == "\\" and i + 1 < len(rest) and (quote or not rest[i + 1].isspace()):
                argument.append(rest[i + 1])
                i += 2
                continue
            if quote and char == quote:
                quote = ""
            elif char == "#" and not quote:
                return arguments + (["".join(argument)] if argument else [])
            elif not quote and char in "'\"":
                quote = char
            else:
                argument.append(char)
            i += 1
        assert not quote, f"Slurm refuses an unmatched quote in {rest!r}"
        arguments.append("".join(argument))
    return arguments


def test_sbatch_word_round_trips_through_slurms_directive_parser():
    for value in NASTY:
        if value:
            line = f" --job-name={sbatch_word(value)} # a comment"
            assert slurm_directive_arguments(line) == [f"--job-name={value}"], value


def test_split_words_keeps_quoted_syntax_as_data():
    assert split_words("--x", "--a 'b c' \"d e\" f\\;g ';' '$(x)' \"it's\"") == [
        "--a", "b c", "d e", "f;g", ";", "$(x)", "it's"]
    assert split_words("--x", "") == []


@pytest.mark.parametrize("value, char", [
    ("--steps 5; touch m", ";"), ("a && b", "&"), ("a | b", "|"), ("a > f", ">"),
    ("a $(touch m)", "$"), ("a `touch m`", "`"), ('a "$HOME"', "$"), ('a "\\$HOME"', "$"),
    ('"`x`"', "`"), ("(a)", "("), ("$HOME", "$")])
def test_split_words_refuses_unquoted_shell_syntax(value, char):
    with pytest.raises(ConfigError, match=re.escape(
            f"--train-args must be words without shell syntax (single-quote a word to pass "
            f"{char!r} as data), not {value!r}")):
        split_words("--train-args", value)


def test_split_words_refuses_unbalanced_quotes():
    with pytest.raises(ConfigError, match="--script-args must be words a shell can split "
                                          r"\(No closing quotation\)"):
        split_words("--script-args", "--name 'open")


@pytest.mark.parametrize("line, message", [
    ('echo "{{x}}"', "must stand outside quotes"), ("echo '{{x}}'", "must stand outside quotes"),
    ("echo \\{{x}}", "must stand outside quotes"), ("run --a={{args}}", "must have spaces"),
    ("run {{args}}x", "must have spaces")])
def test_template_placeholders_must_be_whole_words(line, message):
    with pytest.raises(ConfigError, match=f"template 't' line 2: .*{message}"):
        check_template_lines("t", f"#!/bin/bash\n{line}\n", frozenset({"args"}))


def test_template_placeholders_allowed_where_bash_reads_them_as_words():
    check_template_lines("t", '#!/bin/bash\n#SBATCH --job-name="{{x}}"\necho "$A" {{x}} # "{{y}}"\n'
                              "run --a={{x}} {{args}}\n{{args}}\n", frozenset({"args"}))


# ---- end to end: every template, every flag, under bash with stub launchers ----------------

STUB = """#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps({{"argv": [os.path.basename(sys.argv[0])] + sys.argv[1:],
                          "activated": os.environ.get("HPCPAX_TEST_ACTIVATED")}}) + "\\n")
"""


def hostile(i):
    """A value that runs five commands (touching m{i}a..m{i}e) wherever bash reads it as code."""
    return (f"v{i} $(touch m{i}a) `touch m{i}b`; touch m{i}c && touch m{i}d | touch m{i}e "
            f"'sq' \"dq\" #h")


def hostile_words(i):
    """(value, its words): a word list whose quoted words spell the same commands as data."""
    value = (f"w{i} '$(touch m{i}a)' '`touch m{i}b`' ';' 'touch m{i}c' \\&\\& '|' "
             f"\"it's\" 'sp ace' 'a\"b' x\\;touch\\ m{i}e")
    words = [f"w{i}", f"$(touch m{i}a)", f"`touch m{i}b`", ";", f"touch m{i}c", "&&", "|",
             "it's", "sp ace", 'a"b', f"x;touch m{i}e"]
    return value, words


def markers(root):
    """Files anywhere under ``root`` named like a marker a hostile value would touch."""
    return sorted(p for _, _, files in os.walk(root) for p in files if re.fullmatch(r"m\d+[a-e]", p))


def test_the_hostile_values_do_run_when_bash_reads_them_as_code(tmp_path):
    """The markers are live: unquoted, as the renderer once wrote them, bash runs them."""
    run_bash(f"true {hostile(3)}", tmp_path)
    assert markers(tmp_path) == ["m3a", "m3b", "m3c", "m3d", "m3e"]


def hostile_values(template, work):
    """{placeholder: value} for every placeholder, and {placeholder: words} of the word lists."""
    parsed = load_template(template)
    values, words = {}, {}
    for i, name in enumerate(parsed.placeholders):
        if name in _AT_LEAST or name == "time":  # checked numbers: refused below, defaults here
            continue
        if name in parsed.words:
            values[name], words[name] = hostile_words(i)
        elif name == "activate":  # a file to source, at a hostile path
            folder = work / f"env {hostile(i)}"
            folder.mkdir()
            (folder / "activate").write_text("export HPCPAX_TEST_ACTIVATED=yes\n")
            values[name] = str(folder / "activate")
        else:
            values[name] = hostile(i)
    return values, words


def expected_srun(template, values, words):
    if template == "script":
        return ["srun", f"--mpi={values['mpi']}", "--kill-on-bad-exit=1", values["python"],
                "-m", "mpi4py", values["script"], *words["script_args"]]
    extra = ["--distribution=block:block"] if template == "multi_node" else []
    return ["srun", f"--mpi={values['mpi']}", "--kill-on-bad-exit=1", *extra,
            *words["command"], *words["train_args"], "--run-dir", values["run_dir"],
            "--servers-per-node", "1", "--checkpoint-every", "100", "--resume"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_hostile_values_in_every_flag_stay_data_under_bash(template, tmp_path):
    work = tmp_path / "work"
    stubs = tmp_path / "stubs"
    work.mkdir()
    stubs.mkdir()
    for launcher in ("srun", "mpirun", "scontrol"):
        (stubs / launcher).write_text(STUB.format(python=sys.executable))
        (stubs / launcher).chmod(0o755)
    values, words = hostile_values(template, work)
    job = tmp_path / "job.sbatch"
    assert main([template, *[f"--{n.replace('_', '-')}={v}" for n, v in values.items()],
                 "-o", str(job)]) == 0
    text = job.read_text()
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
           "STUB_LOG": str(tmp_path / "argv.jsonl"), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NAME": "hostile", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n1",
           "SLURM_CPUS_PER_TASK": "1"}
    result = subprocess.run(["bash", str(job)], cwd=work, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert markers(tmp_path) == [], text
    calls = [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    assert calls == [{"argv": expected_srun(template, values, words), "activated": "yes"}], text
    if "run_dir" in values:
        assert (work / values["run_dir"]).is_dir()
    # Slurm reads each directive's value back unchanged.
    directives = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH"):
            for argument in slurm_directive_arguments(line[len("#SBATCH"):]):
                key, _, value = argument.partition("=")
                directives[key] = value
    assert directives["--job-name"] == values["job_name"]
    assert directives["--partition"] == values["partition"]
    assert directives["--output"] == values["slurm_output"]


def flag_cases(kinds):
    cases = []
    for template in TEMPLATES:
        parsed = load_template(template)
        for name in parsed.placeholders:
            kind = ("words" if name in parsed.words else
                    "number" if name in _AT_LEAST or name == "time" else "text")
            if kind in kinds:
                cases.append((template, name))
    return cases


def assert_refused(capsys, template, name, value, message):
    with pytest.raises(SystemExit) as info:
        main([template, f"--{name.replace('_', '-')}={value}"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and f"error: --{name.replace('_', '-')} {message}" in err, err


@pytest.mark.parametrize("template, name", flag_cases({"words", "number", "text"}))
def test_every_flag_refuses_a_newline(template, name, capsys):
    assert_refused(capsys, template, name, "1\ntouch m", "must be one line without control")


@pytest.mark.parametrize("template, name", flag_cases({"words", "number", "text"}))
@pytest.mark.parametrize("char", ["\0", "\r", "\x1b"])
def test_every_placeholder_refuses_control_characters(template, name, char):
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be one line"):
        render(template, **{name: f"1{char}2"})


@pytest.mark.parametrize("template, name", flag_cases({"number"}))
def test_counts_and_time_refuse_shell_text(template, name, capsys):
    assert_refused(capsys, template, name, "1; touch m", "must be ")


@pytest.mark.parametrize("template, name", flag_cases({"words"}))
@pytest.mark.parametrize("value", ["--a 1; touch m", "--a 1 && touch m", "--a 1 | touch m",
                                   "--a $(touch m)", "--a `touch m`", '--a "$(touch m)"'])
def test_word_lists_refuse_unquoted_shell_syntax(template, name, value, capsys):
    assert_refused(capsys, template, name, value, "must be words without shell syntax")


@pytest.mark.parametrize("template", TEMPLATES)
def test_activate_takes_a_file_not_a_shell_line(template, capsys):
    assert_refused(capsys, template, "activate", "source /opt/venv/bin/activate",
                   "must be the file to source")


def test_a_dollar_in_a_value_is_kept_and_noted(tmp_path, capsys):
    job = tmp_path / "job.sbatch"
    assert main(["single_node", "--run-dir=$SCRATCH/run", "-o", str(job)]) == 0
    assert "\nRUN_DIR='$SCRATCH/run'\n" in job.read_text()
    assert "note: --run-dir '$SCRATCH/run' is used as written" in capsys.readouterr().err


def operand_cases():
    return [(template, name) for template in TEMPLATES
            for name in ("run_dir", "activate", "python", "script")
            if name in load_template(template).placeholders]


@pytest.mark.parametrize("template, name", operand_cases())
@pytest.mark.parametrize("value", ["-x", "--version", "-"])
def test_file_and_program_values_refuse_a_leading_dash(template, name, value, capsys):
    """``mkdir -p "$RUN_DIR"``, ``source "$ACTIVATE"``, ``srun PYTHON -m mpi4py SCRIPT`` would
    read such a value as an option: refused at render, one line, naming ``./VALUE``."""
    assert_refused(capsys, template, name, value, "must not start with '-'")
    with pytest.raises(ConfigError, match=re.escape(f"write ./{value} ")):
        render(template, **{name: value})


@pytest.mark.parametrize("template", ["single_node", "multi_node"])
def test_the_command_must_start_with_its_program(template, capsys):
    assert_refused(capsys, template, "command", "--export=ALL python -m hpcpax.train",
                   "must start with the program to run, not the option '--export=ALL'")


def test_a_dash_name_written_as_a_path_runs(tmp_path):
    """``./-x`` and ``./-env`` (what the message suggests) work inside the job."""
    work, stubs = tmp_path / "work", tmp_path / "stubs"
    work.mkdir()
    stubs.mkdir()
    (stubs / "srun").write_text(STUB.format(python=sys.executable))
    (stubs / "srun").chmod(0o755)
    (work / "-env").write_text("export HPCPAX_TEST_ACTIVATED=yes\n")
    job = tmp_path / "job.sbatch"
    job.write_text(render("single_node", run_dir="./-x", activate="./-env"))
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
           "STUB_LOG": str(tmp_path / "argv.jsonl"), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NAME": "dash"}
    result = subprocess.run(["bash", str(job)], cwd=work, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (work / "-x").is_dir()
    call = json.loads((tmp_path / "argv.jsonl").read_text().splitlines()[0])
    assert call["activated"] == "yes" and call["argv"][-7:-5] == ["--run-dir", "./-x"], call
