"""``python -m hpcpax.data``: make and check hpcpax data files.

Subcommands (each prints one summary line; files are written atomically)::

    text FILE... -o out.h5 --vocab-size N [--tokenizer whitespace|words] [--lowercase]
    csv FILE --label COL --categorical COLS [--dense COLS] -o out.h5 [--hash-buckets N]
    synth lm|ctr -o out.h5 [--samples N] [--vocab-size N] [--fields F] [--dense D]
                          [--cardinality C] [--seed S] [--zipf A]

``text``, ``csv`` and ``synth`` also take ``--eval-output EVAL.h5
--eval-fraction F``: the last fraction F of the data goes to EVAL.h5 instead
(a held-out set for ``python -m hpcpax.train --eval-data EVAL.h5``).
    check FILE [--kind lm|ctr] [--context K] [--vocab-size N] [--table-rows N]
    unigram TRAIN.h5 EVAL.h5 [--context K]   (the unigram baseline perplexity of EVAL)

``COLS`` is a comma-separated list of column names. Exit status 1 and one
``error:`` line on stderr for any data problem.
"""

import argparse
import sys

from hpcpax.data.dataset import open_dataset
from hpcpax.data.layouts import FORMAT_CTR, FORMAT_LM, open_h5, read_format
from hpcpax.data.synthetic import generate_ctr, generate_lm, lm_vocab
from hpcpax.data.tabular import DEFAULT_HASH_BUCKETS, csv_to_h5
from hpcpax.data.text import TOKENIZERS, text_to_h5
from hpcpax.data.writing import write_ctr, write_lm
from hpcpax.errors import ConfigError, HpcpaxError

__all__ = ["main", "build_parser"]


def _names(text):
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_split(parser, what):
    parser.add_argument("--eval-output", metavar="EVAL.h5", default=None,
                        help=f"write the last --eval-fraction of the {what} to this file "
                             "instead (a held-out set: --eval-data of python -m hpcpax.train)")
    parser.add_argument("--eval-fraction", type=float, default=None, metavar="F",
                        help="held-out share with --eval-output, in (0, 1); default 0.1")


_TEXT_HELP = (
    "Tokenize UTF-8 text files (read in order, as one stream) into an hpcpax-lm/1 file. "
    "Tokenization: --tokenizer whitespace (the default) splits on runs of whitespace "
    "(str.split()), so punctuation stays attached to words ('end.' and 'end' differ); "
    "--tokenizer words makes runs of letters and digits the words (an inner apostrophe or "
    "hyphen keeps a word whole: don't, well-known) and every other symbol a token of its "
    "own ('end.' -> 'end', '.'). --lowercase lower-cases the text first. There are no "
    "sentence or document markers. The vocabulary is '<unk>' (id 0) then the N-1 most "
    "frequent words of the training part, ties by code-point order; other words become "
    "'<unk>'. For natural text use: --tokenizer words --lowercase.")


def build_parser():
    """The argument parser of ``python -m hpcpax.data`` (text, csv, synth, check)."""
    parser = argparse.ArgumentParser(prog="python -m hpcpax.data",
                                     description="Make and check hpcpax HDF5 data files.")
    commands = parser.add_subparsers(dest="command", required=True)

    text = commands.add_parser("text", help="UTF-8 text files -> hpcpax-lm/1",
                               description=_TEXT_HELP)
    text.add_argument("files", nargs="+", metavar="FILE")
    text.add_argument("-o", "--output", required=True)
    text.add_argument("--vocab-size", type=int, required=True,
                      help="ids including '<unk>' = 0: the N-1 most frequent words are kept")
    text.add_argument("--tokenizer", choices=sorted(TOKENIZERS), default="whitespace",
                      help="; ".join(f"{name}: {what}" for name, what in TOKENIZERS.items())
                      + " (default whitespace)")
    text.add_argument("--lowercase", action="store_true", help="lower-case the text first")
    _add_split(text, "tokens")

    table = commands.add_parser("csv", help="CSV with a header row -> hpcpax-ctr/1")
    table.add_argument("file", metavar="FILE")
    table.add_argument("-o", "--output", required=True)
    table.add_argument("--label", required=True, help="label column (values in [0, 1])")
    table.add_argument("--categorical", type=_names, required=True,
                       help="comma-separated categorical columns (hashed)")
    table.add_argument("--dense", type=_names, default=[],
                       help="comma-separated dense columns (empty cells -> 0)")
    table.add_argument("--hash-buckets", type=int, default=DEFAULT_HASH_BUCKETS)
    _add_split(table, "rows")

    synth = commands.add_parser("synth", help="deterministic synthetic data")
    synth.add_argument("kind", choices=["lm", "ctr"])
    synth.add_argument("-o", "--output", required=True)
    synth.add_argument("--samples", type=int, default=None,
                       help="lm: tokens in the stream (default 1000000); "
                            "ctr: rows (default 100000)")
    synth.add_argument("--vocab-size", type=int, default=1000, help="lm only")
    synth.add_argument("--fields", type=int, default=26, help="ctr only: categorical fields")
    synth.add_argument("--dense", type=int, default=13, help="ctr only: dense features")
    synth.add_argument("--cardinality", type=int, default=1000, help="ctr only: ids per field")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--zipf", type=float, default=1.1)
    _add_split(synth, "samples")

    check = commands.add_parser("check", help="validate a file (scans every value)")
    check.add_argument("file", metavar="FILE")
    check.add_argument("--kind", choices=["lm", "ctr"], default=None)
    check.add_argument("--context", type=int, default=1, help="lm only")
    check.add_argument("--vocab-size", type=int, default=None, help="lm: model vocabulary")
    check.add_argument("--table-rows", type=int, default=None, help="ctr: rows per table")

    unigram = commands.add_parser(
        "unigram", help="unigram baseline: perplexity of EVAL's tokens under TRAIN's "
                        "(add-one smoothed) word frequencies")
    unigram.add_argument("train", metavar="TRAIN.h5")
    unigram.add_argument("held_out", metavar="EVAL.h5")
    unigram.add_argument("--context", type=int, default=4,
                         help="the lm's context: EVAL's first K tokens are no target")
    return parser


