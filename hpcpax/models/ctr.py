"""``ctr``: a DLRM-style click-through-rate model.

Dense features pass through a bottom MLP (ReLU on every layer) to
``emb_dim``. Each categorical field ``i`` looks up its own sparse table
``emb_{i}``. The feature interaction takes the pairwise dot products among
``[bottom_out, emb_0, ..., emb_{n-1}]`` (strict upper triangle) and
concatenates them with ``bottom_out``; a top MLP (ReLU) and a final linear
layer give one logit, trained with the logistic loss.

Hashing: raw categorical ids may be any int64; the model maps field ``i`` id
``x`` to row ``x % table_rows[i]`` (NumPy's modulo, so negative ids land in
range too). :meth:`CTRModel.sparse_ids` returns these hashed row ids, and
the forward pass hashes the same way, so data files need no preprocessing.

Batch: ``{"dense": float [B, n_dense], "categorical": int64 [B, n_fields],
"label": float [B] in {0, 1}}``.
"""

from __future__ import annotations

import numpy as np

from ..backend import array_module, to_host
from ..errors import ConfigError
from .base import (
    MAX_FIELDS,
    MAX_ROWS,
    MAX_WIDTH,
    STREAM_EXAMPLE,
    EvalOutputs,
    Model,
    SparseSpec,
    StepResult,
    check_positive_int,
    counter_generator,
    gather_rows,
    parse_sizes,
)
from .layers import mlp_backward, mlp_forward, mlp_shapes, sigmoid, softplus
from .metrics import roc_auc

__all__ = ["CTRModel"]


