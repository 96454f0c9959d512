"""Training configuration: one table of flags, a TOML file, and their checks.

Every setting of ``python -m hpcpax.train`` is declared once in :data:`FLAGS`;
the command line (``--global-batch``), the TOML file (``global_batch = 192``)
and :class:`~hpcpax.app.trainer.Trainer` (``{"global_batch": 192}``) all go
through :func:`resolve`, so they accept the same keys with the same checks.
Precedence: built-in defaults < ``--config`` file < flags given on the
command line. Nothing here is collective.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from ..errors import ConfigError
from .balance import MAX_GLOBAL_BATCH
from ..input_checks import (INT64_MAX, check_float, check_int, check_text, check_tree,
                            load_toml_file, shown)
from ..models.base import (MAX_CONTEXT, MAX_FIELDS, MAX_LAYERS, MAX_ROWS, MAX_SAMPLED,
                           MAX_WIDTH, parse_sizes)
from ..options import parse_bytes
from ..sync import METHODS
from ..engine.plan_requests import PLAN_MODES, load_plan_file, normalize_plan

__all__ = ["FLAGS", "MODEL_FLAGS", "TRAINING_KEYS", "PLAN_MODES", "parse_args", "resolve",
           "load_toml", "model_kwargs", "normalize_plan", "load_plan_file"]

#: Most ranks per node (servers, or a virtual node's).
MAX_RANKS = 1 << 16
#: Largest time dilation (the cluster tool's link rates are divided by it).
MAX_DILATION = 1000.0
#: Longest watchdog timeout in seconds (about 116 days; longer waits overflow timers).
MAX_TIMEOUT = 1e7


@dataclass(frozen=True)
class Flag:
    """One setting: its key (underscores), kind, default and help text."""

    key: str
    kind: str  # int, float, str, bool, sizes, plan
    default: object
    help: str
    choices: tuple = ()
    minimum: float | None = None
    above: float | None = None  # exclusive lower bound (a learning rate must be > 0)
    below: float | None = None  # exclusive upper bound
    maximum: float | None = None  # inclusive upper bound (ints: int64's when None)


FLAGS = (
    Flag("model", "str", "lm", "model to train", ("lm", "ctr")),
    # model sizes (None: the model's own default)
    Flag("vocab_size", "int", None, "lm: vocabulary rows (default: the data file's, else 10000)",
         minimum=2, maximum=MAX_ROWS),
    Flag("context", "int", None, "lm: previous tokens per example", minimum=1,
         maximum=MAX_CONTEXT),
    Flag("emb_dim", "int", None, "embedding row width", minimum=1, maximum=MAX_WIDTH),
    Flag("hidden", "sizes", None, "lm: hidden widths, e.g. 64,64", maximum=MAX_WIDTH),
    Flag("out_dim", "int", None, "lm: projection / softmax_w width", minimum=1,
         maximum=MAX_WIDTH),
    Flag("num_sampled", "int", None, "lm: sampled-softmax negatives per step", minimum=1,
         maximum=MAX_SAMPLED),
    Flag("activation", "str", None, "lm: relu or tanh", ("relu", "tanh")),
    Flag("n_dense", "int", None, "ctr: dense features", minimum=1, maximum=MAX_WIDTH),
    Flag("n_fields", "int", None, "ctr: categorical fields (one table each)", minimum=1,
         maximum=MAX_FIELDS),
    Flag("table_rows", "sizes", None, "ctr: rows per table (one int or one per field; "
         "default: the data file's cardinality, else 10000)", maximum=MAX_ROWS),
    Flag("hash_ids", "bool", False, "ctr: fold ids at or above a table's rows onto it "
         "(id %% rows, hashed features); without it such an id is a data error"),
    Flag("bottom", "sizes", None, "ctr: bottom MLP widths (last = emb_dim)", maximum=MAX_WIDTH),
    Flag("top", "sizes", None, "ctr: top MLP widths", maximum=MAX_WIDTH),
    # data
    Flag("data", "str", None, "HDF5 data file (default: synthetic data in memory)"),
    Flag("synthetic_samples", "int", 200_000, "synthetic data: tokens (lm) or rows (ctr)",
         minimum=2),
    Flag("shuffle", "bool", True, "visit the samples in a per-epoch permutation keyed by "
         "(seed, epoch), the same for any number of workers; --no-shuffle: file order"),
    # optimization
    Flag("steps", "int", 300, "training steps", minimum=1),
    Flag("global_batch", "int", 192, "examples per step over all workers", minimum=1,
         maximum=MAX_GLOBAL_BATCH),
    Flag("optimizer", "str", "adam", "dense optimizer", ("sgd", "momentum", "adagrad", "adam")),
    Flag("lr", "float", 0.003, "dense learning rate", above=0.0),
    Flag("sparse_optimizer", "str", "adagrad", "optimizer of the embedding rows (on servers)",
         ("sgd", "momentum", "adagrad", "adam")),
    Flag("sparse_lr", "float", 0.1, "sparse learning rate", above=0.0),
    Flag("seed", "int", 0, "seed of initializers, sampler and data", minimum=0,
         maximum=(1 << 64) - 1),
    Flag("dtype", "str", "float32", "parameter dtype", ("float32", "float64")),
    # layout and synchronization
    Flag("servers_per_node", "int", None, "parameter-server ranks per node "
         "(default: 1 with several ranks, else 0)", minimum=0, maximum=MAX_RANKS),
    Flag("ranks_per_node", "int", None, "cut nodes into virtual nodes of this many ranks",
         minimum=1, maximum=MAX_RANKS),
    Flag("device", "str", None, "worker device: cpu, gpu or auto (default $HPCPAX_DEVICE, "
         "else auto: GPU workers only if a trial step measured faster on the GPU); servers "
         "always run on the CPU", ("cpu", "gpu", "auto")),
    Flag("local_aggregation", "bool", True, "aggregate sparse traffic inside a node first"),
    Flag("plan", "plan", "auto", "auto (measure, then the cost model decides), hybrid "
         "(measure, then Parallax's rule), ps, allgather, allreduce (every sparse variable "
         "so), or a JSON plan file (a saved plan.json or {name: {method, partitions}})"),
    Flag("hot_rows", "str", "auto", "auto (the plan's cost model decides per ps variable if "
         "rows many nodes touch take trees), relays (every row two or more nodes off its "
         "owner touch goes once, through one of them) or off", ("auto", "relays", "off")),
    Flag("hot_rows_trial", "int", 3, "auto/hybrid: when the plan puts rows on trees, time up "
         "to this many pairs of live steps with and without them and keep the faster; trees "
         "a run too short to time are off (0: trust the cost model)", minimum=0),
    Flag("plan_steps", "int", 5, "auto/hybrid: steps measured before the plan is made",
         minimum=1),
    Flag("plan_calibrate", "bool", True, "auto: time the cost model's constants on this job "
         "at start-up (kernel rates on every rank, each operation's fixed cost, the hand-offs, "
         "the fabric; a few seconds) instead of kernel rates on one rank"),
    Flag("fabric_seconds", "float", 0.5, "auto/hybrid: time budget of the start-up fabric "
         "measurement", minimum=0.01, maximum=3600.0),
    Flag("partition_search", "bool", False, "auto/hybrid: Parallax's partition search on live "
         "steps after the plan"),
    Flag("replan_every", "int", 0, "auto/hybrid: re-measure and re-plan every N steps (0: never)",
         minimum=0),
    Flag("replan_threshold", "float", 0.1, "re-planning switches a method only for a predicted "
         "gain above this fraction", minimum=0.0),
    Flag("consistency", "str", "bsp", "bsp (the collective path), ssp:S (a worker runs at most "
         "S steps ahead of the slowest), asp (no bound) or psp:B[,S] (B peers sampled per "
         "pull must be within S steps); per sparse variable after ';', e.g. "
         "'ssp:3; softmax_b=asp'; or auto (bsp, balanced shares or ssp:S, set at run time "
         "from measured step times). Relaxed models and auto need server ranks and --plan ps"),
    Flag("auto_segment", "int", 10, "consistency auto: steps of the first measured segment "
         "(doubling while the mode stays, up to 8x)", minimum=3),
    Flag("dense_period", "str", "1", "relaxed models: steps between refreshes of the dense "
         "replicas from the servers (local updates in between): K, or auto / auto:KMAX (set "
         "at run time from the replicas' measured divergence)"),
    Flag("consistency_groups", "str", "worker", "what a relaxed model relaxes: each worker "
         "against the others, or whole nodes (BSP inside a node)", ("worker", "node")),
    Flag("straggler", "str", None, "RANK:FACTOR[,...]: that world rank (a worker's) sleeps "
         "(FACTOR - 1) x its compute time every step (tests, benchmarks)"),
    Flag("stalls", "str", None, "P:FACTOR: every worker sleeps (FACTOR - 1) x its compute time "
         "on a random fraction P of its steps (tests, benchmarks)"),
    Flag("emulate_compute", "str", None, "emulated accelerators: a worker's forward/backward "
         "becomes a wait holding no CPU, SECONDS, SECONDS+SECONDS/sample or a preset (lm1b); "
         "exchanges, rows and optimizers stay real, the loss is not computed"),
    Flag("time_dilation", "float", 1.0, "D: emulated compute x D, reported times / D (links "
         "slowed by D by the cluster tool, python -m hpcpax.cluster up --dilation D)",
         above=0.0, maximum=MAX_DILATION),
    Flag("batch_shares", "str", None, "each worker's share of the global batch, 'A,B,...' "
         "(fixed; also under ssp/asp/psp) or 'speed' (bsp only: balanced BSP, shares that "
         "make the workers finish together, re-agreed every --rebalance-every steps); "
         "global batch and gradient stay BSP's"),
    Flag("rebalance_every", "int", 20, "batch_shares speed: steps between re-evaluations",
         minimum=1),
    Flag("trace", "str", None, "write a per-rank timeline to this file (Chrome/Perfetto "
         "trace-event JSON: phases, barrier waits, decisions; relaxed runs: servers too)"),
    Flag("bucket_bytes", "int", 1 << 20, "dense allreduce fusion buffer bytes (0: autotune)",
         minimum=0, maximum=1 << 40),
    # run directory, checkpoints, evaluation
    Flag("run_dir", "str", None, "output directory (default runs/<timestamp>)"),
    Flag("checkpoint_every", "int", 0, "checkpoint every N steps and after the last one "
         "(0: only on preemption)", minimum=0),
    Flag("keep_checkpoints", "int", 3, "keep the newest K checkpoints (0: all)", minimum=0),
    Flag("resume", "bool", False, "continue from RUN_DIR's newest intact checkpoint (a new or "
         "empty RUN_DIR starts at step 1)"),
    Flag("overwrite", "bool", False, "start over in a RUN_DIR that already holds a run (the old "
         "run is kept, renamed RUN_DIR.replaced-<time>)"),
    Flag("eval_every", "int", 0, "evaluate every N steps (0: never)", minimum=0),
    Flag("eval_batches", "int", 2, "global batches per evaluation (at most the held-out "
         "set's)", minimum=1),
    Flag("eval_data", "str", None, "held-out data file to evaluate on (same kind and "
         "vocabulary as --data: python -m hpcpax.data text ... --eval-output)"),
    Flag("eval_fraction", "float", 0.0, "hold out this last fraction of the data (tokens for "
         "lm, rows for ctr) from training and evaluate on it (0: no split; without either, "
         "evaluation reads training batches)", minimum=0.0, below=1.0),

    # reliability
    Flag("timeout", "float", None, "seconds a step (or served operation) may take before the "
         "watchdog reports the stuck ranks and aborts (default $HPCPAX_TIMEOUT, else 600; "
         "0: off)", minimum=0.0, maximum=MAX_TIMEOUT),
    Flag("server_memory_budget", "str", None, "bytes of sparse tables plus optimizer slots one "
         "owner rank may hold, e.g. 8G (default $HPCPAX_SERVER_MEMORY, else available memory "
         "x 0.8 / ranks on the node)"),
    Flag("table_eviction", "str", "none", "when a ps table outgrows the memory budget: none "
         "(stop with an error) or lru (drop the least recently used rows; they restart from "
         "the initializer when touched again)", ("none", "lru")),

    Flag("quiet", "bool", False, "no progress bar, no config print"),
    Flag("verbose_ranks", "bool", False, "let every rank print"),
)

_BY_KEY = {flag.key: flag for flag in FLAGS}

#: Model flags each model accepts (mapped onto :func:`hpcpax.models.build_model`).
MODEL_FLAGS = {
    "lm": ("vocab_size", "context", "emb_dim", "hidden", "out_dim", "num_sampled", "activation"),
    "ctr": ("n_dense", "n_fields", "table_rows", "emb_dim", "bottom", "top"),
}

#: Keys that define the training math; a checkpoint resumes only if they match.
TRAINING_KEYS = ("model", "vocab_size", "context", "emb_dim", "hidden", "out_dim",
                 "num_sampled", "activation", "n_dense", "n_fields", "table_rows", "bottom",
                 "top", "data", "synthetic_samples", "shuffle", "global_batch", "optimizer",
                 "lr", "sparse_optimizer", "sparse_lr", "seed", "dtype", "hash_ids", "eval_fraction")


def _check_value(flag: Flag, value, where: str):
    """``value`` converted to the flag's kind, or ConfigError naming ``where``.

    Every number and text goes through :mod:`hpcpax.input_checks`: finite
    floats, ints within the flag's bounds (int64 at most), one-line text.
    """
    if value is None:
        if flag.default is None:
            return None
        raise ConfigError(f"{where} must be {flag.kind}, not None")
    kind = flag.kind
    if kind == "bool":
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            value = value.lower() in ("true", "1", "yes")
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be bool, not {type(value).__name__} "
                              f"({shown(value)})")
        return value
    if kind == "int":
        value = check_int(value, where, flag.minimum,
                          INT64_MAX if flag.maximum is None else int(flag.maximum))
    elif kind == "float":
        value = check_float(value, where, maximum=flag.maximum)
    elif kind == "str":
        value = check_text(value, where)
    elif kind == "sizes":
        if isinstance(value, bool) or not isinstance(value, (int, str, list, tuple)):
            raise ConfigError(f"{where} must be an int, a list of ints or '64,32', "
                              f"not {type(value).__name__}")
        if isinstance(value, str):
            check_text(value, where)
        return list(parse_sizes(value, where, allow_empty=True,
                                maximum=int(flag.maximum or INT64_MAX),
                                max_count=MAX_FIELDS if flag.key == "table_rows" else MAX_LAYERS))
    elif kind == "plan":
        if isinstance(value, dict):
            return normalize_plan(check_tree(value, where), where)
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a method name, a file or a table, "
                              f"not {type(value).__name__} ({shown(value)})")
        check_text(value, where)
        if value == "dense":
            raise ConfigError(f"{where} must be one of {list(PLAN_MODES + METHODS)} or a plan "
                              "file, not 'dense' (a densified sparse table is 'allreduce')")
        if value not in PLAN_MODES and value not in METHODS:
            load_plan_file(value)  # a bad file stops here, before any rank starts the job
        return value
    if flag.choices and value not in flag.choices:
        raise ConfigError(f"{where} must be one of {list(flag.choices)}, not {shown(value)}")
    if flag.minimum is not None and value < flag.minimum:
        raise ConfigError(f"{where} must be >= {flag.minimum}, not {value!r}")
    if flag.above is not None and not value > flag.above:
        raise ConfigError(f"{where} must be > {flag.above:g}, not {value!r}")
    if flag.below is not None and not value < flag.below:
        raise ConfigError(f"{where} must be < {flag.below:g}, not {value!r}")
    return value


def load_toml(path) -> dict:
    """Read a TOML config; keys are flag names with underscores.

    The file is read through :func:`hpcpax.input_checks.load_toml_file`
    (bounded size, strict UTF-8, bounded nesting, finite numbers).

    Raises:
        ConfigError: unreadable file, bad TOML, an unknown key or a bad value
            (the message names the key and the file).
    """
    path = os.fspath(path)
    data = load_toml_file(path, "config file")
    out = {}
    for key, value in data.items():
        normalized = key.replace("-", "_")
        if normalized not in _BY_KEY or normalized == "config":
            raise ConfigError(f"config file {path}: unknown key {shown(key)}")
        out[normalized] = _check_value(_BY_KEY[normalized], value, f"{path}: {key}")
    return out


def resolve(overrides: dict | None = None, *, config_file=None, flags=False) -> dict:
    """Defaults, then the TOML file, then ``overrides``: the checked config dict.

    Args:
        overrides: ``{key: value}`` (flag names with underscores).
        config_file: optional TOML path (also accepted as ``overrides["config"]``).
        flags: the overrides came from the command line: errors name them as
            ``--flag-name`` instead of ``key``.

    Raises:
        ConfigError: unknown key or bad value, named (TOML values as
            ``FILE: key``).
    """
    overrides = dict(overrides or {})
    config_file = overrides.pop("config", None) or config_file
    config = {flag.key: flag.default for flag in FLAGS}
    if config_file:
        config.update(load_toml(config_file))
    for key, value in overrides.items():
        if key not in _BY_KEY:
            raise ConfigError(f"unknown config key {key!r}")
        config[key] = _check_value(_BY_KEY[key], value,
                                   "--" + key.replace("_", "-") if flags else key)
    config["config"] = os.fspath(config_file) if config_file else None
    _check_combination(config)
    return config


def _check_combination(config):
    other = "ctr" if config["model"] == "lm" else "lm"
    for key in MODEL_FLAGS[other]:
        if key not in MODEL_FLAGS[config["model"]] and config[key] is not None:
            raise ConfigError(f"{key} is a flag of model {other!r}, not of {config['model']!r}")
    if config["resume"] and config["overwrite"]:
        raise ConfigError("resume and overwrite exclude each other: continue the run in "
                          "run_dir, or start it over")
    if config["resume"] and not config["run_dir"]:
        raise ConfigError("resume needs run_dir: the directory holding the checkpoints")
    if config["eval_data"] is not None and config["eval_fraction"]:
        raise ConfigError("eval_data and eval_fraction both name a held-out set; give one "
                          f"(eval_data {config['eval_data']!r}, eval_fraction "
                          f"{config['eval_fraction']})")
    # a size the servers would refuse only once the job has started
    parse_bytes(config["server_memory_budget"], "server_memory_budget")
    _check_consistency(config)


def _check_consistency(config):
    from ..ps.relaxed.consistency import parse_consistency_spec
    from ..plan.dense_period import parse_dense_period
    from .balance import check_run_time
    from .stragglers import parse_stalls, parse_straggler

    from .emulation import check_step_seconds, parse_emulate_compute

    parse_straggler(config["straggler"])
    parse_stalls(config["stalls"])
    check_step_seconds(parse_emulate_compute(config["emulate_compute"], config["time_dilation"]),
                       config["global_batch"])
    period = parse_dense_period(config["dense_period"])
    if check_run_time(config):  # consistency auto: decided at run time
        if period[:2] != (1, False):
            raise ConfigError("dense_period applies to a fixed relaxed consistency, not auto "
                              "(its ssp segments refresh dense replicas every step)")
        return
    default, per_variable = parse_consistency_spec(config["consistency"])
    relaxed = default.relaxed or any(m.relaxed for m in per_variable.values())
    if period[:2] != (1, False) and not relaxed:
        raise ConfigError(f"dense_period needs a relaxed consistency (ssp:S, asp, psp:B), not "
                          f"{config['consistency']!r}: under bsp dense variables are averaged "
                          "every step by the allreduce")
    if not relaxed:
        return
    for key in ("partition_search", "replan_every"):
        if config[key]:
            raise ConfigError(f"{key} needs consistency bsp, not {config['consistency']!r} "
                              "(relaxed models keep the plan fixed)")
    if config["batch_shares"] == "speed":  # fixed shares: each worker's samples, weighted
        raise ConfigError(f"batch_shares speed needs consistency bsp or auto, not "
                          f"{config['consistency']!r} (under a relaxed model only fixed "
                          "shares 'A,B,...' apply)")


def model_kwargs(config: dict) -> dict:
    """The :func:`~hpcpax.models.build_model` keyword arguments the config sets."""
    kwargs = {"seed": config["seed"], "dtype": config["dtype"]}
    for key in MODEL_FLAGS[config["model"]]:
        if config[key] is not None:
            value = config[key]
            kwargs[key] = tuple(value) if isinstance(value, list) else value
    if config["model"] == "ctr" and "emb_dim" in kwargs and "bottom" not in kwargs:
        kwargs["bottom"] = (32, kwargs["emb_dim"])  # the last bottom width must be emb_dim
    return kwargs


def _help(flag: Flag) -> str:
    """The help text with its default once: none when the text already says it."""
    if "default" in flag.help or flag.default is None:
        return flag.help
    if flag.kind == "bool":
        return f"{flag.help} (default: {'on' if flag.default else 'off'})"
    return f"{flag.help} (default: {flag.default})"


def _add_flag(parser, flag: Flag):
    option = "--" + flag.key.replace("_", "-")
    if flag.kind == "bool":
        parser.add_argument(option, dest=flag.key, action=argparse.BooleanOptionalAction,
                            default=argparse.SUPPRESS, help=_help(flag))
        return
    metavar = {"int": "N", "float": "X", "sizes": "N[,N...]", "plan": "METHOD|FILE"}.get(
        flag.kind, "VALUE")
    if flag.choices:
        metavar = "{" + ",".join(flag.choices) + "}"
    parser.add_argument(option, dest=flag.key, default=argparse.SUPPRESS, metavar=metavar,
                        help=_help(flag))


class _OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are a one-line :class:`ConfigError` (no usage
    block), so ``python -m hpcpax.train`` prints them once, on rank 0, and exits with 2."""

    def error(self, message):
        """Raise ``ConfigError("MESSAGE (see --help)")``."""
        raise ConfigError(f"{' '.join(str(message).split())} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m hpcpax.train`` (every flag, with its help)."""
    parser = _OneLineParser(
        prog="python -m hpcpax.train",
        description="Train a sparse model with hybrid data parallelism "
                    "(run under: mpirun -n N python -m mpi4py -m hpcpax.train).")
    parser.add_argument("--config", dest="config", default=argparse.SUPPRESS, metavar="FILE",
                        help="TOML file of settings (keys = flag names with underscores); "
                             "flags given here override it")
    for flag in FLAGS:
        _add_flag(parser, flag)
    return parser


def parse_args(argv=None) -> dict:
    """Command line (plus ``--config`` file) -> the checked config dict.

    Raises:
        ConfigError: a bad value, an unknown TOML key, or a flag argparse refuses
            (unknown, or missing its value).
    """
    namespace = build_parser().parse_args(argv)
    return resolve(vars(namespace), flags=True)
