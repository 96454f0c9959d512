"""``lm``: an LM-1B-like word language model with sampled softmax.

The k previous tokens look up rows of the sparse input table ``embedding``
(vocab x emb_dim); the rows are concatenated and pass through dense hidden
layers and a linear projection to ``out_dim``. The output layer is the
sparse table ``softmax_w`` (vocab x out_dim) and the sparse bias
``softmax_b`` (vocab x 1). Training uses sampled softmax: per step,
``num_sampled`` negatives are drawn (with replacement) from the log-uniform
(Zipf) distribution ``P(c) = log((c + 2) / (c + 1)) / log(vocab + 1)``, by
a Philox generator keyed by (seed, step) alone, so any sharding of the batch
over any number of ranks sees the same negatives. Logits get the usual logQ
correction (minus the log expected count ``num_sampled * P(c)``), and
negatives that equal an example's target are masked out.

Token ids are assumed to be ordered by frequency (id 0 most frequent), as the
log-uniform sampler presumes.

Batch: ``{"context": int64 [B, k], "target": int64 [B]}``.
"""

from __future__ import annotations

import numpy as np

from ..backend import array_module, to_host
from ..errors import ConfigError
from .base import (
    MAX_CONTEXT,
    MAX_SAMPLED,
    MAX_WIDTH,
    STREAM_EXAMPLE,
    STREAM_SAMPLER,
    EvalOutputs,
    Model,
    SparseSpec,
    StepResult,
    check_positive_int,
    counter_generator,
    gather_rows,
    parse_sizes,
)
from .layers import check_activation, logsumexp, mlp_backward, mlp_forward, mlp_shapes
from .metrics import perplexity

__all__ = ["LanguageModel", "log_uniform_sample", "log_uniform_log_expected_count"]

# Finite, so masked logits never make inf - inf; exp() of it is exactly zero.
_MASKED_LOGIT = -1e30


def log_uniform_sample(seed: int, step: int, num_sampled: int, vocab_size: int) -> np.ndarray:
    """``num_sampled`` int64 ids in ``[0, vocab_size)`` drawn log-uniformly, with replacement.

    Depends only on its arguments (counter-based Philox keyed by seed and
    step), so every rank draws the same negatives for a step. Host NumPy.
    """
    rng = counter_generator(seed, step, STREAM_SAMPLER)
    uniform = rng.random(num_sampled)
    # Inverse CDF: exp(u * log(V + 1)) - 1 lies in [0, V); floor gives the id.
    ids = np.floor(np.exp(uniform * np.log(vocab_size + 1.0))).astype(np.int64) - 1
    return np.clip(ids, 0, vocab_size - 1)


def log_uniform_log_expected_count(xp, ids, num_sampled: int, vocab_size: int, dtype):
    """``log(num_sampled * P(id))`` under the log-uniform sampler, in ``xp``."""
    ids = ids.astype(np.float64)
    # Host scalars as Python floats, so they broadcast onto CuPy arrays too.
    log_normalizer = float(np.log(np.log(vocab_size + 1.0)))
    log_probability = xp.log(xp.log1p(1.0 / (ids + 1.0))) - log_normalizer
    return (float(np.log(num_sampled)) + log_probability).astype(dtype)