class CTRModel(Model):
    """Bottom MLP + embeddings -> dot interaction -> top MLP -> logistic loss.

    Args:
        n_dense: dense features per example.
        n_fields: categorical fields, one sparse table each.
        table_rows: rows per table, an int for all or one per field.
        emb_dim: width of an embedding row; the bottom MLP ends at it.
        bottom: bottom MLP widths; the last must equal ``emb_dim``.
        top: top MLP widths before the final 1-wide linear layer.
        seed, dtype: see :class:`~hpcpax.models.base.Model`.

    Sparse tables: ``emb_{i}`` [table_rows[i], emb_dim]. Dense parameters:
    ``bottom_{i}_*``, ``top_{i}_*``, ``output_weight``, ``output_bias``.
    """

    name = "ctr"

    def __init__(
        self,
        *,
        n_dense: int = 8,
        n_fields: int = 6,
        table_rows=10_000,
        emb_dim: int = 16,
        bottom=(32, 16),
        top=(32,),
        seed: int = 0,
        dtype="float32",
    ):
        super().__init__(seed=seed, dtype=dtype)
        self.n_dense = check_positive_int(n_dense, "n_dense", MAX_WIDTH)
        self.n_fields = check_positive_int(n_fields, "n_fields", MAX_FIELDS)
        table_rows = parse_sizes(table_rows, "table_rows", maximum=MAX_ROWS, max_count=MAX_FIELDS)
        if len(table_rows) == 1:
            table_rows = table_rows * self.n_fields
        if len(table_rows) != self.n_fields:
            raise ConfigError(
                f"table_rows must be one int or {self.n_fields} ints (n_fields), not {len(table_rows)}"
            )
        self.table_rows = table_rows
        self.emb_dim = check_positive_int(emb_dim, "emb_dim", MAX_WIDTH)
        self.bottom = parse_sizes(bottom, "bottom")
        if self.bottom[-1] != self.emb_dim:
            raise ConfigError(
                f"the last bottom width must equal emb_dim={self.emb_dim}, not {self.bottom[-1]}"
            )
        self.top = parse_sizes(top, "top", allow_empty=True)
        self._bottom_names = [f"bottom_{i}" for i in range(len(self.bottom))]
        self._bottom_activations = ["relu"] * len(self.bottom)
        self._top_names = [f"top_{i}" for i in range(len(self.top))] + ["output"]
        self._top_activations = ["relu"] * len(self.top) + ["linear"]
        self._upper_rows, self._upper_cols = np.triu_indices(self.n_fields + 1, k=1)
        self._upper_on = (None, None)  # (xp, the index arrays on xp): uploaded once

    def config(self) -> dict:
        """The model's constructor arguments (saved with runs and checkpoints)."""
        return {
            "n_dense": self.n_dense,
            "n_fields": self.n_fields,
            "table_rows": self.table_rows,
            "emb_dim": self.emb_dim,
            "bottom": self.bottom,
            "top": self.top,
            **super().config(),
        }

    @property
    def interaction_dim(self) -> int:
        """Width of the top MLP's input: bottom output plus the pair dot products."""
        return self.emb_dim + len(self._upper_rows)

    def sparse_specs(self) -> list[SparseSpec]:
        """One embedding table per categorical field."""
        scale = float(1 / np.sqrt(self.emb_dim))
        return [SparseSpec(f"emb_{i}", rows, self.emb_dim, scale) for i, rows in enumerate(self.table_rows)]

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the bottom and top MLPs' weights and biases, in order."""
        shapes = mlp_shapes(self._bottom_names, self.n_dense, self.bottom)
        shapes.update(mlp_shapes(self._top_names, self.interaction_dim, list(self.top) + [1]))
        return shapes

    def _check_batch(self, batch, *, need_label=True):
        keys = ("dense", "categorical", "label") if need_label else ("dense", "categorical")
        for key in keys:
            if key not in batch:
                raise ValueError(f"a ctr batch must hold {key!r}, not only {sorted(batch)}")
        categorical = batch["categorical"]
        if categorical.ndim != 2 or categorical.shape[1] != self.n_fields:
            raise ValueError(
                f"batch['categorical'] must be [B, {self.n_fields}], not {tuple(categorical.shape)}"
            )
        batch_size = categorical.shape[0]
        features = batch["dense"]
        if features.shape != (batch_size, self.n_dense):
            raise ValueError(
                f"batch['dense'] must be [{batch_size}, {self.n_dense}], not {tuple(features.shape)}"
            )
        label = batch.get("label")
        if need_label and label.shape != (batch_size,):
            raise ValueError(f"batch['label'] must be [{batch_size}], not {tuple(label.shape)}")
        return features.astype(self.dtype, copy=False), categorical.astype(np.int64, copy=False), label

    def hashed_ids(self, categorical, field: int):
        """Row ids of field ``field``: raw id modulo that table's rows."""
        return categorical[:, field] % self.table_rows[field]

    def sparse_ids(self, batch: dict, step: int, *, full: bool = False) -> dict:
        """Hashed row ids per table (``full`` is accepted and ignored)."""
        _, categorical, _ = self._check_batch(batch, need_label=False)
        return {f"emb_{i}": self.hashed_ids(categorical, i) for i in range(self.n_fields)}

    def _upper_indices(self, xp):
        """Strict upper-triangle (row, col) index arrays of the Gram matrix, in ``xp``."""
        cached_xp, cached = self._upper_on
        if cached_xp is not xp:
            cached = (xp.asarray(self._upper_rows), xp.asarray(self._upper_cols))
            self._upper_on = (xp, cached)
        return cached

    def _forward(self, dense, rows, features, categorical):
        xp = array_module(features)
        bottom_out, bottom_cache = mlp_forward(
            xp, dense, self._bottom_names, self._bottom_activations, features
        )
        embedded = [
            gather_rows(rows, f"emb_{i}", self.hashed_ids(categorical, i), self.dtype)
            for i in range(self.n_fields)
        ]
        stacked = xp.stack([bottom_out] + embedded, axis=1)  # [B, F + 1, E]
        gram = stacked @ stacked.transpose(0, 2, 1)
        upper_rows, upper_cols = self._upper_indices(xp)
        pairs = gram[:, upper_rows, upper_cols]
        top_in = xp.concatenate([bottom_out, pairs], axis=1)
        logits, top_cache = mlp_forward(xp, dense, self._top_names, self._top_activations, top_in)
        return xp, logits[:, 0], (bottom_cache, stacked, top_cache)

    def _loss(self, xp, logits, label):
        label = label.astype(self.dtype, copy=False)
        return label, float((softplus(xp, logits) - label * logits).mean())

    def forward_backward(self, dense: dict, rows: dict, batch: dict, step: int) -> StepResult:
        """Mean logistic loss over the batch and its gradients. Not collective."""
        features, categorical, label = self._check_batch(batch)
        xp, logits, (bottom_cache, stacked, top_cache) = self._forward(dense, rows, features, categorical)
        label, loss = self._loss(xp, logits, label)
        batch_size = logits.shape[0]

        dense_grads = {}
        grad_logits = ((sigmoid(xp, logits) - label) / batch_size)[:, None]
        grad_top_in = mlp_backward(
            dense, self._top_names, self._top_activations, top_cache, grad_logits, dense_grads
        )
        # gram[i, j] = z_i . z_j, so dz_i = sum_j (dG + dG^T)[i, j] z_j.
        grad_gram = xp.zeros((batch_size, self.n_fields + 1, self.n_fields + 1), dtype=self.dtype)
        upper_rows, upper_cols = self._upper_indices(xp)
        grad_gram[:, upper_rows, upper_cols] = grad_top_in[:, self.emb_dim:]
        grad_stacked = (grad_gram + grad_gram.transpose(0, 2, 1)) @ stacked
        grad_bottom_out = grad_top_in[:, : self.emb_dim] + grad_stacked[:, 0]
        mlp_backward(
            dense, self._bottom_names, self._bottom_activations, bottom_cache,
            grad_bottom_out, dense_grads, need_input_grad=False,
        )
        sparse_grads = {
            f"emb_{i}": (self.hashed_ids(categorical, i), grad_stacked[:, i + 1])
            for i in range(self.n_fields)
        }
        dense_grads = {key: dense_grads[key] for key in self.dense_shapes()}
        return StepResult(loss, {"loss": loss}, dense_grads, sparse_grads)

    def predict(self, dense: dict, rows: dict, batch: dict):
        """Logits ``[B]`` on the batch's device (forward only; no label needed)."""
        features, categorical, _ = self._check_batch(batch, need_label=False)
        return self._forward(dense, rows, features, categorical)[1]

    def eval_outputs(self, dense: dict, rows: dict, batch: dict, step: int, *,
                     full: bool = False) -> EvalOutputs:
        """Per-example logistic loss, logits as scores and the labels (host
        float64); ``full`` is accepted and ignored."""
        features, categorical, label = self._check_batch(batch)
        xp, logits, _ = self._forward(dense, rows, features, categorical)
        label = label.astype(self.dtype, copy=False)
        losses = softplus(xp, logits) - label * logits
        return EvalOutputs(to_host(losses).astype(np.float64),
                           to_host(logits).astype(np.float64), to_host(label).astype(np.float64))

    def eval_metrics(self, loss_sum: float, count: int, scores=None, labels=None) -> dict:
        """Mean logistic loss and the rank AUC of *all* the scores (NaN with one class)."""
        return {"loss": float(loss_sum) / count, "auc": roc_auc(labels, scores)}

    def example_batch(self, batch_size: int, *, seed: int = 0) -> dict:
        """Random features and ids; the label follows a fixed linear rule (learnable)."""
        batch_size = check_positive_int(batch_size, "batch_size")
        rng = counter_generator(seed, 0, STREAM_EXAMPLE)
        features = rng.standard_normal((batch_size, self.n_dense)).astype(self.dtype)
        categorical = rng.integers(0, 4 * max(self.table_rows), size=(batch_size, self.n_fields))
        score = features[:, 0] - features[:, -1] + ((categorical[:, 0] % 3) == 0) - 0.3
        return {
            "dense": features,
            "categorical": categorical.astype(np.int64),
            "label": (score > 0).astype(self.dtype),
        }
