"""Adapters from deep-learning frameworks' models to :class:`zmqps.Worker`.

Each adapter imports its framework lazily (only when used), so ``import zmqps`` never
needs one installed. :mod:`zmqps.adapters.torch`: PyTorch ``nn.Module``.
"""
