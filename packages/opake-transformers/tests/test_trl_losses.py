"""The post-training per-example losses (opake.transformers.losses) against a per-example loop of
plain autograd, on both clipping engines: SFT completion losses (prompt tokens get no gradient)
and the DPO loss, whose pair (chosen and rejected rows) is clipped as one example."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

CLIP = 0.3
ENGINES = ["vmap", "bookkeeping"]


def _rows(spec: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
    """Right-padded rows from ``(tokens, prompt length)``: labels -100 on prompt and padding."""
    width = max(len(tokens) for tokens, _ in spec)
    ids = torch.zeros(len(spec), width, dtype=torch.long)
    labels = torch.full((len(spec), width), -100)
    for i, (tokens, prompt) in enumerate(spec):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        labels[i, prompt : len(tokens)] = torch.tensor(tokens[prompt:])
    return {"input_ids": ids, "labels": labels}


def _sequences(count: int, seed: int) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(4, 9, (1,), generator=gen))
        prompt = int(torch.randint(1, length - 1, (1,), generator=gen))
        out.append((torch.randint(1, H.VOCAB, (length,), generator=gen).tolist(), prompt))
    return out


def _clipped_sum(model, grads_of, units: list[list[int]]) -> dict[str, torch.Tensor]:
    """Σ over units of clip(∇ loss of the unit) by plain autograd, in fp64."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in named.items()}
    for unit in units:
        grads = torch.autograd.grad(grads_of(unit), list(named.values()))
        norm = float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
        scale = min(1.0, CLIP / norm) if norm > 0 else 1.0
        for name, g in zip(named, grads, strict=True):
            total[name] += g.double() * scale
    return total


def _grad_fn(loss_fn, fmodel, engine: str):
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad

    return clipped_grad(
        BatchedLoss(loss_fn, fmodel), clipping_norm=CLIP, batch_argnums=2, engine=engine
    )


def _log_prob(model, tokens: list[int], prompt: int) -> torch.Tensor:
    """Σ log p of the completion tokens of one unpadded sequence (plain autograd)."""
    ids = torch.tensor(tokens)[None]
    logp = F.log_softmax(model(input_ids=ids, use_cache=False).logits[0, :-1].float(), -1)
    targets = torch.tensor(tokens[1:])
    return logp[torch.arange(len(tokens) - 1), targets][prompt - 1 :].sum()


@pytest.mark.parametrize("engine", ENGINES)
def test_completion_losses_equal_a_per_example_loop(engine):
    from opake.functional import make_functional
    from opake.transformers.losses import completion_losses

    model = H.tiny_causal_lm(seed=1).eval()
    spec = _sequences(5, seed=0)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    grad_fn, state = _grad_fn(completion_losses(fmodel, model), fmodel, engine)
    grads, _ = grad_fn(trainable, frozen, _rows(spec), state=state)
    assert grad_fn.engine == engine

    def loss_of(unit):
        tokens, prompt = spec[unit[0]]
        row = _rows([(tokens, prompt)])
        return model(**row, use_cache=False).loss  # HF's mean over the completion tokens

    want = _clipped_sum(model, loss_of, [[i] for i in range(len(spec))])
    for name, value in want.items():
        torch.testing.assert_close(grads[name].double(), value, atol=2e-6, rtol=1e-5, msg=name)


def test_prompt_tokens_get_no_gradient():
    """The gradient of either loss with respect to the logits is exactly zero wherever the
    next token is a prompt token (or padding): only completion tokens are trained on."""
    from opake.transformers.losses import DPOLoss, completion_losses

    batch = _rows([([5, 6, 7, 8, 9], 3), ([10, 11, 12], 1)])  # the second row is padded
    logits = torch.randn(2, batch["input_ids"].shape[1], H.VOCAB, requires_grad=True)

    def fmodel(params, **inputs):
        return type("Out", (), {"logits": params[0]["logits"]})()

    prompt_or_padding = batch["labels"][:, 1:] == -100  # positions t predicting token t + 1
    sft = completion_losses(fmodel, torch.nn.Linear(1, 1))
    dpo = DPOLoss(fmodel, torch.nn.Linear(1, 1), beta=0.7)
    weighted = {**batch, "opake_dpo_weight": torch.tensor([-0.3, 0.3])}
    for loss in (sft({"logits": logits}, {}, batch), dpo({"logits": logits}, {}, weighted)):
        (grad,) = torch.autograd.grad(loss.sum(), logits)
        assert torch.all(grad[:, :-1][prompt_or_padding] == 0)
        assert torch.all(grad[:, -1] == 0)  # the last position predicts nothing
        assert grad[:, :-1][~prompt_or_padding].abs().sum() > 0