def _run_unigram(args):
    from hpcpax.data.baseline import unigram_perplexity

    result = unigram_perplexity(args.train, args.held_out, args.context)
    return (f"{args.held_out}: unigram perplexity {result['perplexity']:.2f} (cross entropy "
            f"{result['cross_entropy']:.4f} nats) over {result['targets']} targets, "
            f"frequencies from {args.train}")


def _split_fraction(args):
    """The held-out fraction the flags ask for (0.0 without --eval-output)."""
    if args.eval_output is None:
        if args.eval_fraction is not None:
            raise ConfigError("--eval-fraction needs --eval-output (the held-out file)")
        return 0.0
    fraction = 0.1 if args.eval_fraction is None else args.eval_fraction
    if not 0 < fraction < 1:
        raise ConfigError(f"--eval-fraction must be in (0, 1), not {fraction}")
    return fraction


def _run_text(args):
    summary = text_to_h5(args.files, args.output, args.vocab_size, args.lowercase,
                         args.tokenizer, args.eval_output, _split_fraction(args))
    line = (f"{args.output}: {FORMAT_LM}, {summary['tokens']} tokens, vocab_size "
            f"{summary['vocab_size']} ({summary['unknown']} tokens <unk>), "
            f"{summary['bytes']} bytes")
    if "eval_tokens" in summary:
        line += (f"; held out {args.eval_output}: {summary['eval_tokens']} tokens "
                 f"({summary['eval_unknown']} <unk>), {summary['eval_bytes']} bytes")
    return line


def _run_csv(args):
    summary = csv_to_h5(args.file, args.output, args.label, args.categorical, args.dense,
                        args.hash_buckets, args.eval_output, _split_fraction(args))
    line = (f"{args.output}: {FORMAT_CTR}, {summary['samples']} samples, "
            f"{summary['n_fields']} fields x {args.hash_buckets} buckets, "
            f"{summary['n_dense']} dense, {summary['bytes']} bytes")
    if "eval_samples" in summary:
        line += (f"; held out {args.eval_output}: {summary['eval_samples']} samples, "
                 f"{summary['eval_bytes']} bytes")
    return line


def _held_out(args, samples):
    """Rows ``[0, n)`` train and ``[n, samples)`` held out, checked."""
    held = int(round(samples * _split_fraction(args)))
    if args.eval_output is not None and not 0 < held < samples:
        raise ConfigError(f"--eval-fraction {args.eval_fraction} of {samples} samples leaves "
                          f"a part empty")
    return samples - held


def _run_synth(args):
    for flag in ("samples", "vocab_size", "fields", "cardinality"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, not {value}")
    if args.seed < 0 or args.dense < 0:
        raise ConfigError("--seed and --dense must be >= 0")
    provenance = {"source": "hpcpax.data synth", "seed": args.seed, "zipf": args.zipf}
    if args.kind == "lm":
        if args.vocab_size < 2:
            raise ConfigError(f"--vocab-size must be >= 2, not {args.vocab_size}")
        samples = args.samples or 1_000_000
        tokens = generate_lm(samples, args.vocab_size, seed=args.seed, zipf=args.zipf)
        cut = _held_out(args, samples)
        vocab = lm_vocab(args.vocab_size)
        size = write_lm(args.output, tokens[:cut], vocab, provenance)
        line = (f"{args.output}: {FORMAT_LM}, {cut} tokens, vocab_size "
                f"{args.vocab_size}, {size} bytes")
        if cut < samples:
            size = write_lm(args.eval_output, tokens[cut:], vocab, provenance)
            line += f"; held out {args.eval_output}: {samples - cut} tokens, {size} bytes"
        return line
    samples = args.samples or 100_000
    label, dense, categorical, cardinality = generate_ctr(
        samples, args.dense, args.fields, args.cardinality, seed=args.seed, zipf=args.zipf)
    cut = _held_out(args, samples)
    size = write_ctr(args.output, label[:cut], dense[:cut], categorical[:cut], cardinality,
                     provenance)
    line = (f"{args.output}: {FORMAT_CTR}, {cut} samples, {args.fields} fields x "
            f"{args.cardinality} ids, {args.dense} dense, {size} bytes")
    if cut < samples:
        size = write_ctr(args.eval_output, label[cut:], dense[cut:], categorical[cut:],
                         cardinality, provenance)
        line += f"; held out {args.eval_output}: {samples - cut} samples, {size} bytes"
    return line


def _run_check(args):
    kind = args.kind
    if kind is None:
        with open_h5(args.file) as h5file:
            kind = read_format(h5file, args.file)
    options = {"context": args.context} if kind == "lm" else {}
    with open_dataset(args.file, kind, **options) as reader:
        if kind == "lm":
            summary = reader.validate(vocab_size=args.vocab_size)
        else:
            summary = reader.validate(table_rows=args.table_rows)
    details = ", ".join(f"{key} {value}" for key, value in summary.items() if key != "kind")
    return f"{args.file}: ok, {kind}, {details}"


_COMMANDS = {"text": _run_text, "csv": _run_csv, "synth": _run_synth, "check": _run_check,
             "unigram": _run_unigram}


def main(argv=None):
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        print(_COMMANDS[args.command](args))
    except (HpcpaxError, ValueError) as exc:  # data and argument problems: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