class LanguageModel(Model):
    """Embedding -> dense MLP -> projection -> (sampled) softmax.

    Args:
        vocab_size: rows of the three sparse tables.
        context: k, the number of previous tokens per example.
        emb_dim: width of an input embedding row.
        hidden: hidden layer widths (int, sequence, or ``"64,64"``).
        out_dim: width of the projection and of a ``softmax_w`` row.
        num_sampled: negatives per step for the sampled softmax.
        activation: ``"relu"`` or ``"tanh"`` for the hidden layers.
        remove_accidental_hits: mask negatives equal to an example's target.
        seed, dtype: see :class:`~hpcpax.models.base.Model`.

    Sparse tables: ``embedding`` [vocab, emb_dim], ``softmax_w`` [vocab,
    out_dim], ``softmax_b`` [vocab, 1]. Dense parameters: ``hidden_{i}_weight``,
    ``hidden_{i}_bias``, ``projection_weight``, ``projection_bias``.
    """

    name = "lm"

    def __init__(
        self,
        *,
        vocab_size: int = 10_000,
        context: int = 4,
        emb_dim: int = 32,
        hidden=(64,),
        out_dim: int = 32,
        num_sampled: int = 64,
        activation: str = "relu",
        remove_accidental_hits: bool = True,
        seed: int = 0,
        dtype="float32",
    ):
        super().__init__(seed=seed, dtype=dtype)
        self.vocab_size = check_positive_int(vocab_size, "vocab_size")
        self.context = check_positive_int(context, "context", MAX_CONTEXT)
        self.emb_dim = check_positive_int(emb_dim, "emb_dim", MAX_WIDTH)
        self.hidden = parse_sizes(hidden, "hidden", allow_empty=True)
        self.out_dim = check_positive_int(out_dim, "out_dim", MAX_WIDTH)
        self.num_sampled = check_positive_int(num_sampled, "num_sampled", MAX_SAMPLED)
        self.activation = check_activation(activation)
        if not isinstance(remove_accidental_hits, bool):
            raise ConfigError(
                f"remove_accidental_hits must be bool, not {type(remove_accidental_hits).__name__}"
            )
        self.remove_accidental_hits = remove_accidental_hits
        self._layer_names = [f"hidden_{i}" for i in range(len(self.hidden))] + ["projection"]
        self._activations = [self.activation] * len(self.hidden) + ["linear"]
        self._sample_cache = (None, None)
        self._device_samples = (None, None, None)  # (step, xp, the step's negatives on xp)

    def config(self) -> dict:
        """The model's constructor arguments (saved with runs and checkpoints)."""
        return {
            "vocab_size": self.vocab_size,
            "context": self.context,
            "emb_dim": self.emb_dim,
            "hidden": self.hidden,
            "out_dim": self.out_dim,
            "num_sampled": self.num_sampled,
            "activation": self.activation,
            "remove_accidental_hits": self.remove_accidental_hits,
            **super().config(),
        }

    def sparse_specs(self) -> list[SparseSpec]:
        """The input embedding and the sampled softmax's weights and biases."""
        return [
            SparseSpec("embedding", self.vocab_size, self.emb_dim, float(1 / np.sqrt(self.emb_dim))),
            SparseSpec("softmax_w", self.vocab_size, self.out_dim, float(1 / np.sqrt(self.out_dim))),
            SparseSpec("softmax_b", self.vocab_size, 1, 0.0),
        ]

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the hidden layers and the projection, in order."""
        widths = list(self.hidden) + [self.out_dim]
        return mlp_shapes(self._layer_names, self.context * self.emb_dim, widths)

    def sampled_ids(self, step: int) -> np.ndarray:
        """The step's negatives (host NumPy, int64, duplicates possible)."""
        cached_step, cached = self._sample_cache
        if cached_step != step:
            cached = log_uniform_sample(self.seed, step, self.num_sampled, self.vocab_size)
            self._sample_cache = (step, cached)
        return cached

    def _samples_on(self, xp, step: int):
        """:meth:`sampled_ids` on ``xp``'s device, uploaded once per step (sparse_ids and
        the forward pass both need them)."""
        cached_step, cached_xp, cached = self._device_samples
        if cached_step != step or cached_xp is not xp:
            cached = xp.asarray(self.sampled_ids(step))
            self._device_samples = (step, xp, cached)
        return cached

    def _check_batch(self, batch):
        for key in ("context", "target"):
            if key not in batch:
                raise ValueError(f"an lm batch must hold {key!r}, not only {sorted(batch)}")
        context = batch["context"]
        target = batch["target"]
        if context.ndim != 2 or context.shape[1] != self.context:
            raise ValueError(
                f"batch['context'] must be [B, {self.context}], not {tuple(context.shape)}"
            )
        if target.shape != (context.shape[0],):
            raise ValueError(f"batch['target'] must be [{context.shape[0]}], not {tuple(target.shape)}")
        return context.astype(np.int64, copy=False), target.astype(np.int64, copy=False)

    def sparse_ids(self, batch: dict, step: int, *, full: bool = False) -> dict:
        """Ids per table; with ``full=True`` the whole vocabulary of the output tables.

        The output tables need the targets and the step's negatives.
        """
        context, target = self._check_batch(batch)
        xp = array_module(context)
        if full:
            output_ids = xp.arange(self.vocab_size, dtype=np.int64)
        else:
            output_ids = xp.concatenate([target, self._samples_on(xp, step)])
        # Separate arrays, so a caller may deduplicate one in place without touching the other.
        return {"embedding": context.reshape(-1), "softmax_w": output_ids, "softmax_b": output_ids.copy()}

    def _hidden_output(self, dense, rows, context):
        xp = array_module(context)
        embedded = gather_rows(rows, "embedding", context, self.dtype)
        inputs = embedded.reshape(context.shape[0], self.context * self.emb_dim)
        output, cache = mlp_forward(xp, dense, self._layer_names, self._activations, inputs)
        return xp, output, cache

    def _sampled_logits(self, xp, output, rows, target, step):
        samples = self._samples_on(xp, step)
        true_weight = gather_rows(rows, "softmax_w", target, self.dtype)
        true_bias = gather_rows(rows, "softmax_b", target, self.dtype)[:, 0]
        sampled_weight = gather_rows(rows, "softmax_w", samples, self.dtype)
        sampled_bias = gather_rows(rows, "softmax_b", samples, self.dtype)[:, 0]
        log_q_true = log_uniform_log_expected_count(xp, target, self.num_sampled, self.vocab_size, self.dtype)
        log_q_sampled = log_uniform_log_expected_count(xp, samples, self.num_sampled, self.vocab_size, self.dtype)
        true_logits = (output * true_weight).sum(axis=1) + true_bias - log_q_true
        sampled_logits = output @ sampled_weight.T + (sampled_bias - log_q_sampled)
        if self.remove_accidental_hits:
            hits = samples[None, :] == target[:, None]
            # a scalar, not an array: no upload per step on a GPU
            sampled_logits = xp.where(hits, self.dtype.type(_MASKED_LOGIT), sampled_logits)
        logits = xp.concatenate([true_logits[:, None], sampled_logits], axis=1)
        return logits, samples, true_weight, sampled_weight

    def forward_backward(self, dense: dict, rows: dict, batch: dict, step: int) -> StepResult:
        """Sampled softmax cross entropy, mean over the batch, and its gradients.

        Not collective; arrays stay on the device they came on.
        """
        context, target = self._check_batch(batch)
        batch_size = context.shape[0]
        xp, output, cache = self._hidden_output(dense, rows, context)
        logits, samples, true_weight, sampled_weight = self._sampled_logits(xp, output, rows, target, step)
        log_normalizer = logsumexp(xp, logits, axis=1)
        loss = float((log_normalizer - logits[:, 0]).mean())

        # d(mean loss)/d(logits): softmax minus the one-hot of column 0, over B.
        grad_logits = xp.exp(logits - log_normalizer[:, None]) / batch_size
        grad_logits[:, 0] -= 1.0 / batch_size
        grad_true = grad_logits[:, 0]
        grad_sampled = grad_logits[:, 1:]
        grad_output = grad_true[:, None] * true_weight + grad_sampled @ sampled_weight

        dense_grads = {}
        grad_inputs = mlp_backward(
            dense, self._layer_names, self._activations, cache, grad_output, dense_grads
        )
        output_ids = xp.concatenate([target, samples])
        weight_grads = xp.concatenate([grad_true[:, None] * output, grad_sampled.T @ output])
        bias_grads = xp.concatenate([grad_true, grad_sampled.sum(axis=0)])[:, None]
        sparse_grads = {
            "embedding": (context.reshape(-1), grad_inputs.reshape(-1, self.emb_dim)),
            "softmax_w": (output_ids, weight_grads),
            "softmax_b": (output_ids.copy(), bias_grads),
        }
        dense_grads = {key: dense_grads[key] for key in self.dense_shapes()}
        return StepResult(loss, {"loss": loss}, dense_grads, sparse_grads)

    def eval_outputs(self, dense: dict, rows: dict, batch: dict, step: int, *,
                     full: bool = False) -> EvalOutputs:
        """Per-example cross entropy, forward only (host float64).

        With ``full=False`` this is the step's sampled softmax loss (an
        estimate, logQ-corrected, so its perplexity is not the true one).
        With ``full=True`` ``rows`` must hold every row of ``softmax_w`` and
        ``softmax_b`` (see ``sparse_ids(..., full=True)``) and the loss is the
        exact full-softmax cross entropy.
        """
        context, target = self._check_batch(batch)
        xp, output, _ = self._hidden_output(dense, rows, context)
        if full:
            for table in ("softmax_w", "softmax_b"):
                if rows[table][0].shape[0] != self.vocab_size:
                    raise ValueError(
                        f"full evaluation needs all {self.vocab_size} rows of {table!r}, "
                        f"not {rows[table][0].shape[0]}"
                    )
            weight = rows["softmax_w"][1].astype(self.dtype, copy=False)
            bias = rows["softmax_b"][1].astype(self.dtype, copy=False)[:, 0]
            logits = output @ weight.T + bias
            true_logits = logits[xp.arange(target.shape[0]), target]
        else:
            logits, _, _, _ = self._sampled_logits(xp, output, rows, target, step)
            true_logits = logits[:, 0]
        losses = logsumexp(xp, logits, axis=1) - true_logits
        return EvalOutputs(to_host(losses).astype(np.float64))

    def eval_metrics(self, loss_sum: float, count: int, scores=None, labels=None) -> dict:
        """Mean loss and ``perplexity = exp(mean loss)`` of the whole set."""
        loss = float(loss_sum) / count
        return {"loss": loss, "perplexity": perplexity(loss)}

    def example_batch(self, batch_size: int, *, seed: int = 0) -> dict:
        """Log-uniform context tokens; the target is the last token plus one (learnable)."""
        batch_size = check_positive_int(batch_size, "batch_size")
        rng = counter_generator(seed, 0, STREAM_EXAMPLE)
        uniform = rng.random((batch_size, self.context))
        context = np.floor(np.exp(uniform * np.log(self.vocab_size + 1.0))).astype(np.int64) - 1
        context = np.clip(context, 0, self.vocab_size - 1)
        return {"context": context, "target": (context[:, -1] + 1) % self.vocab_size}
