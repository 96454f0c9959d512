"""Render the Slurm job script templates in ``jobscripts/``.

A template is a batch script with ``{{name}}`` placeholders. Its header
declares each placeholder, its default and a help line::

    #% ntasks_per_node = 4
    #%   MPI ranks per node: servers plus workers
    #% train_args (words) = --model lm --steps 1000
    #%   arguments of the training program

``#%`` lines are dropped from the output. A placeholder declared without
``=`` has no default and must be given. An ``#SBATCH`` line whose placeholder
renders empty is disabled (written ``##SBATCH``, which Slurm ignores), so an
empty ``partition`` means "the cluster's default".

Values are data, never code (:mod:`hpcpax.app.jobscript_values`): each is
written as one quoted word, a ``(words)`` placeholder as its words, each
quoted; nothing in a value is expanded when the job runs. A value that the
job should expand at run time (``$SLURM_JOB_NAME``) belongs in the template.

Command line (flags are generated from the template's placeholders)::

    python -m hpcpax.jobscript --list
    python -m hpcpax.jobscript single_node --ntasks-per-node 4 --time 00:10:00 -o job.sbatch
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import importlib.resources.abc
import pathlib
import re
import sys
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from ..errors import ConfigError
from .jobscript_values import check_template_lines, check_text, sbatch_word, shell_word, split_words

__all__ = ["Template", "render", "list_templates", "load_template", "check_values", "main"]

SUFFIX = ".sbatch"
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_DECLARATION = re.compile(r"^#%\s(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?P<words>\s+\(words\))?"
                          r"\s*(?:=\s?(?P<default>.*))?$")
_HELP = re.compile(r"^#%\s{2,}(?P<help>\S.*)$")


@dataclasses.dataclass(frozen=True)
class Template:
    """A parsed template: its body, and for each placeholder a default (None: required) and help.

    ``words`` names the placeholders declared ``(words)``: word lists, split and quoted word by word.
    """

    name: str
    text: str
    defaults: Dict[str, Optional[str]]
    help: Dict[str, str]
    words: FrozenSet[str] = frozenset()

    @property
    def placeholders(self) -> Tuple[str, ...]:
        """Every placeholder, declared ones first in declaration order, then any used but undeclared."""
        used = [m.group(1) for m in _PLACEHOLDER.finditer(self.text)]
        return tuple(dict.fromkeys(list(self.defaults) + used))


def _template_sources() -> Dict[str, "importlib.resources.abc.Traversable"]:
    """Template name -> file: the installed package data first, then the source tree."""
    folders = []
    try:
        folders.append(importlib.resources.files("hpcpax.jobscripts"))
    except (ModuleNotFoundError, TypeError):
        pass  # running from a source checkout: setup.py has not mapped jobscripts/ yet
    folders.append(pathlib.Path(__file__).resolve().parent.parent / "jobscripts")
    sources: Dict[str, "importlib.resources.abc.Traversable"] = {}
    for folder in folders:
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if entry.name.endswith(SUFFIX) and entry.is_file():
                sources.setdefault(entry.name[: -len(SUFFIX)], entry)
    return sources


def list_templates() -> List[str]:
    """Names of the shipped templates (file stems), sorted."""
    return sorted(_template_sources())


def _read(template: str) -> Tuple[str, str]:
    """(name, text) of a template given by name or by path."""
    path = pathlib.Path(template)
    if path.suffix == SUFFIX or len(path.parts) > 1:
        if path.is_file():
            return path.stem, path.read_text()
        raise ConfigError(f"template file {template!r} does not exist")
    sources = _template_sources()
    if template in sources:
        return template, sources[template].read_text()
    raise ConfigError(
        f"template must be one of {sorted(sources)} or a path to a {SUFFIX} file, not {template!r}")


def _parse(name: str, source: str) -> Template:
    defaults: Dict[str, Optional[str]] = {}
    help_lines: Dict[str, str] = {}
    words = set()
    body = []
    last = None
    for line in source.splitlines(keepends=True):
        if not line.startswith("#%"):
            body.append(line)
            continue
        stripped = line.rstrip("\n")
        declaration = _DECLARATION.match(stripped)
        help_match = _HELP.match(stripped)
        if help_match and last is not None:
            help_lines[last] = (help_lines.get(last, "") + " " + help_match.group("help")).strip()
        elif declaration:
            last = declaration.group("name")
            if last in defaults:
                raise ConfigError(f"template {name!r} declares placeholder {last!r} twice")
            default = declaration.group("default")
            defaults[last] = None if default is None else default.rstrip()
            if declaration.group("words"):
                words.add(last)
        else:
            last = None
    check_template_lines(name, "".join(body), frozenset(words))
    return Template(name=name, text="".join(body), defaults=defaults, help=help_lines,
                    words=frozenset(words))


def load_template(template: str) -> Template:
    """Find and parse a template by name (``"single_node"``) or by path."""
    return _parse(*_read(template))


def render(template: str, **values: object) -> str:
    """Render a template; ``values`` override its defaults.

    Not collective; pure function of the template file and ``values``.

    Every value is written as data: outside ``#SBATCH`` lines as one
    shell-quoted word (a ``(words)`` placeholder: its words, each quoted),
    in ``#SBATCH`` lines escaped for Slurm's directive parser.

    Args:
        template: a name from :func:`list_templates` or a path to a ``.sbatch`` file.
        **values: placeholder values (str, int or float).

    Returns:
        The batch script text, with no ``{{...}}`` and no ``#%`` lines left.

    Raises:
        ConfigError: unknown keyword, a placeholder with neither value nor
            default, an unknown template, a value with a control character,
            a word list with unquoted shell syntax, or a value
            :func:`check_values` refuses; the message names the flag.
    """
    parsed = load_template(template)
    known = parsed.placeholders
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(
            f"template {parsed.name!r} has no placeholder {', '.join(unknown)}; "
            f"it has: {', '.join(known)}")
    resolved: Dict[str, str] = {}
    for name in known:
        if name in values:
            value = values[name]
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ConfigError(f"{name} must be str, int or float, not {type(value).__name__}")
            resolved[name] = str(value)
        elif parsed.defaults.get(name) is not None:
            resolved[name] = parsed.defaults[name]
        else:
            raise ConfigError(
                f"template {parsed.name!r} needs a value for placeholder {{{{{name}}}}} (it has no default)")
    for name, value in resolved.items():
        check_text(_flag(name), value)
    check_values(resolved)
    words = {name: split_words(_flag(name), resolved[name]) for name in parsed.words}
    for name in _PROGRAMS:  # the program srun starts: a leading "-" would be an srun option
        if words.get(name) and words[name][0].startswith("-"):
            raise ConfigError(f"{_flag(name)} must start with the program to run, not the "
                              f"option {words[name][0]!r} (srun would read it as its own)")

    def written(name: str, directive: bool) -> str:
        quote = sbatch_word if directive else shell_word
        if name in words:
            return " ".join(quote(word) for word in words[name])
        return quote(resolved[name])

    lines = []
    for line in parsed.text.splitlines(keepends=True):
        directive = line.startswith("#SBATCH")
        names = _PLACEHOLDER.findall(line)
        rendered = _PLACEHOLDER.sub(lambda m: written(m.group(1), directive), line)
        # An empty value disables its directive rather than passing Slurm an empty option.
        if directive and any(resolved[n] == "" for n in names):
            rendered = "#" + rendered
        lines.append(rendered)
    return "".join(lines)


#: Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, or no limit.
_TIME = re.compile(r"^(\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|UNLIMITED|INFINITE)$", re.IGNORECASE)
#: Placeholders naming a file or program the job passes to a command as an operand
#: (``mkdir -p "$RUN_DIR"``, ``source "$ACTIVATE"``, ``srun PYTHON -m mpi4py SCRIPT``): a
#: value starting with ``-`` would be read there as an option, so it is refused.
_OPERANDS = ("run_dir", "activate", "python", "script")
#: Word-list placeholders whose first word is the program srun starts.
_PROGRAMS = ("command",)
#: Placeholders with a known meaning: the least value each takes (an int).
_AT_LEAST = {"nodes": 1, "ntasks_per_node": 1, "cpus_per_task": 1, "gpus_per_node": 0,
             "servers_per_node": 0, "ranks_per_node": 0, "checkpoint_every": 0,
             "signal_seconds": 0}


def check_values(values: Dict[str, str]) -> None:
    """Refuse values Slurm or hpcpax would refuse only once the job runs.

    Checks the placeholders with a known meaning that ``values`` has and
    that are not empty: counts (:data:`_AT_LEAST`; a value is data, so
    ``$SLURM_NTASKS`` is not a count), ``time`` in one of Slurm's forms, at
    least one worker per node (``servers_per_node`` below
    ``ntasks_per_node``), ``activate`` naming a file rather than a
    shell line, and no file or program operand (:data:`_OPERANDS`:
    ``run_dir``, ``activate``, ``python``, ``script``) starting with
    ``-``. A job script with such a value would wait in the queue and
    then fail.

    Raises:
        ConfigError: naming the flag, the value and what it must be.
    """
    numbers = {}
    for name, least in _AT_LEAST.items():
        text = values.get(name, "").strip()
        if not text:  # empty: directive disabled
            continue
        try:
            numbers[name] = int(text)
        except ValueError:
            raise ConfigError(f"{_flag(name)} must be an int >= {least}, not {text!r}") from None
        if numbers[name] < least:
            raise ConfigError(f"{_flag(name)} must be an int >= {least}, not {text!r}")
    time = values.get("time", "").strip()
    if time and not _TIME.match(time):
        raise ConfigError(f"--time must be one of Slurm's forms (minutes, MM:SS, HH:MM:SS, "
                          f"D-HH, D-HH:MM, D-HH:MM:SS), not {time!r}")
    if "servers_per_node" in numbers and "ntasks_per_node" in numbers \
            and numbers["servers_per_node"] >= numbers["ntasks_per_node"]:
        raise ConfigError(f"--servers-per-node {numbers['servers_per_node']} leaves no worker "
                          f"among --ntasks-per-node {numbers['ntasks_per_node']} ranks per node")
    for name in _OPERANDS:
        value = values.get(name, "")
        if value.startswith("-"):
            raise ConfigError(f"{_flag(name)} must not start with '-' (the job passes it to a "
                              f"command, which would read an option), not {value!r}; write "
                              f"./{value} for a name in the submit directory")
    activate = values.get("activate", "")
    if re.match(r"(source|\.)\s", activate):
        raise ConfigError(f"--activate must be the file to source (the job runs `source FILE`), "
                          f"not the shell line {activate!r}")


#: A shell variable reference, which a value keeps as written.
_VARIABLE = re.compile(r"\$\{?[A-Za-z_]")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: render a template to a file or stdout; ``--list`` names the templates."""
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("template", nargs="?")
    first.add_argument("--list", action="store_true")
    known, _ = first.parse_known_args(argv)
    if known.list:
        print("\n".join(list_templates()))
        return 0

    epilog = []
    for name in list_templates():  # the flags each template takes, also without a template
        flags = " ".join(_flag(p) for p in load_template(name).placeholders)
        epilog.append(f"{name} flags: {flags}")
    parser = argparse.ArgumentParser(
        prog="python -m hpcpax.jobscript",
        description="Render an hpcpax Slurm job script. Templates: " + ", ".join(list_templates()),
        epilog="\n".join(epilog) + "\n`python -m hpcpax.jobscript TEMPLATE --help` explains "
        "each flag and its default.", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("template", help="template name or path to a .sbatch file")
    parser.add_argument("--list", action="store_true", help="list the templates and exit")
    parser.add_argument("-o", "--output", dest="output_file", metavar="FILE",
                        help="write here instead of stdout")
    template = None
    if known.template is not None and not known.template.startswith("-"):
        try:
            template = load_template(known.template)
        except ConfigError as error:
            parser.error(str(error))
    if template is not None:
        group = parser.add_argument_group(f"placeholders of {template.name}")
        for name in template.placeholders:
            default = template.defaults.get(name)
            text = template.help.get(name, "")
            if name in template.words:
                text += "; split into words, quote a word holding spaces or shell syntax"
            text += " (required)" if default is None else f" (default: {default!r})"
            # Both spellings work: --ntasks-per-node and --ntasks_per_node.
            flags = [_flag(name)] + ([f"--{name}"] if "_" in name else [])
            # argparse %-formats help text; Slurm patterns like %j must stay literal.
            group.add_argument(*flags, dest=name, metavar="VALUE",
                               help=text.strip().replace("%", "%%"))
    args = parser.parse_args(argv)
    values = {name: getattr(args, name) for name in (template.placeholders if template else ())
              if getattr(args, name) is not None}
    try:
        text = render(args.template, **values)
    except ConfigError as error:  # one line: the flag and its value, no usage text
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    for name, value in values.items():
        if name not in template.words and _VARIABLE.search(value):
            sys.stderr.write(f"{parser.prog}: note: {_flag(name)} {value!r} is used as written; "
                             f"$ is not expanded when the job runs (to expand it now, "
                             f"double-quote it in your shell)\n")
    if args.output_file:
        pathlib.Path(args.output_file).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
