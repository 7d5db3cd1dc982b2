"""MNIST for the dsml examples: a checked IDX loader (`data`) and a numpy MLP (`mlp`).

Used by `examples/mnist_data_parallel.py`, `benchmarks/train_mnist.py` and the tests.
"""
