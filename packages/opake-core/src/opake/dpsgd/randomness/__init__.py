"""The random source of DP noise and sampling: a keyed ChaCha20 stream, secure by default.

:class:`Randomness` is what :class:`~opake.dpsgd.noise.GaussianNoise` and the samplers of
:mod:`opake.dpsgd.sampling` draw from. :meth:`Randomness.secure` (their default) keys it with
256 bits from the operating system, which are never stored; :meth:`Randomness.seeded` derives
the key from an integer seed — reproducible bit for bit, and **not private** (whoever knows the
seed replays the noise and the batches). Every draw is a pure function of the key, a stream
name and a step index, so a seeded run resumes from a counter alone. Gaussian values are
Box–Muller in fp64 (an fp32 result is rounded once). See ``docs/guide/privacy.md`` (threat
model) for the design and ``docs/guide/privacy-noise.md`` for the floating-point analysis.

Example:
    >>> from opake.dpsgd.randomness import Randomness
    >>> source = Randomness.seeded(0)
    >>> source.mode
    'seeded (not private)'
    >>> z = source.normal("noise", 0, 4)
    >>> z.dtype, z.shape
    (torch.float32, torch.Size([4]))
"""

from __future__ import annotations

from opake.dpsgd.randomness._source import Randomness

__all__ = ["Randomness"]
