"""Built-in models: hand-written forward and backward in NumPy or CuPy.

A model holds only dense weights; the training loop pulls the embedding
rows a batch needs from the parameter servers and passes them in. See
:mod:`hpcpax.models.base` for the interface. Importing this package imports
no CuPy.
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import EvalOutputs, Model, SparseSpec, StepResult
from .ctr import CTRModel
from .lm import LanguageModel, log_uniform_log_expected_count, log_uniform_sample
from .metrics import perplexity, roc_auc

__all__ = [
    "Model",
    "SparseSpec",
    "StepResult",
    "EvalOutputs",
    "LanguageModel",
    "CTRModel",
    "MODELS",
    "build_model",
    "roc_auc",
    "perplexity",
    "log_uniform_sample",
    "log_uniform_log_expected_count",
]

MODELS = {"lm": LanguageModel, "ctr": CTRModel}


def build_model(name: str, **flags) -> Model:
    """Build the model registered as ``name`` (``"lm"`` or ``"ctr"``) from its flags.

    Raises:
        ConfigError: unknown name or unknown flag.
    """
    if name not in MODELS:
        raise ConfigError(f"model must be one of {sorted(MODELS)}, not {name!r}")
    model_class = MODELS[name]
    try:
        return model_class(**flags)
    except TypeError as error:
        if "unexpected keyword" in str(error):
            raise ConfigError(f"model {name!r}: {error}") from None
        raise
