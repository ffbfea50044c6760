"""Privacy of the randomness and of the accounting: secure by default, seeded only when asked.

Each test reproduces an attack or a silent mis-accounting found against earlier versions:

* a public default seed let anyone replay the noise (and recover the clipped sum) and know the
  batches (so the amplification by subsampling the accountant counts on did not hold);
* "secure" noise was torch's Mersenne Twister re-seeded from 63 bits per call;
* adaptive clipping's count query was not accounted through ``accumulate()``/``step()``;
* a shuffle sampler with an explicit ``sample_rate=`` was accounted as Poisson.

The random source is checked against a slow, obvious reference: ChaCha20 written out in plain
Python from RFC 8439, and Box–Muller / Bernoulli conversions element by element.
"""

from __future__ import annotations

import json
import math
import struct
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from opake import accounting
from opake.core.errors import ConfigurationError, OpakePrivacyWarning
from opake.dpsgd.clipping import AdaptiveClipping, clipped_grad
from opake.dpsgd.noise import GaussianNoise, add_noise, noise_grid
from opake.dpsgd.optimizer import DPOptimizer
from opake.dpsgd.randomness import Randomness
from opake.dpsgd.randomness import _source as _randomness
from opake.dpsgd.sampling import FixedShapePoissonSampler, PoissonSampler, ShuffleSampler
from opake.functional import make_functional

# -- a plain-Python ChaCha20 (RFC 8439 §2.3), the reference the keystream is checked against --


def _rotl(v: int, c: int) -> int:
    return ((v << c) & 0xFFFFFFFF) | (v >> (32 - c))


def _quarter(x: list[int], a: int, b: int, c: int, d: int) -> None:
    x[a] = (x[a] + x[b]) & 0xFFFFFFFF
    x[d] = _rotl(x[d] ^ x[a], 16)
    x[c] = (x[c] + x[d]) & 0xFFFFFFFF
    x[b] = _rotl(x[b] ^ x[c], 12)
    x[a] = (x[a] + x[b]) & 0xFFFFFFFF
    x[d] = _rotl(x[d] ^ x[a], 8)
    x[c] = (x[c] + x[d]) & 0xFFFFFFFF
    x[b] = _rotl(x[b] ^ x[c], 7)


def chacha20_block(key: bytes, counter: int, nonce: bytes) -> bytes:
    constants = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574]
    state = [*constants, *struct.unpack("<8I", key), counter, *struct.unpack("<3I", nonce)]
    x = list(state)
    for _ in range(10):
        _quarter(x, 0, 4, 8, 12)
        _quarter(x, 1, 5, 9, 13)
        _quarter(x, 2, 6, 10, 14)
        _quarter(x, 3, 7, 11, 15)
        _quarter(x, 0, 5, 10, 15)
        _quarter(x, 1, 6, 11, 12)
        _quarter(x, 2, 7, 8, 13)
        _quarter(x, 3, 4, 9, 14)
    return struct.pack("<16I", *((a + b) & 0xFFFFFFFF for a, b in zip(x, state, strict=True)))