def _pairs(count: int, seed: int) -> tuple[list[tuple[list[int], list[int], int]], torch.Tensor]:
    """``count`` pairs (chosen tokens, rejected tokens, shared prompt length) and reference
    log-probabilities ``[2, count]``."""
    gen = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(count):
        prompt = torch.randint(1, H.VOCAB, (int(torch.randint(1, 4, (1,), generator=gen)),))
        ends = [
            torch.randint(1, H.VOCAB, (int(torch.randint(1, 5, (1,), generator=gen)),))
            for _ in range(2)
        ]
        chosen, rejected = (torch.cat([prompt, end]).tolist() for end in ends)
        pairs.append((chosen, rejected, len(prompt)))
    ref = -torch.rand(2, count, generator=gen) * 10
    return pairs, ref


def _pair_rows(pairs) -> dict[str, torch.Tensor]:
    chosen = [(c, p) for c, _, p in pairs]
    rejected = [(r, p) for _, r, p in pairs]
    return _rows(chosen + rejected)


def _dpo_clipped(dpo, fmodel, trainable, frozen, pairs, ref, engine, ids=None):
    grad_fn, state = _grad_fn(dpo, fmodel, engine)
    prepared = dpo.prepare(
        trainable, frozen, _pair_rows(pairs), ref_chosen=ref[0], ref_rejected=ref[1], ids=ids
    )
    grads, _ = grad_fn(trainable, frozen, prepared.batch, state=state, units=prepared.units)
    return grads, prepared, grad_fn


@pytest.mark.parametrize("engine", ENGINES)
def test_dpo_clipped_sum_equals_the_loop_over_pairs(engine):
    from opake.functional import make_functional
    from opake.transformers.losses import DPOLoss, dpo_losses

    model = H.tiny_causal_lm(seed=2).eval()
    pairs, ref = _pairs(4, seed=3)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    dpo = DPOLoss(fmodel, model, beta=2.0)
    grads, prepared, grad_fn = _dpo_clipped(dpo, fmodel, trainable, frozen, pairs, ref, engine)
    assert grad_fn.engine == engine

    def loss_of(unit):
        (i,) = unit
        chosen, rejected, prompt = pairs[i]
        pi = [_log_prob(model, chosen, prompt), _log_prob(model, rejected, prompt)]
        return dpo_losses(pi[0][None], pi[1][None], ref[0, i : i + 1], ref[1, i : i + 1], beta=2.0)[
            0
        ]

    with torch.no_grad():
        losses = torch.stack([loss_of([i]) for i in range(len(pairs))])
    torch.testing.assert_close(prepared.losses, losses, atol=1e-5, rtol=1e-5)
    want = _clipped_sum(model, loss_of, [[i] for i in range(len(pairs))])
    for name, value in want.items():
        torch.testing.assert_close(grads[name].double(), value, atol=2e-6, rtol=1e-5, msg=name)


_DPO_MODEL: dict[str, object] = {}


