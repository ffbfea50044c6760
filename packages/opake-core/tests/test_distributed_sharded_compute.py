"""Level 2 of docs/design/fsdp2.md: per-layer sharded compute (2 gloo processes on CPU).

One launch of ``_sharded_worker.py basic`` runs every check of stage 1 in one process group: a
tiny Llama-like model, its blocks and root ``fully_shard``-ed, trained with
``sharded_clipped_grad`` + ``ShardedDPOptimizer`` on Poisson shards (2 physical batches per rank,
microbatches of 2, batches of different sizes per rank), then one step on an empty global batch
(the noise alone); and the same steps of one physical batch each, reduce-scattered by the step or
in the call (``reduce_scatter=True``, ``_sharded_scatter.py``). The reference, computed here: the
single-process book-keeping run (the unsharded model, ``clipped_grad(engine="bookkeeping")`` on
the global batches, one noise draw per step from the same seed, ÷ q·N, SGD).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

WORKER = Path(__file__).with_name("_sharded_worker.py")
pytestmark = [
    pytest.mark.slow,  # two fresh interpreters importing torch
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="this PyTorch build has no gloo backend",
    ),
]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


W = _load("opake_test_sharded_worker", WORKER)
R = _load("opake_test_ranks", WORKER.with_name("_ranks.py"))  # start workers as torchrun would


def launch(scenario: str, out: Path, *, world_size: int = 2, timeout: float = 180.0) -> None:
    """Start the ranks (the environment torchrun would set), wait, fail with their stderr."""
    command = [sys.executable, str(WORKER), scenario, str(out)]
    R.require_success(R.launch(command, world_size=world_size, timeout=timeout))


@pytest.fixture(scope="module")
def basic(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded_basic")
    launch("basic", out)
    return [torch.load(out / f"basic.rank{r}.pt", weights_only=False) for r in range(2)]


def reference_run(
    model: torch.nn.Module, compute: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The single-process book-keeping run of ``model`` (its trainable parameters: SGD as
    DPOptimizer applies it, in the parameters' dtype); and the next noise draw (what step
    STEPS+1 adds to an empty batch's zero sum), as the parameter change it makes."""
    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.noise import GaussianNoise
    from opake.dpsgd.sampling import PoissonSampler
    from opake.functional import make_functional

    fmodel, params, frozen = make_functional(model, partition_trainable=True)
    params = {n: p.detach().clone() for n, p in params.items()}

    def losses(p: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
        return causal_lm_losses(fmodel({**frozen, **p}, ids), ids)

    grad_fn, state = clipped_grad(
        BatchedLoss(losses, fmodel),
        clipping_norm=W.CLIP,
        batch_argnums=1,
        microbatch_size=2,
        engine="bookkeeping",
        compute_dtype=compute,
    )
    ids = W.data()
    sampler = PoissonSampler(W.N, W.Q, seed=W.SAMPLER_SEED)
    noise = GaussianNoise(W.SIGMA, seed=W.NOISE_SEED)
    for step in range(W.STEPS):
        idx = torch.as_tensor(sampler.global_batch(step), dtype=torch.long)
        grads, state = grad_fn(params, ids[idx], state=state)
        noisy = noise.add(dict(grads), sensitivity=W.CLIP)
        params = {
            n: p.add((noisy[n] / (W.N * W.Q)).to(p.dtype), alpha=-W.LR) for n, p in params.items()
        }
    zeros = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    draw = noise.add(zeros, sensitivity=W.CLIP)
    return {**frozen, **params}, {n: -W.LR * v / (W.N * W.Q) for n, v in draw.items()}


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return reference_run(W.make_model())


def noise_problems(
    rows: list[dict[str, torch.Tensor]],
    full: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
) -> list[str]:
    """What is wrong with the noise the ranks added (empty: one full-size draw, sliced).

    ``rows[r]``: rank r's local change of each parameter; ``full``: the gathered change;
    ``expected``: the unsharded run's draw. Shards that share a noise stream give rows equal
    across ranks (their difference is released noise-free) and a gathered draw that is not
    the full-size one.
    """
    problems = []
    for name, want in expected.items():
        if not torch.allclose(full[name], want, atol=1e-6, rtol=1e-5):
            problems.append(f"{name}: the gathered noise is not the unsharded run's draw")
        a, b = rows[0][name], rows[1][name]
        if a.shape == b.shape and a.numel() and torch.allclose(a, b):
            problems.append(f"{name}: ranks 0 and 1 added the same noise rows")
    return problems


def test_level2_equals_single_process_bookkeeping(
    basic: list[dict[str, Any]], reference: tuple[dict[str, torch.Tensor], Any]
) -> None:
    """(a) After STEPS seeded steps, the sharded run equals the unsharded book-keeping run."""
    want, _ = reference
    runs = [r["train"] for r in basic]
    assert runs[0]["engine"] == runs[1]["engine"] == "bookkeeping"
    assert runs[0]["sizes"] != runs[1]["sizes"]  # the ranks' shards differ: padding ran
    for name, value in want.items():
        assert torch.equal(runs[0]["params"][name], runs[1]["params"][name]), name
        torch.testing.assert_close(runs[0]["params"][name], value, atol=2e-6, rtol=1e-5)
    assert runs[0]["epsilon"] == runs[1]["epsilon"] > 0


def test_one_example_moves_the_global_clipped_sum_by_at_most_c(
    basic: list[dict[str, Any]],
) -> None:
    """(b) Removing one example (masked out, or dropped from its rank's batch) moves the sum of
    every rank's clipped sums by at most C — and by nearly C: the example is clipped; also
    through grad_fn(reduce_scatter=True)."""
    clip = 0.1
    for result in basic:
        moved = result["one_example"]
        assert 0.99 * clip <= moved["masked"] <= clip * (1 + 1e-6), moved
        assert 0.99 * clip <= moved["dropped"] <= clip * (1 + 1e-5), moved
        # the same bound when each sum is reduce-scattered as it is formed
        assert 0.99 * clip <= moved["in_call_masked"] <= clip * (1 + 1e-6), moved
        assert 0.99 * clip <= moved["in_call_dropped"] <= clip * (1 + 1e-5), moved


def test_aux_holds_this_ranks_rows_and_an_empty_shard_adds_zero(
    basic: list[dict[str, Any]],
) -> None:
    """return_aux: the padding rows that keep the ranks' collectives aligned are not reported;
    an empty shard (rank 1) runs the forward on padding only and contributes exactly zero."""
    assert basic[0]["one_example"]["aux_rows"] == [3, 3, 3]
    assert basic[1]["one_example"]["aux_rows"] == [0, 0, 0]
    assert basic[1]["one_example"]["empty_sum"] == 0.0


def test_noise_rows_are_one_full_size_draw(
    basic: list[dict[str, Any]], reference: tuple[Any, dict[str, torch.Tensor]]
) -> None:
    """(c) An empty global batch: each rank adds its rows of the unsharded run's draw."""
    _, expected = reference
    rows = [r["train"]["noise_rows"] for r in basic]
    full = basic[0]["train"]["noise_full"]
    assert noise_problems(rows, full, expected) == []


@pytest.mark.skipif(
    os.environ.get("OPAKE_TEST_FOUR_RANKS") != "1",
    reason="opt-in (4 fresh interpreters on a 2-core CPU): OPAKE_TEST_FOUR_RANKS=1",
)
def test_four_ranks_equal_single_process_bookkeeping(
    tmp_path: Path, reference: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
) -> None:
    """(a), (c), (d) with 4 ranks: shards of 0 to a few examples (empty ones padded), each rank
    a quarter of every weight's rows; equal to the unsharded run, the noise one full draw."""
    launch("train", tmp_path, world_size=4)
    runs = [
        torch.load(tmp_path / f"train.rank{r}.pt", weights_only=False)["train"] for r in range(4)
    ]
    want, expected = reference
    assert len({tuple(run["sizes"]) for run in runs}) > 1
    for name, value in want.items():
        for run in runs[1:]:
            assert torch.equal(runs[0]["params"][name], run["params"][name]), name
        torch.testing.assert_close(runs[0]["params"][name], value, atol=2e-6, rtol=1e-5)
    for run in runs:
        assert run["reduces"] == [run["n_params"]] * W.STEPS
        assert (run["fsdp_reduces"], run["check_reduces"]) == (0, CHECK_REDUCES)
    rows = [run["noise_rows"] for run in runs]
    for pair in ((0, 1), (1, 2), (2, 3)):
        problems = noise_problems([rows[i] for i in pair], runs[0]["noise_full"], expected)
        assert problems == [], problems


def test_the_noise_check_catches_a_shared_stream() -> None:
    """(c) The check above fails when both shards draw shard-shaped noise from one seed."""
    from opake.dpsgd.noise import GaussianNoise

    shape = (4, 3)
    expected = GaussianNoise(1.0, seed=3).add({"w": torch.zeros(shape)}, sensitivity=1.0)
    shared = [
        GaussianNoise(1.0, seed=3).add({"w": torch.zeros(2, 3)}, sensitivity=1.0) for _ in range(2)
    ]
    full = {"w": torch.cat([shared[0]["w"], shared[1]["w"]])}
    problems = noise_problems(shared, full, expected)
    assert any("same noise rows" in p for p in problems), problems
    sliced = [{"w": expected["w"][:2]}, {"w": expected["w"][2:]}]
    assert noise_problems(sliced, expected, expected) == []


#: FSDP's reductions in the training run: the per-example check's one backward through the
#: module (on the first chunk, once: it agreed), one reduce-scatter per unit (2 blocks, the
#: head, the root)
CHECK_REDUCES = 4


def test_reduction_is_one_sum_per_logical_step(basic: list[dict[str, Any]]) -> None:
    """(d) Two physical batches per rank, one reduce-scatter per parameter per logical step,
    and FSDP itself never reduces the training gradients (its gradient sync is off; the
    backward makes none) — only the gradient of the per-example check's one example."""
    for result in basic:
        run = result["train"]
        assert run["reduces"] == [run["n_params"]] * W.STEPS
        assert (run["fsdp_reduces"], run["check_reduces"]) == (0, CHECK_REDUCES)


def test_reduce_scatter_in_the_call(
    basic: list[dict[str, Any]], reference: tuple[dict[str, torch.Tensor], Any]
) -> None:
    """(d) One physical batch per step: grad_fn(reduce_scatter=True) reduce-scatters each sum
    as it is formed — bit for bit the step's reduce-scatter, once per parameter and step (none
    left to the step), and with one chunk per call one full-size sum alive at a time."""
    want, _ = reference
    for result in basic:
        runs = result["scatter"]
        step, scatter, chunks = runs["step"], runs["scatter"], runs["scatter_chunks"]
        n = step["n_params"] * W.STEPS
        assert step["reductions"] == {"optimizer": n, "grad_fn": 0}
        assert scatter["reductions"] == chunks["reductions"] == {"optimizer": 0, "grad_fn": n}
        assert (step["kinds"], scatter["kinds"]) == (["ClippedGrads"], ["ScatteredGrads"])
        for name, value in want.items():
            assert torch.equal(scatter["params"][name], step["params"][name]), name
            torch.testing.assert_close(scatter["params"][name], value, atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(chunks["params"][name], value, atol=2e-6, rtol=1e-5)
        assert (step["most_alive"], scatter["most_alive"]) == (step["n_params"], 1)


def test_reduce_scatter_is_the_steps_only_physical_batch(basic: list[dict[str, Any]]) -> None:
    for result in basic:
        got = result["scatter"]["misuse"]
        assert got["second_call"].startswith("ConfigurationError: sharded grad_fn(reduce_scatter")
        assert "call 2 of its step" in got["second_call"]
        assert got["after_full"].startswith("OperationError: ShardedDPOptimizer.accumulate()")
        assert got["after_scattered"].startswith("OperationError: ShardedDPOptimizer.accumulate")
        assert got["pending"] == "1"
        assert got["empty"] == got["halved"] == got["after_eval"] == "True"


def test_a_layer_without_a_rule_raises_and_gathers_nothing(basic: list[dict[str, Any]]) -> None:
    """(e) A trainable layer only the vmap fallback matches: ConfigurationError naming it, at
    construction and at a call (before any FSDP all-gather)."""
    for result in basic:
        refused = result["no_rule"]
        assert "no book-keeping rule for norm (Scale" in refused["construction"]
        assert "no book-keeping rule for norm (Scale" in refused["call"]
        assert refused["gathers"] == 0


def test_what_mixes_examples_or_misaligns_the_ranks_is_refused_on_every_rank(
    basic: list[dict[str, Any]],
) -> None:
    """The per-example check (secret rows alone vs. in their batch, agreed by all-gather)
    refuses a batch mean, a Linear with the batch dimension moved and F.batch_norm, then every
    later call; its comparison with plain autograd through the sharded module refuses an
    output head that reads the embedding's weight outside its layer (F.linear: its share of
    the gradient would be lost), and accepts the head tied as a module (after an evaluation
    that left the root unit gathered); a _BatchNorm with batch statistics is refused at
    construction and at each call (also after a first call in eval mode); calls that do not
    line up raise, never hang; a rank that steps while another runs one more physical batch
    makes both raise (the step's line-up meets the extra call's), and after zero_grad() the
    ranks step together again; the optimizer's logical_step runs the level-2 grad_fn; a
    parameter trainable on one rank only is refused on every rank."""
    want = {
        "mix": ("BookkeepingMismatchError", "the loss mixes examples"),
        "mix_again": ("BookkeepingMismatchError", "the loss mixes examples"),
        "functional_bn": ("BookkeepingMismatchError", "alone fails: ValueError"),
        "functional_bn_again": ("BookkeepingMismatchError", "the loss mixes examples"),
        "moved": ("BookkeepingMismatchError", "moves the batch dimension"),
        "tied_functional": ("BookkeepingMismatchError", "'embed.weight': book-keeping norm"),
        "tied_functional_again": ("BookkeepingMismatchError", "tie such a head as a module"),
        "tied_module": ("accepted", ""),
        "bn_no_stats": ("ConfigurationError", "normalises with batch statistics"),
        "bn_eval": ("accepted", ""),
        "bn_train": ("ConfigurationError", "normalises with batch statistics"),
        "microbatch": ("ConfigurationError", "microbatch_size 1..2"),
        "end_step": ("ConfigurationError", "the same number of times per logical step"),
        "plain": ("accepted", ""),
        "out_of_step": ("OperationError", "the ranks are out of step: rank(s) [0] called"),
        "in_step_again": ("accepted", ""),
        "logical_step": ("accepted", ""),
        "names_differ": ("ConfigurationError", "the ranks' trainable parameters differ"),
    }
    for result in basic:
        got = result["refusals"]
        assert set(got) == set(want)
        for case, (kind, text) in want.items():
            assert got[case].startswith(kind), (case, got[case])
            assert text in got[case], (case, got[case])


def test_a_trainable_parameter_the_loss_never_reads_is_reported(
    basic: list[dict[str, Any]],
) -> None:
    for result in basic:
        caught = result["no_rule"]["unread"]
        assert len(caught) == 1, caught
        assert caught[0].startswith("OpakePrivacyWarning")
        assert "spare.weight" in caught[0]


def test_an_unsharded_model_and_unknown_options_are_refused() -> None:
    from opake.core.errors import ConfigurationError, InputTypeError
    from opake.dpsgd.distributed import sharded_clipped_grad

    net = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigurationError, match="no DTensor parameters"):
        sharded_clipped_grad(lambda x: net(x)[:, 0], net, clipping_norm=1.0)
    with pytest.raises(ConfigurationError, match="unknown keyword argument 'clip_norm'"):
        sharded_clipped_grad(lambda x: net(x)[:, 0], net, clipping_norm=1.0, clip_norm=1.0)
    with pytest.raises(InputTypeError, match="expected the fully_shard-ed"):
        sharded_clipped_grad(lambda x: x, "model", clipping_norm=1.0)  # type: ignore[arg-type]


# -- stage 2: LoRA (PEFT) and bf16 parameters ----------------------------------------------


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("sharded_adapters")
    launch("adapters", out)
    return [torch.load(out / f"adapters.rank{r}.pt", weights_only=False) for r in range(2)]


def test_lora_equals_single_process_bookkeeping(adapters: list[dict[str, Any]]) -> None:
    """PEFT LoRA adapters on q, v and the head: only the adapters train, reduced and noised
    like full fine-tuning; the frozen base weights stay what they were (the reference holds
    them unchanged)."""
    want, _ = reference_run(W.make_lora())
    runs = [r["lora"] for r in adapters]
    assert runs[0]["trainable"]
    assert all(".lora_" in n for n in runs[0]["trainable"])
    assert runs[0]["reduces"] == [len(runs[0]["trainable"])] * W.STEPS
    assert runs[0]["reduce_dtypes"] == ["torch.float32"]
    for name, value in want.items():
        assert torch.equal(runs[0]["params"][name], runs[1]["params"][name]), name
        torch.testing.assert_close(runs[0]["params"][name], value, atol=2e-6, rtol=1e-5)


def test_bf16_parameters_reduce_in_fp32(adapters: list[dict[str, Any]]) -> None:
    """bf16 parameters: bf16 forward/backward, fp32 clipped sums, reduce-scatter and noise;
    the update in bf16 as the single-process run makes it."""
    want, _ = reference_run(W.make_model().to(torch.bfloat16))
    runs = [r["bf16"] for r in adapters]
    assert runs[0]["reduce_dtypes"] == runs[1]["reduce_dtypes"] == ["torch.float32"]
    for name, value in want.items():
        assert runs[0]["params"][name].dtype == torch.bfloat16
        assert torch.equal(runs[0]["params"][name], runs[1]["params"][name]), name
        # equal in practice (measured: 0); one bf16 unit in the last place of slack
        torch.testing.assert_close(runs[0]["params"][name], value, atol=1e-6, rtol=2**-7)


# -- stage 3: sharded checkpoints --------------------------------------------------------------


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("sharded_resume")
    launch("resume", out)
    return [torch.load(out / f"resume.rank{r}.pt", weights_only=False) for r in range(2)]


def test_resume_from_a_sharded_checkpoint_is_bit_for_bit(resumed: list[dict[str, Any]]) -> None:
    """AdamW: 3 steps straight == 2 steps, save, a fresh run loads and takes the 3rd step —
    parameters, Adam moments and ε identical. Each rank wrote its shards, rank 0 the DP state."""
    for run in resumed:
        assert run["step"] == 2
        assert run["files"][0] == "dp.pt"
        folders = {name.split("/")[0] for name in run["files"][1:]}
        assert len(folders) == 1  # one shard folder, named for this save
        (folder,) = folders
        assert folder.startswith("shards-2-")
        assert run["files"][1:] == [
            f"{folder}/{f}" for f in (".metadata", "__0_0.distcp", "__1_0.distcp")
        ]
        straight, again = run["straight"], run["resumed"]
        for key in ("params", "exp_avg"):
            assert straight[key].keys() == again[key].keys()
            for name, value in straight[key].items():
                assert torch.equal(value, again[key][name]), (key, name)
        assert straight["epsilon"] == again["epsilon"] > 0


def test_a_save_that_does_not_commit_leaves_the_earlier_checkpoint_whole(
    resumed: list[dict[str, Any]],
) -> None:
    """A second save into the same directory whose dp.pt write fails (a full disk) raises on
    every rank, and the directory still loads the first save whole: its step, its own weights.
    (It used to write the new shards over the old ones: the old dp.pt's accountant then loaded
    with newer weights, ε under-reported — red-team finding, round 5.)"""
    for run in resumed:
        torn = run["torn"]
        assert torn["step"] == 2
        assert torn["params_equal"] is True  # the earlier code: the second save's weights
        assert torn["error"] is not None
        assert "did not commit" in torn["error"]


def test_a_checkpoint_with_pending_sums_is_refused(resumed: list[dict[str, Any]]) -> None:
    for run in resumed:
        assert "not stepped" in run["refused"]
        assert run["pending_written"] is False


def test_bf16_compute_with_fp32_parameters(adapters: list[dict[str, Any]]) -> None:
    """FSDP mixed precision (bf16 gathered parameters and activations, fp32 shards): the sums,
    reduction and update in fp32, as the single-process run with compute_dtype=bf16."""
    want, _ = reference_run(W.make_model(), compute=torch.bfloat16)
    runs = [r["mixed"] for r in adapters]
    assert runs[0]["reduce_dtypes"] == ["torch.float32"]
    for name, value in want.items():
        assert runs[0]["params"][name].dtype == torch.float32
        assert torch.equal(runs[0]["params"][name], runs[1]["params"][name]), name
        torch.testing.assert_close(runs[0]["params"][name], value, atol=2e-6, rtol=1e-5)


def test_the_sharded_engine_never_falls_back_to_vmap() -> None:
    """Fail closed: a call the book-keeping engine cannot run raises, never runs vmap through
    the sharded module (whose per-example gradients would be silently wrong)."""
    from opake.core.errors import OperationError
    from opake.dpsgd.clipping import FixedClipping
    from opake.dpsgd.clipping._tree import DiffTree
    from opake.dpsgd.distributed.sharded._grad_fn import _Engine

    engine = _Engine(
        lambda p, x: (p["w"] * x).sum(),
        argnums=0,
        has_aux=False,
        batch_argnums=(1,),
        microbatch_size=None,
        normalize_by=1.0,
        return_aux=False,
        compute_dtype=None,
        clipping_groups=None,
        randomness="error",
        kind=FixedClipping,
        check_unused=False,
    )
    tree = DiffTree.of({"w": torch.zeros(2)}, argnums=0)
    with pytest.raises(OperationError, match="never falls back to the vmap engine"):
        engine._engine(None, tree, differentiable=False, small=False)


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path: Path) -> None:
    from opake.core.errors import ConfigurationError
    from opake.dpsgd.checkpoint import save_checkpoint
    from opake.dpsgd.distributed.sharded._checkpoint import DP_FILE, RANK_KEY, _own_states

    ranks = [{"sampler": None, "rng": None}] * 4
    extra = {RANK_KEY: {"world_size": 4, "ranks": ranks}}
    save_checkpoint(tmp_path / DP_FILE, step=1, extra=extra, rng=False)
    with pytest.raises(ConfigurationError, match="saved by 4 rank"):
        _own_states(tmp_path, 2, 0, None, True)
    (tmp_path / "shards").mkdir()  # the earlier layout: no folder named in dp.pt
    expected = ({"sampler": None, "rng": None}, "shards", None)  # no file digests either
    assert _own_states(tmp_path, 4, 3, None, True) == expected


def test_a_dp_state_naming_a_folder_it_did_not_write_is_refused(tmp_path: Path) -> None:
    from opake.core.errors import ConfigurationError, OperationError
    from opake.dpsgd.checkpoint import save_checkpoint
    from opake.dpsgd.distributed.sharded._checkpoint import DP_FILE, RANK_KEY, _own_states

    ranks = [{"sampler": None, "rng": None}] * 2
    for folder, error in (("../elsewhere", ConfigurationError), ("shards-3-ab12", OperationError)):
        extra = {RANK_KEY: {"world_size": 2, "ranks": ranks, "shards": folder}}
        save_checkpoint(tmp_path / DP_FILE, step=1, extra=extra, rng=False)
        with pytest.raises(error, match="shard folder"):
            _own_states(tmp_path, 2, 0, None, True)