def reference_keystream(key: bytes, stream: str, index: int, nbytes: int) -> bytes:
    nonce = _randomness.STREAMS[stream].to_bytes(4, "little") + index.to_bytes(8, "little")
    blocks = [chacha20_block(key, i, nonce) for i in range((nbytes + 63) // 64)]
    return b"".join(blocks)[:nbytes]


def test_reference_chacha20_matches_the_rfc_test_vector() -> None:
    # RFC 8439 §2.3.2: key 00..1f, nonce 00:00:00:09:00:00:00:4a:00:00:00:00, block count 1
    block = chacha20_block(bytes(range(32)), 1, bytes.fromhex("000000090000004a00000000"))
    assert block.hex().startswith("10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c06803")
    assert block.hex().endswith("b5129cd1de164eb9cbd083e8a2503c4e")


@pytest.mark.parametrize("stream", sorted(_randomness.STREAMS))
def test_keystream_is_chacha20_under_the_key(stream: str) -> None:
    source = Randomness.seeded(12345)
    for index, nbytes in [(0, 1), (3, 64), (2**40 + 7, 200)]:
        expected = reference_keystream(source.export_key(), stream, index, nbytes)
        assert bytes(source.keystream(stream, index, nbytes)) == expected


@pytest.mark.parametrize(("offset", "nbytes"), [(0, 128), (64, 129), (128, 1000), (0, 320)])
def test_keystream_longer_than_the_zero_source_continues_the_counter(
    monkeypatch, offset: int, nbytes: int
) -> None:
    # the cipher reads a shared zero buffer (1 MiB in use, 128 bytes here) segment by segment:
    # the keystream must run on across segments exactly as one call, and the buffer stay zero
    zeros = memoryview(bytes(128))
    monkeypatch.setattr(_randomness, "_ZEROS", zeros)
    source = Randomness.seeded(99)
    got = bytes(source.keystream("noise", 4, nbytes, offset=offset))
    assert got == reference_keystream(source.export_key(), "noise", 4, offset + nbytes)[offset:]
    assert bytes(zeros) == bytes(128)


def test_gaussian_is_box_muller_of_the_keystream_element_by_element() -> None:
    source = Randomness.seeded(3)
    count = 9
    pairs = (count + 1) // 2
    raw = reference_keystream(source.export_key(), "noise", 5, 16 * pairs)
    expected = []
    radius, angle = [], []
    for i in range(pairs):
        k = int.from_bytes(raw[8 * i : 8 * i + 8], "little") & (2**63 - 1)
        j = int.from_bytes(raw[8 * pairs + 8 * i : 8 * pairs + 8 * i + 8], "little", signed=True)
        u = (k + 0.5) * 2.0**-63
        radius.append(math.sqrt(-2.0 * math.log(u)))
        angle.append(math.pi * j * 2.0**-63)
    expected = [r * math.cos(t) for r, t in zip(radius, angle, strict=True)]
    expected += [r * math.sin(t) for r, t in zip(radius, angle, strict=True)]
    got64 = source.normal("noise", 5, count, dtype=torch.float64)
    np.testing.assert_allclose(got64.numpy(), expected[:count], rtol=1e-12, atol=1e-12)
    got32 = source.normal("noise", 5, count)
    assert got32.dtype == torch.float32
    assert torch.equal(got32, got64.float())  # computed in fp64, rounded once
    scaled = source.normal("noise", 5, count, dtype=torch.float64, scale=3.0)
    np.testing.assert_allclose(scaled.numpy(), 3.0 * got64.numpy(), rtol=1e-15, atol=0)


def _reference_inputs(raw: bytes, pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """Box–Muller's inputs, converted the plain way: radius words (63 bits), angle words."""
    k = (np.frombuffer(raw[: 8 * pairs], dtype="<u8") & np.uint64(2**63 - 1)).view(np.int64)
    j = np.frombuffer(raw[8 * pairs : 16 * pairs], dtype="<i8")
    return k.astype(np.float64), j.astype(np.float64)


def test_gaussian_pieces_address_the_one_shot_keystream(monkeypatch) -> None:
    # bounded pieces (small here, 2^17 pairs in use) must give exactly the layout of one shot:
    # radius words of all pairs first, then their angle words; cosines, then sines
    monkeypatch.setattr(_randomness, "_CHUNK_PAIRS", 40)
    source = Randomness.seeded(11)
    count = 2 * 40 * 3 + 17  # several pieces, a short last one, an odd count
    pairs = (count + 1) // 2
    raw = source.keystream("noise", 2, 16 * pairs)
    assert bytes(raw) == reference_keystream(source.export_key(), "noise", 2, 16 * pairs)
    k, j = _reference_inputs(bytes(raw), pairs)
    radius = np.sqrt(-2.0 * np.log((k + 0.5) * 2.0**-63))
    theta = math.pi * j * 2.0**-63
    want = np.concatenate([radius * np.cos(theta), radius * np.sin(theta)])[:count]
    pieces = list(source.normal_pieces("noise", 2, count, dtype=torch.float64))
    assert max(v.numel() for _, v in pieces) <= 40
    # every piece keeps its values once later pieces are drawn (no piece aliases a buffer
    # that the next one overwrites)
    for start, values in pieces:
        np.testing.assert_allclose(
            values.numpy(), want[start : start + values.numel()], rtol=1e-12, atol=1e-12
        )
    got = source.normal("noise", 2, count, dtype=torch.float64)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
    covered = sorted(i for start, v in pieces for i in range(start, start + v.numel()))
    assert covered == list(range(count))
    # the noise of a model is the same draw, written piece by piece into each entry (snapped
    # onto the lattice: zero gradients, so the rounded noise itself)
    grads = {"a": torch.zeros(7, 3), "b": torch.zeros(0), "c": torch.zeros(count - 21)}
    out = GaussianNoise(1.0, seed=11).add(grads, sensitivity=1.0)
    grid = noise_grid(1.0)
    units = Randomness.seeded(11).normal("noise", 0, count, dtype=torch.float64, scale=1 / grid)
    flat = (units.round() * grid).float()
    assert torch.equal(torch.cat([out[n].flatten() for n in sorted(grads)]), flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gaussian_pieces_convert_the_keystream_bit_for_bit(monkeypatch, dtype) -> None:
    # the pieces read the keystream through one reused scratch buffer and convert it in place;
    # the floats Box–Muller receives must be exactly the plain route's: fresh bytes, astype
    monkeypatch.setattr(_randomness, "_CHUNK_PAIRS", 20)  # 160 bytes: radius words too
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    box_muller = _randomness._box_muller

    def recording(k: np.ndarray, j: np.ndarray, scale: float):
        seen.append((k.copy(), j.copy()))
        return box_muller(k, j, scale)

    monkeypatch.setattr(_randomness, "_box_muller", recording)
    source = Randomness.seeded(17)
    count = 2 * 20 * 4 + 9  # pieces whose words start mid-block, a short last one
    pairs = (count + 1) // 2
    source.normal("noise", 6, count, dtype=dtype)
    raw = reference_keystream(source.export_key(), "noise", 6, 16 * pairs)
    k, j = _reference_inputs(raw, pairs)
    got_k = np.concatenate([piece_k for piece_k, _ in seen])
    got_j = np.concatenate([piece_j for _, piece_j in seen])
    assert got_k.dtype == got_j.dtype == np.float64  # Box–Muller runs in fp64 for both
    assert got_k.tobytes() == k.tobytes()
    assert got_j.tobytes() == j.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    chunk=st.integers(1, 40),
    count=st.integers(0, 240),
    index=st.sampled_from([0, 1, 2**32 + 5, 2**64 - 1]),
    wide=st.booleans(),
)
def test_gaussian_pieces_convert_every_layout_bit_for_bit(
    chunk: int, count: int, index: int, wide: bool
) -> None:
    # a search over piece sizes (words starting anywhere in a block), counts (odd, empty,
    # shorter than a piece) and indices: Box–Muller must always receive exactly the plain
    # conversion of the reference keystream, and the pieces must cover every position once
    dtype = torch.float64 if wide else torch.float32
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    box_muller = _randomness._box_muller

    def recording(k: np.ndarray, j: np.ndarray, scale: float):  # type: ignore[no-untyped-def]
        seen.append((k.copy(), j.copy()))
        return box_muller(k, j, scale)

    source = Randomness.seeded(23)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_randomness, "_CHUNK_PAIRS", chunk)
        patch.setattr(_randomness, "_box_muller", recording)
        pieces = list(source.normal_pieces("noise", index, count, dtype=dtype))
    pairs = (count + 1) // 2
    raw = reference_keystream(source.export_key(), "noise", index, 16 * pairs)
    k, j = _reference_inputs(raw, pairs)
    got_k = np.concatenate([a for a, _ in seen]) if seen else np.empty(0, np.float64)
    got_j = np.concatenate([b for _, b in seen]) if seen else np.empty(0, np.float64)
    assert got_k.tobytes() == k.tobytes()
    assert got_j.tobytes() == j.tobytes()
    assert all(v.dtype == dtype and v.numel() <= chunk for _, v in pieces)
    covered = sorted(i for start, v in pieces for i in range(start, start + v.numel()))
    assert covered == list(range(count))


def test_gaussian_tail_reaches_past_nine_sigma_and_never_overflows() -> None:
    # the smallest u is 2^-64 (k = 0): the radius is sqrt(128 ln 2) ≈ 9.42, finite
    assert math.sqrt(-2 * math.log(0.5 * 2.0**-63)) == pytest.approx(9.42, abs=0.01)
    z = Randomness.seeded(0).normal("noise", 0, 400_000)
    assert torch.isfinite(z).all()
    assert stats.kstest(z.double().numpy(), "norm").pvalue > 1e-4


def test_bernoulli_threshold_is_exact_to_2_pow_minus_64() -> None:
    source = Randomness.seeded(9)
    p = 0.3
    words = [int(w) for w in source.uint64("poisson", 4, 64)]
    threshold = math.floor(p * 2**64)  # p is a dyadic rational: this product is exact
    expected = [w < threshold for w in words]
    assert source.bernoulli("poisson", 4, 64, p).tolist() == expected
    assert source.bernoulli("poisson", 4, 64, 1.0).all()
    assert not source.bernoulli("poisson", 4, 64, 0.0).any()


def test_bernoulli_in_pieces_is_the_same_draw(monkeypatch) -> None:
    source = Randomness.seeded(2)
    whole = source.bernoulli("poisson", 1, 100, 0.5)
    monkeypatch.setattr(_randomness, "_CHUNK_WORDS", 16)  # 64-byte blocks: 8 words each
    assert source.bernoulli("poisson", 1, 100, 0.5).tolist() == whole.tolist()
    assert (
        bytes(source.keystream("poisson", 1, 64, offset=128))
        == reference_keystream(source.export_key(), "poisson", 1, 192)[128:]
    )


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.dictionaries(
        st.text("abcxyz", min_size=1, max_size=3),
        st.lists(st.integers(0, 4), min_size=0, max_size=3),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**70),
    steps=st.integers(1, 3),
)
def test_noise_is_the_sorted_keystream_whatever_the_shapes(
    shapes: dict[str, list[int]], seed: int, steps: int
) -> None:
    grads = {name: torch.zeros(shape) for name, shape in shapes.items()}
    noise = GaussianNoise(1.0, seed=seed)
    for step in range(steps):
        out = noise.add(grads, sensitivity=2.0)
        total = sum(g.numel() for g in grads.values())
        grid = noise_grid(2.0)
        units = Randomness.seeded(seed).normal(
            "noise", step, total, dtype=torch.float64, scale=2.0 / grid
        )
        flat = (units.round() * grid).float()
        offset = 0
        for name in sorted(grads):
            size = grads[name].numel()
            assert torch.equal(out[name].flatten(), flat[offset : offset + size])
            offset += size


# -- finding 5: "secure" was a re-seeded Mersenne Twister ------------------------------------


def test_secure_noise_is_a_chacha20_stream_under_a_256_bit_os_key(monkeypatch) -> None:
    calls = []
    key = bytes(range(100, 132))

    def token_bytes(n: int) -> bytes:
        calls.append(n)
        return key

    monkeypatch.setattr(_randomness.secrets, "token_bytes", token_bytes)

    def no_torch_prng(*args, **kwargs):  # the secure path must never touch torch's PRNG
        raise AssertionError("torch PRNG used for secure noise")

    monkeypatch.setattr(torch, "Generator", no_torch_prng)
    monkeypatch.setattr(torch, "randn", no_torch_prng)
    out = add_noise({"w": torch.zeros(3)}, noise_multiplier=1.0, sensitivity=1.0)
    assert calls == [32]
    assert out.secure
    raw = reference_keystream(key, "noise", 0, 32)  # 2 pairs: radius words, then angle words
    k = int.from_bytes(raw[:8], "little") & (2**63 - 1)
    j = int.from_bytes(raw[16:24], "little", signed=True)
    first = math.sqrt(-2 * math.log((k + 0.5) * 2.0**-63)) * math.cos(math.pi * j * 2.0**-63)
    assert out["w"][0].item() == pytest.approx(first, rel=1e-6, abs=2.0**-24)


# -- finding 2: the default seeds were public -------------------------------------------------


def _attacker_replays(observed: torch.Tensor, clipped_sum: torch.Tensor, seed: int) -> bool:
    guess = GaussianNoise(1.0, seed=seed).add({"w": torch.zeros_like(observed)}, 1.0)["w"]
    return bool(torch.allclose(observed - guess, clipped_sum, atol=1e-5))


def test_default_optimizer_noise_cannot_be_replayed_from_a_known_seed() -> None:
    w = torch.nn.Parameter(torch.zeros(64))
    opt = DPOptimizer(torch.optim.SGD([w], lr=1.0), {"w": w}, noise_multiplier=1.0,
                      expected_batch_size=1.0)  # fmt: skip
    assert opt.noise.secure

    class Sum(dict):  # type: ignore[type-arg]
        max_norm = 1.0

    secret = torch.linspace(-0.5, 0.5, 64)
    opt.accumulate(Sum(w=secret))
    opt.step()
    observed = -w.detach().clone()  # SGD, lr 1, divisor 1: the update is the noised sum
    assert not any(_attacker_replays(observed, secret, seed) for seed in range(4))
    # …whereas a seeded (explicitly non-private) run is replayed exactly: the attack is real
    v = torch.nn.Parameter(torch.zeros(64))
    seeded = DPOptimizer(torch.optim.SGD([v], lr=1.0), {"v": v}, noise_multiplier=1.0,
                         expected_batch_size=1.0, seed=0)  # fmt: skip
    seeded.accumulate(Sum(v=secret))
    seeded.step()
    assert _attacker_replays(-v.detach().clone(), secret, 0)
    assert "key" not in json.dumps(opt.state_dict()["noise"])


@pytest.mark.parametrize("cls", [PoissonSampler, FixedShapePoissonSampler])
def test_default_batches_are_not_those_of_a_known_seed(cls: type) -> None:
    extra = {"max_batch_size": 40} if cls is FixedShapePoissonSampler else {}
    sampler = cls(200, 0.1, **extra)
    assert sampler.secure
    assert sampler.state_dict()["seed"] is None
    batches = [sampler.global_batch(t).tolist() for t in range(5)]
    for seed in range(4):
        public = cls(200, 0.1, seed=seed, **extra)
        assert batches != [public.global_batch(t).tolist() for t in range(5)]


def test_secure_poisson_sampling_has_the_poisson_law() -> None:
    # each example joins each step independently with probability q: inclusion counts over T
    # steps are Binomial(T, q) per example, and pairs are uncorrelated
    n, q, steps = 60, 0.2, 400
    sampler = PoissonSampler(n, q)
    member = np.zeros((steps, n), dtype=bool)
    for t in range(steps):
        member[t, sampler.global_batch(t)] = True
    counts = member.sum(axis=0)
    expected = steps * q
    chi2 = float(((counts - expected) ** 2 / (expected * (1 - q))).sum())
    assert stats.chi2.sf(chi2, df=n) > 1e-4
    corr = np.corrcoef(member[:, 0], member[:, 1])[0, 1]
    assert abs(corr) < 6 / math.sqrt(steps)


def test_resumed_secure_sampler_draws_fresh_batches_and_keeps_its_position() -> None:
    sampler = PoissonSampler(500, 0.1)
    next(iter(sampler))
    state = sampler.state_dict()
    resumed = PoissonSampler(500, 0.1)
    resumed.load_state_dict(state)
    assert resumed.position == 1
    assert resumed.global_batch(1).tolist() != sampler.global_batch(1).tolist()
    with pytest.raises(ConfigurationError, match="secure"):
        PoissonSampler(500, 0.1, seed=1).load_state_dict(state)


def test_seeded_sampler_resumes_bit_for_bit() -> None:
    full = PoissonSampler(300, 0.05, seed=8)
    batches = [b for _, b in zip(range(6), full, strict=False)]
    part = PoissonSampler(300, 0.05, seed=8)
    for _ in zip(range(3), part, strict=False):
        pass
    resumed = PoissonSampler(300, 0.05, seed=123)
    resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
    assert resumed.seed == 8
    assert [b for _, b in zip(range(3), resumed, strict=False)] == batches[3:]


def test_noise_and_sampler_with_one_seed_use_independent_streams() -> None:
    source = Randomness.seeded(0)
    assert bytes(source.keystream("noise", 0, 64)) != bytes(source.keystream("poisson", 0, 64))


# -- finding 4: adaptive clipping's count and shuffle sampling --------------------------------


def _adaptive_setup(sigma_b: float) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(trainable, frozen, x, y):  # type: ignore[no-untyped-def]
        return F.cross_entropy(fmodel((trainable, frozen), x[None]), y[None])

    grad_fn, state = clipped_grad(
        loss_fn,
        clipping_norm=AdaptiveClipping(
            0.5, count_noise_multiplier=sigma_b, expected_batch_size=8.0, seed=0
        ),
        batch_argnums=(2, 3),
    )
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    return model, trainable, frozen, grad_fn, state, x, y


def test_adaptive_count_through_accumulate_is_accounted_or_refused() -> None:
    sigma, sigma_b, q, steps, delta = 1.0, 2.0, 0.1, 20, 1e-5
    model, trainable, frozen, grad_fn, state, x, y = _adaptive_setup(sigma_b)
    acct = accounting.RDPAccountant()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trainable,
                      noise_multiplier=sigma, expected_batch_size=8.0, sample_rate=q,
                      accountant=acct, seed=0)  # fmt: skip
    grads, state = grad_fn(trainable, frozen, x, y, state=state)
    assert grads.count_noise_multiplier == sigma_b
    with pytest.raises(ConfigurationError, match="under-report"):
        opt.accumulate(grads)
    assert acct.get_epsilon(delta) == 0.0  # nothing was recorded
    # with σ_b declared, accumulate()/step() record the count query: ε of σ_eff
    acct = accounting.RDPAccountant()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), trainable,
                      noise_multiplier=sigma, expected_batch_size=8.0, sample_rate=q,
                      accountant=acct, seed=0, count_noise_multiplier=sigma_b)  # fmt: skip
    for _ in range(steps):
        grads, state = grad_fn(trainable, frozen, x, y, state=state)
        opt.accumulate(grads)
        opt.step()
    sigma_eff = (sigma**-2 + (2 * sigma_b) ** -2) ** -0.5
    with_count = accounting.epsilon(
        sample_rate=q, noise_multiplier=sigma_eff, steps=steps, delta=delta, accountant="rdp"
    )
    without = accounting.epsilon(
        sample_rate=q, noise_multiplier=sigma, steps=steps, delta=delta, accountant="rdp"
    )
    assert acct.get_epsilon(delta) == pytest.approx(with_count, rel=1e-9)
    assert with_count > without  # what the old path silently reported instead


def test_adaptive_count_accumulated_physical_batches_keep_their_sigma_b() -> None:
    _, trainable, frozen, grad_fn, state, x, y = _adaptive_setup(1.5)
    a, state = grad_fn(trainable, frozen, x[:4], y[:4], state=state, end_step=False)
    b, state = grad_fn(trainable, frozen, x[4:], y[4:], state=state)
    assert (a + b).count_noise_multiplier == 1.5


def test_shuffle_sampler_with_sample_rate_is_refused_with_the_reason() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OpakePrivacyWarning)
        shuffle = ShuffleSampler(100, 10, seed=0)
    with pytest.raises(ConfigurationError, match="not Poisson") as err:
        DPOptimizer(
            torch.optim.SGD([w], lr=0.1),
            {"w": w},
            noise_multiplier=1.0,
            sampler=shuffle,
            sample_rate=0.1,
            accountant=accounting.RDPAccountant(),
        )
    message = str(err.value)
    assert "sample_rate=0.1" in message
    assert "amplification by subsampling" in message
    assert "without sampler" not in message  # no hint to bypass the check
