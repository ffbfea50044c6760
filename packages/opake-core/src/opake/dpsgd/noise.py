"""Gaussian noise for DP-SGD, added once per logical step in fp32 (or wider).

:class:`GaussianNoise` holds σ and an explicit random source: a seeded ``torch.Generator``
(reproducible, its exact position saved by :meth:`GaussianNoise.state_dict`) or, with
``secure=True``, a generator freshly seeded from OS entropy on every call. :func:`add_noise` is
the one-shot functional form. Both take the sensitivity from ``grads.max_norm`` (what
``opake.dpsgd.clipping.clipped_grad`` returns) or from an explicit ``sensitivity=``, and return
a :class:`NoisyGrads` dict that reports the standard deviation actually used.

Example:
    >>> import torch
    >>> from opake.dpsgd.noise import GaussianNoise
    >>> noise = GaussianNoise(noise_multiplier=1.1, seed=7)
    >>> noisy = noise.add({"w": torch.zeros(4, dtype=torch.bfloat16)}, sensitivity=1.0)
    >>> noisy["w"].dtype, noisy.noise_std
    (torch.float32, 1.1)
"""

from __future__ import annotations

from opake.dpsgd._noise import GaussianNoise, NoisyGrads, add_noise

__all__ = ["GaussianNoise", "NoisyGrads", "add_noise"]
