"""DAPO dynamic sampling (train.py --dynamic-sampling, variants/dynamic_sampling.py).

In-process: which groups a step keeps from its rounds. End to end on 2 ranks, with
a reward whose zero-spread groups are known from the prompts: the rounds and kept
groups of every step, and a resume from a checkpoint that is bit-identical to the
run that went straight on. The same 2-rank run also checks pass@k end to end
(tests/test_pass_at_k.py holds the estimator's own tests).
"""
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

import data
import task
from helpers import run_train, without_timings
from known_rewards import EVAL_SAMPLES, correct_samples, informative
from rollout import Rollout
from variants.dynamic_sampling import dynamic_sampling, with_dynamic_sampling

# one worker builds the 2-rank run once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_dynamic_sampling")

PAD = 0


def make_round(prompts, rewards, G, T):
    """One round of a rank: (rows, Rollout, rewards (n*G, F)) for the prompts.

    Completion i, the g-th of its prompt, is token 10 * (its prompt's index) + g + 1,
    1 + i % T times. rewards: one list of F values per completion.
    """
    rows = [{"prompt": p} for p in prompts for _ in range(G)]
    ids = torch.full((len(rows), T), PAD)  # (N, T)
    mask = torch.zeros(len(rows), T)  # (N, T)

    for i in range(len(rows)):
        length = 1 + i % T
        ids[i, :length] = 10 * (i // G) + i % G + 1
        mask[i, :length] = 1

    prompt_ids = [[ord(p[0])] for p in prompts for _ in range(G)]
    texts = [f"{p}#{g}" for p in prompts for g in range(G)]
    rollout = Rollout(prompt_ids, ids, mask, mask * -0.5, mask[:, -1] == 0, texts)
    return rows, rollout, torch.tensor(rewards, dtype=torch.float32)


def groups_of(rollout, G):
    return [text.split("#")[0] for text in rollout.texts[::G]]


def test_keeps_informative_groups_in_order_and_pads_rounds_to_one_length():
    """Spread is judged on the weighted total, and rounds are padded to one length.

    Two functions that disagree can sum to equal totals. A quota of 3 groups takes
    3 rounds here, and the groups of rounds of different lengths come out padded to
    the longest.
    """
    G = 2
    nan = float("nan")
    weights = [1.0, 1.0]

    r1_rewards = [[1, 0], [0, 0], [1, 1], [1, 1], [0, 1], [1, 0]]
    r1 = make_round(["a", "b", "c"], r1_rewards, G, T=3)
    # totals (weights 1, 1): a 1, 0 (spread); b 2, 2 (equal);
    # c 1, 1 (equal, though each function's spread)
    # 1 of a quota of 3: another round
    assert dynamic_sampling([r1], 3, G, weights, PAD) is None

    r2_rewards = [[0, 0], [2, 0], [nan, nan], [nan, nan], [5, 0], [0, 5]]
    r2 = make_round(["d", "e", "f"], r2_rewards, G, T=5)
    # d 0, 2 (spread); e no reward at all (no spread); f 5, 5 (equal)
    assert dynamic_sampling([r1, r2], 3, G, weights, PAD) is None

    r3_rewards = [[0, 0], [0, 0], [0, 1], [0, 0], [3, 0], [1, 0]]
    r3 = make_round(["g", "h", "i"], r3_rewards, G, T=2)
    (rows, rollout, rewards), stats = dynamic_sampling([r1, r2, r3], 3, G, weights, PAD)

    # the first 3 informative groups, in the order drawn: i dropped
    assert groups_of(rollout, G) == ["a", "d", "h"]
    assert stats == dict(ds_rounds=3, ds_groups_generated=9, ds_groups_informative=3)
    assert [r["prompt"] for r in rows] == ["a", "a", "d", "d", "h", "h"]
    assert rollout.prompt_ids == [[ord("a")]] * 2 + [[ord("d")]] * 2 + [[ord("h")]] * 2
    kept = [[1, 0], [0, 0], [0, 0], [2, 0], [0, 1], [0, 0]]
    assert torch.equal(rewards, torch.tensor(kept, dtype=torch.float32))
    assert rollout.completion_ids.shape == (6, 5)
    assert rollout.completion_mask.shape == (6, 5)
    assert rollout.sampling_logps.shape == (6, 5)

    # each group against its round's rows
    for k, ((_, part, _), g) in enumerate([(r1, 0), (r2, 0), (r3, 1)]):
        src = slice(g * G, (g + 1) * G)
        dst = slice(k * G, (k + 1) * G)
        t = part.completion_ids.shape[1]

        for name in ("completion_ids", "completion_mask", "sampling_logps"):
            got = getattr(rollout, name)[dst, :t]
            assert torch.equal(got, getattr(part, name)[src]), name
        assert (rollout.completion_ids[dst, t:] == PAD).all()
        assert (rollout.completion_mask[dst, t:] == 0).all()
        assert (rollout.sampling_logps[dst, t:] == 0).all()
        assert torch.equal(rollout.is_finished[dst], part.is_finished[src])
        assert rollout.texts[dst] == part.texts[src]


def test_at_the_bound_tops_up_with_zero_spread_groups_of_the_last_round():
    G = 2
    r1 = make_round(["a", "b"], [[1], [0], [1], [1]], G, T=2)  # a spread, b equal
    r2 = make_round(["c", "d"], [[0], [0], [1], [1]], G, T=3)  # both equal

    (rows, rollout, rewards), stats = dynamic_sampling([r1, r2], 2, G, [1.0], PAD)

    # a, then c topped up from the last round (b was in round 1)
    assert groups_of(rollout, G) == ["a", "c"]
    assert stats == dict(ds_rounds=2, ds_groups_generated=4, ds_groups_informative=1)
    assert rollout.completion_ids.shape == (4, 3)


def test_the_wrapped_round_draws_rounds_along_the_prompt_stream_until_the_quota():
    """with_dynamic_sampling around a round function: it draws rounds where the last
    one's prompts end, as many as dynamic_sampling asks for, and returns its batch,
    the prompts of every round and the last round's stats with the ds_ ones."""
    G = 2
    weights = [1.0]
    # per round, (quota = 2 groups): informative groups a; none; c (then the quota)
    rounds = [make_round(["a", "b"], [[1], [0], [1], [1]], G, T=2),
              make_round(["x", "y"], [[0], [0], [1], [1]], G, T=3),
              make_round(["c", "d"], [[0], [1], [2], [2]], G, T=2)]
    asked = []

    def sample_and_score(consumed):
        asked.append(consumed)
        return rounds[len(asked) - 1], 2, {"round": len(asked)}

    sample = with_dynamic_sampling(sample_and_score, 3, G, weights, PAD,
                                   "sum_then_normalize")
    batch, drawn, stats = sample(10)

    assert asked == [10, 12, 14]
    assert drawn == 6
    expected = dynamic_sampling(rounds, 3, G, weights, PAD)
    assert groups_of(batch[1], G) == groups_of(expected[0][1], G) == ["a", "c"]
    assert batch[0] == expected[0][0] and torch.equal(batch[2], expected[0][2])
    assert torch.equal(batch[1].completion_ids, expected[0][1].completion_ids)
    assert stats == dict(round=3, ds_rounds=3, ds_groups_generated=6,
                         ds_groups_informative=2)

    # at the bound: 2 rounds, a topped up with x from the last
    asked.clear()
    batch, drawn, stats = with_dynamic_sampling(sample_and_score, 2, G, weights, PAD,
                                                "sum_then_normalize")(0)
    assert asked == [0, 2] and drawn == 4
    assert groups_of(batch[1], G) == ["a", "x"]
    assert stats["ds_rounds"] == 2 and stats["ds_groups_informative"] == 1


def test_off_returns_the_one_round_untouched():
    r1 = make_round(["a", "b"], [[1], [1], [1], [1]], 2, T=2)
    assert dynamic_sampling([r1], 0, 2, [1.0], PAD) == (r1, {})


# -----------------------------------------------------------------------------
# End to end: 2 ranks, 6 steps of 4 prompts (2 per rank) x G=4, at most 2 rounds a step
STEPS = 6
PER_STEP = 4
WORLD = 2
ROUNDS = 2
EVAL_SIZE = 8
SEED = 0
ARGS = ["--engine", "hf", "--steps", STEPS, "--prompts-per-step", PER_STEP, "--G", 4,
        "--dynamic-sampling", ROUNDS,
        "--rewards", "known_rewards.spread_if_first_digit_low",
        "--save-every", 2, "--keep-last", 10,
        "--eval-every", 3, "--eval-size", EVAL_SIZE, "--seed", SEED,
        "--eval-reward", "known_rewards.first_samples_pass",
        "--eval-samples", EVAL_SAMPLES, "--eval-k", 1, 2, 4]


def expected_rounds():
    """[(rounds, informative groups kept)] of each step, replayed from the prompt stream.

    A round is every rank's share of the next prompts. One is drawn while any rank
    holds fewer informative groups than its quota, at most ROUNDS.
    """
    rows = task.make_sort_dataset(3, num_test=EVAL_SIZE, seed=SEED)[0]
    quota = PER_STEP // WORLD
    consumed = 0
    steps = []

    for _ in range(STEPS):
        have = [0] * WORLD
        rounds = 0
        while rounds < ROUNDS and (rounds == 0 or min(have) < quota):
            for rank in range(WORLD):
                idx = data.batch_indices(len(rows), consumed, PER_STEP, rank, WORLD, SEED)
                have[rank] += sum(informative(rows[i]["prompt"]) for i in idx)
            consumed += PER_STEP
            rounds += 1
        steps.append((rounds, sum(min(h, quota) for h in have)))

    return steps


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dyn") / "out"
    _, log, records = run_train(ARGS, out, nproc=WORLD)
    return out, log, records


def test_steps_hold_the_informative_groups_of_their_rounds(run):
    _, _, records = run
    steps = expected_rounds()

    # the replay covers all three cases: filled in one round, filled in a second
    # round, short at the bound
    assert (1, PER_STEP) in steps, steps
    assert (2, PER_STEP) in steps, steps
    assert any(kept < PER_STEP for _, kept in steps), steps

    got = [(r["ds_rounds"], r["ds_groups_informative"]) for r in records[1:]]
    assert got == steps

    for r, (rounds, kept) in zip(records[1:], steps):
        assert r["ds_groups_generated"] == rounds * PER_STEP
        # the batch: the kept groups (rewards 0, 1, 0, 1: mean 1/2) and the
        # topped-up ones (all 0)
        assert r["frac_zero_std_groups"] == pytest.approx(1 - kept / PER_STEP)
        assert r["reward_mean"] == pytest.approx(0.5 * kept / PER_STEP)


def test_resume_with_dynamic_sampling_is_bit_identical(run, tmp_path):
    """Resume from the step-2 checkpoint: the run goes on exactly as the straight one.

    The prompts consumed come back with the checkpoint (steps 1-2 drew 3 rounds,
    not 2). So the rest of the run draws, logs and trains exactly as the run that
    went straight on.
    """
    out, _, straight = run

    crashed = tmp_path / "crashed"
    shutil.copytree(out, crashed)
    shutil.rmtree(crashed / "model")
    for step in (4, 6):
        shutil.rmtree(crashed / "checkpoints" / f"step_{step:06d}")

    _, log, resumed = run_train(ARGS, crashed, nproc=WORLD)
    assert "(step 2)" in log and "resuming from" in log, log[-2000:]
    assert without_timings(resumed) == without_timings(straight)
    assert len(resumed) == STEPS + 1

    a = load_file(out / "model" / "model.safetensors")
    b = load_file(crashed / "model" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pass_at_k_of_known_rewards_over_prompts_and_ranks(run):
    """Every evaluation logs pass@k, the mean over all ranks' prompts.

    first_samples_pass passes c(p) of the EVAL_SAMPLES samples of held-out prompt
    p, and the greedy completion when c(p) >= 1. pass@k is the mean over all ranks'
    prompts of 1 - C(n-c, k) / C(n, k).
    """
    _, log, records = run
    held_out = task.make_sort_dataset(3, num_test=EVAL_SIZE, seed=SEED)[1]
    prompts = [r["prompt"] for r in held_out]

    # a rank's share has no prompt twice in a row: first_samples_pass counts runs
    for rank in range(WORLD):
        share = prompts[rank::WORLD]
        assert all(a != b for a, b in zip(share, share[1:]))

    c = [correct_samples(p) for p in prompts]
    # c = 0 and c = n among them
    assert 0 in c and EVAL_SAMPLES in c

    n = EVAL_SAMPLES
    expected = {}
    for k in (1, 2, 4):
        passes = [1 - math.comb(n - ci, k) / math.comb(n, k) for ci in c]
        expected[f"pass@{k}"] = sum(passes) / len(c)
    expected["eval_greedy"] = sum(ci >= 1 for ci in c) / len(c)
    expected["eval_sampled"] = sum(c) / (n * len(c))

    evals = [r for r in records if "eval_greedy" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    for r in evals:
        assert {k: r[k] for k in expected} == pytest.approx(expected), r
    line = f"pass@1 {expected['pass@1']:.3f} pass@2 {expected['pass@2']:.3f} pass@4"
    assert line in log
