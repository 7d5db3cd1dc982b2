"""A 784-128-64-10 multi-layer perceptron in numpy: ReLU, softmax + cross-entropy, SGD.

All parameters live in one flat float32 array (`params`) and all gradients in another
(`grads`); the per-layer weights and biases are views into them. So a data-parallel step
needs exactly one all_reduce, over `grads`, and no packing or unpacking.
"""

from __future__ import annotations

import itertools

import numpy as np

LAYER_SIZES = (784, 128, 64, 10)


class MLP:
    """Fully connected layers with ReLU between them; the last layer's output is logits."""

    def __init__(self, sizes: tuple[int, ...] = LAYER_SIZES, *, seed: int = 0) -> None:
        shapes = list(itertools.pairwise(sizes))
        count = sum(fan_in * fan_out + fan_out for fan_in, fan_out in shapes)
        self.sizes = sizes
        self.params = np.zeros(count, np.float32)
        self.grads = np.zeros(count, np.float32)
        self.weights, self.biases = _layer_views(self.params, shapes)
        self.weight_grads, self.bias_grads = _layer_views(self.grads, shapes)
        rng = np.random.default_rng(seed)
        for w in self.weights:  # He initialisation; biases start at zero
            scale = np.float32(np.sqrt(2.0 / w.shape[0]))
            w[...] = rng.standard_normal(w.shape, dtype=np.float32) * scale

    def forward(self, x: np.ndarray) -> list[np.ndarray]:
        """The activations of every layer: [x, hidden..., logits]."""
        activations = [x]
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            z = activations[-1] @ w + b
            if i < len(self.weights) - 1:
                np.maximum(z, 0, out=z)  # ReLU
            activations.append(z)
        return activations

    def loss_and_grad(self, x: np.ndarray, labels: np.ndarray, normalizer: int) -> float:
        """Set `grads` to the gradient of sum(cross-entropy over x) / normalizer; return
        that sum (float64). With normalizer = the global batch size, the gradients of the
        shards of a batch add up to the gradient of the whole batch's mean loss."""
        activations = self.forward(x)
        log_p = _log_softmax(activations[-1])
        rows = np.arange(len(labels))
        loss_sum = -float(log_p[rows, labels].sum(dtype=np.float64))
        delta = np.exp(log_p)  # d(loss)/d(logits) = softmax - one_hot
        delta[rows, labels] -= 1
        delta *= np.float32(1.0 / normalizer)
        for i in reversed(range(len(self.weights))):
            np.matmul(activations[i].T, delta, out=self.weight_grads[i])
            delta.sum(axis=0, out=self.bias_grads[i])
            if i > 0:
                delta = delta @ self.weights[i].T
                delta *= activations[i] > 0  # ReLU' (activations[i] is post-ReLU)
        return loss_sum

    def sgd_step(self, lr: float) -> None:
        """params -= lr * grads, in place (the layer views follow)."""
        self.params -= np.float32(lr) * self.grads

    def evaluate(self, x: np.ndarray, labels: np.ndarray) -> tuple[float, int]:
        """(sum of cross-entropy losses, number of correct predictions) over x."""
        logits = self.forward(x)[-1]
        log_p = _log_softmax(logits)
        loss_sum = -float(log_p[np.arange(len(labels)), labels].sum(dtype=np.float64))
        return loss_sum, int((logits.argmax(axis=1) == labels).sum())


def _layer_views(
    flat: np.ndarray, shapes: list[tuple[int, int]]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    weights, biases, offset = [], [], 0
    for fan_in, fan_out in shapes:
        weights.append(flat[offset : offset + fan_in * fan_out].reshape(fan_in, fan_out))
        offset += fan_in * fan_out
        biases.append(flat[offset : offset + fan_out])
        offset += fan_out
    return weights, biases


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
