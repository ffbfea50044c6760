"""A secure sampler never hands out the same batch twice (red-team review, round 7).

Every batch is a pure function of ``(key, step)``. Moving a live secure sampler back —
``load_state_dict`` of an earlier state, ``seek`` to an earlier step — replayed batches already
trained on (inside ``DPTraining`` too), while the accountant counted every step as a fresh
Poisson draw. A secure sampler now draws a step it has handed out from a key derived from its
own; a seeded sampler still replays by design, and ranks that move back alike stay in step."""

from __future__ import annotations

import warnings

import torch

from opake.dpsgd.randomness import Randomness
from opake.dpsgd.sampling import PoissonSampler, ShuffleSampler


def _take(sampler, count: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(count)]


def test_loading_an_earlier_state_into_a_live_secure_sampler_draws_new_batches():
    sampler = PoissonSampler(1000, 0.05)
    start = sampler.state_dict()
    first = _take(sampler, 3)
    sampler.load_state_dict(start)
    again = _take(sampler, 3)
    assert sampler.position == 3
    assert all(a != b for a, b in zip(first, again, strict=True))


def test_seeking_back_draws_new_batches_and_seeking_forward_is_unchanged():
    sampler = PoissonSampler(1000, 0.05)
    first = _take(sampler, 3)
    sampler.seek(1)
    assert next(iter(sampler)) != first[1]
    ahead = PoissonSampler(1000, 0.05, randomness=Randomness.from_key(b"k" * 32))
    skipped = PoissonSampler(1000, 0.05, randomness=Randomness.from_key(b"k" * 32))
    ahead.seek(5)  # forward: nothing was handed out there, the key's own batch
    assert next(iter(ahead)) == skipped.batch_at(5)


def test_a_seeded_sampler_replays_by_design():
    sampler = PoissonSampler(1000, 0.05, seed=4)
    start = sampler.state_dict()
    first = _take(sampler, 3)
    sampler.load_state_dict(start)
    assert _take(sampler, 3) == first


def test_ranks_sharing_a_key_that_move_back_alike_draw_the_same_new_batches():
    key = Randomness.secure().export_key()
    ranks = [
        PoissonSampler(1000, 0.05, randomness=Randomness.from_key(key), rank=r, world_size=2)
        for r in range(2)
    ]
    firsts = [_take(s, 2) for s in ranks]
    for s in ranks:
        s.seek(0)
    again = [_take(s, 2) for s in ranks]
    assert ranks[0].randomness.fingerprint == ranks[1].randomness.fingerprint
    assert again[0] != firsts[0]
    # together the two shards of a step still form one global batch, disjoint
    assert not set(again[0][0]) & set(again[1][0])
    single = PoissonSampler(1000, 0.05, randomness=Randomness.from_key(key))
    _take(single, 2)
    single.seek(0)
    assert sorted(again[0][0] + again[1][0]) == sorted(next(iter(single)))


def test_a_shuffle_sampler_moved_back_does_not_repeat_its_batches():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shuffling is not Poisson sampling: it says so
        sampler = ShuffleSampler(100, 10)
    first = _take(sampler, 2)
    sampler.seek(0)
    assert _take(sampler, 2) != first


def test_dp_training_never_trains_twice_on_a_batch_after_its_sampler_is_moved_back():
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    fmodel, params = make_functional(net)

    def loss_fn(p, x, y):
        return (fmodel(p, x[None])[0, 0] - y) ** 2

    n = 200
    x, y = torch.randn(n, 3), torch.randn(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = DPTraining(
            loss_fn,
            torch.optim.SGD(net.parameters(), lr=0.1),
            params,
            batch_args=2,
            dataset_size=n,
            sample_rate=0.1,
            noise_multiplier=1.0,
            delta=1e-5,
        )
        start = training.sampler.state_dict()
        seen = []
        batches = training.batches()
        for _ in range(3):
            indices = next(batches)
            seen.append(indices)
            training.step(x[indices], y[indices])
        training.sampler.load_state_dict(start)
        indices = next(training.batches())
    assert indices != seen[0]
