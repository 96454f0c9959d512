"""hpcpax.app.jobscript: templates render, match their golden files and parse as bash."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from hpcpax.errors import ConfigError
from hpcpax.app.jobscript import list_templates, load_template, main, render

GOLDEN = pathlib.Path(__file__).parent / "golden"
TEMPLATES = ["multi_node", "single_node"]
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")


def bash_syntax_ok(text, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_list_templates():
    assert set(TEMPLATES) <= set(list_templates())


@pytest.mark.parametrize("name", TEMPLATES + ["script"])
def test_default_render_matches_golden(name):
    text = render(name)
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPCPAX_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"{name} renders differently from {golden}; if the change is intended, "
        f"rerun with HPCPAX_UPDATE_GOLDEN=1 and review the diff")


@pytest.mark.parametrize("name", TEMPLATES + ["script"])
@needs_bash
def test_default_render_is_clean_bash(name, tmp_path):
    text = render(name)
    assert "{{" not in text and "}}" not in text
    assert not any(line.startswith("#%") for line in text.splitlines())
    assert text.startswith("#!/bin/bash\n")
    assert "set -euo pipefail" in text
    bash_syntax_ok(text, tmp_path)


@pytest.mark.parametrize("name", TEMPLATES + ["script"])
def test_every_placeholder_has_default_and_help(name):
    template = load_template(name)
    assert set(re.findall(r"\{\{(\w+)\}\}", template.text)) == set(template.defaults)
    for placeholder, default in template.defaults.items():
        assert default is not None, placeholder
        assert template.help.get(placeholder), placeholder


@pytest.mark.parametrize("name", TEMPLATES)
def test_required_features(name):
    text = render(name, mpi="pmix", gpus_per_node=4, signal_seconds=90)
    for needle in ["#SBATCH --gpus-per-node=4", "##SBATCH --gpu-bind=closest", "srun --mpi=pmix ",
                   "UCX_TLS", "OMPI_MCA_pml=ucx", "MPIR_CVAR_ENABLE_GPU",
                   "#SBATCH --signal=B:USR1@90", "#SBATCH --requeue", "--resume",
                   "python -m mpi4py -m hpcpax.train", "scontrol requeue"]:
        assert needle in text, needle


@needs_bash
def test_script_template_runs_a_users_script(tmp_path):
    text = render("script", script="train.py", script_args="--steps 7", servers_per_node=2,
                  ranks_per_node=4, mpi="pmix", gpus_per_node=4)
    for needle in ["#SBATCH --gpus-per-node=4", "export HPCPAX_SERVERS_PER_NODE=2\n",
                   "export HPCPAX_RANKS_PER_NODE=4\n",
                   "srun --mpi=pmix --kill-on-bad-exit=1 python -m mpi4py train.py --steps 7\n"]:
        assert needle in text, needle
    bash_syntax_ok(text, tmp_path)


@needs_bash
def test_values_override_defaults(tmp_path):
    text = render("single_node", job_name="ci", ntasks_per_node=3, partition="gpu",
                  time="00:05:00", train_args="--model ctr --steps 7", run_dir="/scratch/r1",
                  activate="/opt/venv/bin/activate", command="python -m mpi4py train.py")
    for needle in ["#SBATCH --job-name=ci\n", "#SBATCH --ntasks-per-node=3\n",
                   "#SBATCH --partition=gpu\n", "#SBATCH --time=00:05:00\n",
                   "\nACTIVATE=/opt/venv/bin/activate\n", "\nRUN_DIR=/scratch/r1\n",
                   "python -m mpi4py train.py --model ctr --steps 7 \\\n"]:
        assert needle in text, needle
    bash_syntax_ok(text, tmp_path)


def test_empty_value_disables_directive():
    text = render("single_node", partition="", gpus_per_node="")
    assert "\n##SBATCH --partition=\n" in text and "\n##SBATCH --gpus-per-node=\n" in text
    assert "\n#SBATCH --partition" not in text


def test_unknown_keyword():
    with pytest.raises(ConfigError, match="no placeholder bogus"):
        render("single_node", bogus=1)


def test_bad_value_type():
    with pytest.raises(ConfigError, match="nodes must be str, int or float, not list"):
        render("single_node", nodes=[1])
    with pytest.raises(ConfigError, match="--job-name must be one line without control"):
        render("single_node", job_name="a\nb")


@pytest.mark.parametrize("values, message", [
    ({"nodes": 0}, "--nodes must be an int >= 1, not '0'"),
    ({"cpus_per_task": "two"}, "--cpus-per-task must be an int >= 1, not 'two'"),
    ({"checkpoint_every": -5}, "--checkpoint-every must be an int >= 0"),
    ({"time": "1h"}, "--time must be one of Slurm's forms"),
    ({"ntasks_per_node": 2, "servers_per_node": 2}, "leaves no worker among --ntasks-per-node 2"),
])
def test_values_slurm_or_hpcpax_would_refuse_at_run_time(values, message):
    """Refused at render time, not after the job waited in the queue."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        render("multi_node", **values)


