"""Dense layers with hand-written backward passes, in ``xp`` (NumPy or CuPy).

A multi-layer perceptron is a list of layer names; layer ``n`` owns the dense
parameters ``n + "_weight"`` ``[fan_in, fan_out]`` and ``n + "_bias"``
``[fan_out]``. Nothing here is collective.
"""

from __future__ import annotations

from ..errors import ConfigError

__all__ = [
    "ACTIVATIONS",
    "check_activation",
    "mlp_shapes",
    "mlp_forward",
    "mlp_backward",
    "softplus",
    "sigmoid",
    "logsumexp",
]

ACTIVATIONS = ("relu", "tanh", "linear")


def check_activation(activation: str, flag: str = "activation") -> str:
    """``activation`` if it is one of ``ACTIVATIONS``, else ConfigError naming ``flag``."""
    if activation not in ACTIVATIONS:
        raise ConfigError(f"{flag} must be one of {ACTIVATIONS}, not {activation!r}")
    return activation


def mlp_shapes(layer_names, fan_in: int, widths) -> dict[str, tuple[int, ...]]:
    """Shapes of the weights and biases of a chain of dense layers."""
    shapes = {}
    for layer_name, width in zip(layer_names, widths):
        shapes[layer_name + "_weight"] = (fan_in, width)
        shapes[layer_name + "_bias"] = (width,)
        fan_in = width
    return shapes


def _activate(xp, pre, activation):
    if activation == "relu":
        return xp.maximum(pre, 0)
    if activation == "tanh":
        return xp.tanh(pre)
    return pre


def _activate_backward(grad_out, pre, out, activation):
    if activation == "relu":
        return grad_out * (pre > 0)
    if activation == "tanh":
        return grad_out * (1 - out * out)
    return grad_out


def mlp_forward(xp, dense, layer_names, activations, inputs):
    """Run ``inputs [B, fan_in]`` through the layers.

    Returns:
        ``(outputs, cache)``; pass ``cache`` to :func:`mlp_backward`.
    """
    cache = []
    hidden = inputs
    for layer_name, activation in zip(layer_names, activations):
        pre = hidden @ dense[layer_name + "_weight"] + dense[layer_name + "_bias"]
        out = _activate(xp, pre, activation)
        cache.append((hidden, pre, out))
        hidden = out
    return hidden, cache


def mlp_backward(dense, layer_names, activations, cache, grad_outputs, grads, *, need_input_grad=True):
    """Backward of :func:`mlp_forward`; writes weight/bias grads into ``grads``.

    Returns:
        the gradient with respect to the inputs, or None when not needed.
    """
    grad = grad_outputs
    for index in range(len(layer_names) - 1, -1, -1):
        layer_name = layer_names[index]
        hidden, pre, out = cache[index]
        grad_pre = _activate_backward(grad, pre, out, activations[index])
        grads[layer_name + "_weight"] = hidden.T @ grad_pre
        grads[layer_name + "_bias"] = grad_pre.sum(axis=0)
        if index > 0 or need_input_grad:
            grad = grad_pre @ dense[layer_name + "_weight"].T
        else:
            grad = None
    return grad


def softplus(xp, z):
    """``log(1 + exp(z))`` without overflow for large ``|z|``."""
    return xp.maximum(z, 0) + xp.log1p(xp.exp(-xp.abs(z)))


def sigmoid(xp, z):
    """Logistic function, stable for large ``|z|`` (never exponentiates a positive)."""
    decay = xp.exp(-xp.abs(z))
    return xp.where(z >= 0, 1 / (1 + decay), decay / (1 + decay))


def logsumexp(xp, logits, axis=-1):
    """``log(sum(exp(logits)))`` along ``axis``, shifted by the max for stability."""
    peak = logits.max(axis=axis, keepdims=True)
    return (peak + xp.log(xp.exp(logits - peak).sum(axis=axis, keepdims=True))).squeeze(axis)