def _tiny():
    from opake.functional import make_functional

    if "model" not in _DPO_MODEL:
        model = H.tiny_causal_lm(seed=4).eval()
        _DPO_MODEL["model"] = model
        _DPO_MODEL["functional"] = make_functional(model, partition_trainable=True)
    return _DPO_MODEL["model"], _DPO_MODEL["functional"]


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=8)
@given(
    seed=st.integers(0, 10_000),
    scale=st.sampled_from([1e-3, 1.0, 1e3, 1e6]),
    beta=st.floats(1e-3, 20.0),
    removed=st.integers(0, 2),
)
def test_one_dpo_record_moves_the_clipped_sum_by_at_most_c(engine, seed, scale, beta, removed):
    """Whatever its reference log-probabilities (any magnitude), β, or tokens, one preference
    record — its chosen and rejected rows — changes the clipped sum by at most C."""
    from opake.transformers.losses import DPOLoss

    model, (fmodel, trainable, frozen) = _tiny()
    pairs, ref = _pairs(3, seed=seed)
    ref = ref * scale
    dpo = DPOLoss(fmodel, model, beta=beta)
    ids = torch.tensor([10, 11, 12])
    whole, prepared, _ = _dpo_clipped(dpo, fmodel, trainable, frozen, pairs, ref, engine, ids)
    keep = [i for i in range(3) if i != removed]
    rest, _, _ = _dpo_clipped(
        dpo, fmodel, trainable, frozen, [pairs[i] for i in keep], ref[:, keep], engine, ids[keep]
    )
    moved = torch.sqrt(sum((whole[n].double() - rest[n].double()).pow(2).sum() for n in whole))
    assert float(moved) <= CLIP * (1 + 1e-5) + 1e-7
    assert torch.equal(prepared.units, torch.tensor([10, 11, 12, 10, 11, 12]))