@pytest.mark.parametrize("time", ["30", "10:00", "01:00:00", "2-0", "1-12:00", "1-00:00:00",
                                  "UNLIMITED"])
def test_every_slurm_time_form_renders(time):
    assert f"--time={time}" in render("multi_node", time=time)


def test_empty_values_are_not_checked_and_variables_are_not_counts():
    assert "##SBATCH --gpus-per-node=" in render("multi_node", gpus_per_node="")
    # A value is data, never expanded when the job runs: "$SLURM_NTASKS" is no count.
    with pytest.raises(ConfigError, match=re.escape(
            "--checkpoint-every must be an int >= 0, not '$SLURM_NTASKS'")):
        render("multi_node", checkpoint_every="$SLURM_NTASKS")


def test_unknown_template():
    with pytest.raises(ConfigError, match="template must be one of .*single_node.* not 'nope'"):
        render("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        render("/no/such/file.sbatch")


def test_missing_value_names_placeholder(tmp_path):
    path = tmp_path / "custom.sbatch"
    path.write_text("#!/bin/bash\n#% nodes = 1\n#% account\n#%   Slurm account, required\n"
                    "#SBATCH --nodes={{nodes}}\n#SBATCH --account={{account}}\n"
                    "echo {{undeclared}}\n")
    with pytest.raises(ConfigError, match=r"placeholder \{\{account\}\}"):
        render(str(path), undeclared="x")
    with pytest.raises(ConfigError, match=r"placeholder \{\{undeclared\}\}"):
        render(str(path), account="proj")
    text = render(str(path), account="proj", undeclared="x")
    assert text == "#!/bin/bash\n#SBATCH --nodes=1\n#SBATCH --account=proj\necho x\n"


def test_cli_writes_file(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert main(["single_node", "--nodes", "1", "--ntasks-per-node", "2",
                 "--train_args", "--model lm --steps 20", "-o", str(out)]) == 0
    assert out.read_text() == render("single_node", nodes=1, ntasks_per_node=2,
                                     train_args="--model lm --steps 20")


def test_cli_stdout_and_list(capsys):
    assert main(["multi_node", "--nodes", "8"]) == 0
    assert capsys.readouterr().out == render("multi_node", nodes=8)
    assert main(["--list"]) == 0
    assert capsys.readouterr().out.split() == list_templates()


def test_cli_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["single_node", "--bogus", "1"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        main(["nope"])
    assert "not 'nope'" in capsys.readouterr().err


def test_cli_as_module(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hpcpax.jobscript", "--list"],
                            capture_output=True, text=True, timeout=60,
                            cwd=pathlib.Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr
    assert "single_node" in result.stdout.split()


def test_help_without_a_template_lists_every_templates_flags():
    out = subprocess.run([sys.executable, "-m", "hpcpax.jobscript", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    for name in TEMPLATES:
        line = next(l for l in out.splitlines() if l.startswith(f"{name} flags:"))
        assert all(f"--{p.replace('_', '-')}" in line.split()
                   for p in load_template(name).placeholders), line
