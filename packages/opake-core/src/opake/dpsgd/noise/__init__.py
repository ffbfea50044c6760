"""Gaussian noise for DP-SGD, added once per logical step in fp32 (or wider).

:class:`GaussianNoise` holds σ and an explicit random source
(:class:`~opake.dpsgd.randomness.Randomness`): by default a ChaCha20 keystream under a 256-bit
key from the operating system, never stored (secure); with ``seed=`` a key derived from the
seed (reproducible bit for bit, resumable from :meth:`GaussianNoise.state_dict`, and **not
private**). :func:`add_noise` is the one-shot functional form. Both take the sensitivity from
``grads.max_norm`` (what ``opake.dpsgd.clipping.clipped_grad`` returns) or from an explicit
``sensitivity=``, and return a :class:`NoisyGrads` dict that reports the standard deviation
actually used. The noise is drawn in fp64 and each noised value is rounded once onto the
lattice :func:`noise_grid` (a power of two fixed by σ·S alone), so the values a result can take
do not depend on the gradients (``docs/guide/privacy-noise.md``).

Example:
    >>> import torch
    >>> from opake.dpsgd.noise import GaussianNoise
    >>> noise = GaussianNoise(noise_multiplier=1.1)          # secure: the default
    >>> noisy = noise.add({"w": torch.zeros(4, dtype=torch.bfloat16)}, sensitivity=1.0)
    >>> noisy["w"].dtype, noisy.noise_std, noisy.secure
    (torch.float32, 1.1, True)
"""

from __future__ import annotations

from opake.dpsgd.noise._gaussian import GaussianNoise, NoisyGrads, add_noise, noise_grid
from opake.dpsgd.randomness import Randomness

__all__ = ["GaussianNoise", "NoisyGrads", "Randomness", "add_noise", "noise_grid"]