def test_loss_only_head_gives_the_same_losses_and_gradients():
    pytest.importorskip("opake.patches")
    from opake.functional import make_functional
    from opake.patches import apply_model_patches
    from opake.transformers.losses import DPOLoss, completion_losses, loss_only_available

    plain = H.tiny_causal_lm(seed=5).eval()
    patched = H.tiny_causal_lm(seed=5).eval()
    assert not loss_only_available(patched)
    apply_model_patches(patched)
    assert loss_only_available(patched)
    pairs, ref = _pairs(3, seed=6)
    rows = _pair_rows(pairs)
    out = {}
    for name, model, loss_only in (("plain", plain, False), ("patched", patched, True)):
        fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
        sft = completion_losses(fmodel, model, loss_only=loss_only)(trainable, frozen, rows)
        dpo = DPOLoss(fmodel, model, beta=1.0, loss_only=loss_only)
        grads, prepared, _ = _dpo_clipped(dpo, fmodel, trainable, frozen, pairs, ref, "vmap")
        out[name] = (sft, prepared.losses, grads)
    torch.testing.assert_close(out["plain"][0], out["patched"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["plain"][1], out["patched"][1], atol=1e-5, rtol=1e-5)
    for key, value in out["plain"][2].items():
        torch.testing.assert_close(out["patched"][2][key], value, atol=1e-5, rtol=1e-4)


def test_dpo_loss_refuses_what_it_cannot_use():
    from opake.core.errors import ConfigurationError
    from opake.functional import make_functional
    from opake.transformers.losses import DPOLoss

    model = H.tiny_causal_lm()
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    with pytest.raises(ConfigurationError, match="beta"):
        DPOLoss(fmodel, model, beta=0.0)
    with pytest.raises(ConfigurationError, match="unknown keyword"):
        DPOLoss(fmodel, model, betta=0.1)
    dpo = DPOLoss(fmodel, model)
    rows = _rows(_sequences(3, seed=1))
    with pytest.raises(ConfigurationError, match="2P rows"):
        dpo.prepare(trainable, frozen, rows, ref_chosen=torch.zeros(1), ref_rejected=torch.zeros(1))
    with pytest.raises(ConfigurationError, match="prepare"):
        dpo(trainable, frozen, rows)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_empty_batch_of_pairs_prepares_and_clips_to_zeros(engine):
    """An empty Poisson batch: no forward (a model refuses zero rows), zero gradients."""
    from opake.transformers.losses import DPOLoss

    model, (fmodel, trainable, frozen) = _tiny()
    dpo = DPOLoss(fmodel, model, beta=1.0)
    rows = {k: v[:0] for k, v in _pair_rows(_pairs(1, seed=0)[0]).items()}
    prepared = dpo.prepare(
        trainable, frozen, rows, ref_chosen=torch.zeros(0), ref_rejected=torch.zeros(0)
    )
    assert prepared.units.shape == (0,)
    assert prepared.losses.shape == (0,)
    grad_fn, state = _grad_fn(dpo, fmodel, engine)
    grads, _ = grad_fn(trainable, frozen, prepared.batch, state=state, units=prepared.units)
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


# -- pairs weighed by the clipped forward itself (book-keeping) ---------------------------------


def _dpo_weighed_here(dpo, fmodel, trainable, frozen, pairs, ref, ids=None, microbatch=None):
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad

    grad_fn, state = clipped_grad(
        BatchedLoss(dpo, fmodel),
        clipping_norm=CLIP,
        batch_argnums=2,
        engine="bookkeeping",
        microbatch_size=microbatch,
    )
    from opake.transformers.losses import PairsNeedBookkeepingError

    batch, units = dpo.pairs(_pair_rows(pairs), ref_chosen=ref[0], ref_rejected=ref[1], ids=ids)
    try:
        grads, _ = grad_fn(trainable, frozen, batch, state=state, units=units)
    except PairsNeedBookkeepingError:  # the check was inconclusive: the call took vmap
        prepared = dpo.prepare(
            trainable, frozen, _pair_rows(pairs), ref_chosen=ref[0], ref_rejected=ref[1], ids=ids
        )
        grads, _ = grad_fn(trainable, frozen, prepared.batch, state=state, units=prepared.units)
    return grads, grad_fn


@pytest.mark.parametrize("microbatch", [None, 2])
def test_pairs_weighed_in_the_clipped_forward_equal_the_prepared_weights(microbatch):
    """The same clipped sum as prepare()'s forward without gradient — pairs found by id, also
    when the engine reorders the rows into whole units per microbatch — and the margins."""
    from opake.functional import make_functional
    from opake.transformers.losses import DPOLoss

    model = H.tiny_causal_lm(seed=2).eval()
    pairs, ref = _pairs(5, seed=7)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    dpo = DPOLoss(fmodel, model, beta=2.0)
    ids = torch.tensor([40, 7, 12, 3, 99])
    want, prepared, _ = _dpo_clipped(dpo, fmodel, trainable, frozen, pairs, ref, "bookkeeping", ids)
    got, grad_fn = _dpo_weighed_here(dpo, fmodel, trainable, frozen, pairs, ref, ids, microbatch)
    assert grad_fn.engine == "bookkeeping"
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
    seen = {int(i): float(m) for p in dpo.seen for i, m in zip(p.ids, p.margins, strict=True)}
    expect = dict(zip(ids.tolist(), prepared.margins.tolist(), strict=True))
    assert seen.keys() == expect.keys()
    for key, margin in expect.items():
        assert seen[key] == pytest.approx(margin, rel=1e-5, abs=1e-6)


@settings(max_examples=8)
@given(
    seed=st.integers(0, 10_000),
    scale=st.sampled_from([1e-3, 1.0, 1e3, 1e6]),
    beta=st.floats(1e-3, 20.0),
    removed=st.integers(0, 2),
)
def test_one_record_weighed_in_the_forward_moves_the_clipped_sum_by_at_most_c(
    seed, scale, beta, removed
):
    """Weights from the clipped forward read the pair's own rows only: one record still moves
    the clipped sum by at most C (its partner's weight never depends on another record)."""
    from opake.transformers.losses import DPOLoss

    model, (fmodel, trainable, frozen) = _tiny()
    pairs, ref = _pairs(3, seed=seed)
    ref = ref * scale
    dpo = DPOLoss(fmodel, model, beta=beta)
    ids = torch.tensor([10, 11, 12])
    whole, _ = _dpo_weighed_here(dpo, fmodel, trainable, frozen, pairs, ref, ids)
    keep = [i for i in range(3) if i != removed]
    rest, _ = _dpo_weighed_here(
        dpo, fmodel, trainable, frozen, [pairs[i] for i in keep], ref[:, keep], ids[keep]
    )
    moved = torch.sqrt(sum((whole[n].double() - rest[n].double()).pow(2).sum() for n in whole))
    assert float(moved) <= CLIP * (1 + 1e-5) + 1e-7


def test_pairs_refuse_the_vmap_engine_and_a_pair_split_across_calls():
    from opake.core.errors import ConfigurationError
    from opake.transformers.losses import DPOLoss, PairsNeedBookkeepingError

    model, (fmodel, trainable, frozen) = _tiny()
    pairs, ref = _pairs(2, seed=5)
    dpo = DPOLoss(fmodel, model, beta=1.0)
    grad_fn, state = _grad_fn(dpo, fmodel, "vmap")
    batch, units = dpo.pairs(_pair_rows(pairs), ref_chosen=ref[0], ref_rejected=ref[1])
    with pytest.raises(PairsNeedBookkeepingError, match="prepare"):
        grad_fn(trainable, frozen, batch, state=state, units=units)
    # rows 0 and 1 are the two chosen rows: each pair's rejected row is missing
    split = {k: v[:2] for k, v in batch.items()}
    with pytest.raises(ConfigurationError, match="without its rejected row"):
        dpo(trainable, frozen, split)
    with pytest.raises(ConfigurationError, match="distinct pair ids"):
        dpo.pairs(
            _pair_rows(pairs),
            ref_chosen=ref[0],
            ref_rejected=ref[1],
            ids=torch.tensor([3, 3]),
        )


def test_a_row_alone_never_takes_a_margin_from_another_pairs_call():
    """A microbatch of one row (no units=, microbatch_size=1) finds no forward of its pair in
    this call — even when an earlier call, whose pairs reused the same ids, left margins
    behind — and raises instead of weighing the row with another record's margin."""
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.transformers.losses import DPOLoss, PairsNeedBookkeepingError

    model, (fmodel, trainable, frozen) = _tiny()
    pairs, ref = _pairs(2, seed=9)
    dpo = DPOLoss(fmodel, model, beta=1.0)
    _dpo_weighed_here(dpo, fmodel, trainable, frozen, pairs, ref)
    assert dpo.seen  # margins of the first call's pairs 0 and 1, left behind
    grad_fn, state = clipped_grad(
        BatchedLoss(dpo, fmodel),
        clipping_norm=CLIP,
        batch_argnums=2,
        engine="bookkeeping",
        microbatch_size=1,
    )
    batch, _ = dpo.pairs(_pair_rows(pairs), ref_chosen=ref[0] - 1e4, ref_rejected=ref[1])
    with pytest.raises(PairsNeedBookkeepingError, match="a microbatch must hold whole pairs"):
        grad_fn(trainable, frozen, batch, state=state)


def test_pairs_keep_the_reference_exact_under_a_compute_dtype():
    """clipped_grad(compute_dtype=bf16) casts the batch's floating tensors: the reference
    log-probabilities travel as fp32 bits and keep their value (margins off by whole nats
    otherwise)."""
    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.transformers.losses import PAIR_KEYS, DPOLoss

    model, (fmodel, trainable, frozen) = _tiny()
    pairs, _ = _pairs(2, seed=11)
    ref = torch.tensor([[-1234.56, -17.3], [-1230.01, -18.9]])
    dpo = DPOLoss(fmodel, model, beta=1.0)
    batch, units = dpo.pairs(_pair_rows(pairs), ref_chosen=ref[0], ref_rejected=ref[1])
    assert not batch[PAIR_KEYS[2]].is_floating_point()
    grad_fn, state = clipped_grad(
        BatchedLoss(dpo, fmodel),
        clipping_norm=CLIP,
        batch_argnums=2,
        engine="bookkeeping",
        compute_dtype=torch.bfloat16,
    )
    grad_fn(trainable, frozen, batch, state=state, units=units)
    with torch.no_grad():
        logp = dpo.log_probs(trainable, frozen, _pair_rows(pairs))
    want = (logp[:2] - ref[0]) - (logp[2:] - ref[1])
    got = torch.cat([p.margins for p in dpo.seen])
    torch.testing.assert_close(got, want, atol=0.2, rtol=0.0)  # bf16 forward, exact reference
