"""--max-staleness N (staleness.py) end to end against vLLM's own server: the
session's (tests/test_server.py, shared_server).

Batch j is sampled by weights version max(0, j - 1 - N), as the server reports
it, and trained from version j - 1: N = 0 takes turns (staleness 0 every
step), N = 1 is --async record for record, N = 2 runs two versions behind. A
kill -9 resumes bit-identically (the checkpoint holds the batches drawn
ahead); resumed with a lower N, the batches now too stale are dropped, said in
a line, counted (stale_dropped) and redrawn, and every step is logged once.

The sampler alone (AheadSampler, in-process, a stand-in engine): the sync
never overlaps a draw, draws come in order, and a too-stale batch, also a
checkpoint's of --async before staleness.py, is dropped and redrawn.

    python -m pytest -q tests/test_staleness.py
"""
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_train, without_timings
from test_resume import start_and_kill
from test_server import shared_server

# one worker starts the session's server (--dist loadgroup): test_server.py's group
pytestmark = pytest.mark.xdist_group("vllm_server")


class StandIn:
    """An engine with RemoteEngine's versions whose draws take a while; it
    counts the syncs that came while a draw was in flight."""

    def __init__(self):
        self.version = 0
        self.drawing = 0
        self.overlaps = 0
        self.drawn = []

    def sample(self, offset):
        self.drawing += 1
        time.sleep(0.02)
        self.drawn.append(offset)
        self.drawing -= 1
        return [offset], None, self.version, 0.02

    def stage_weights(self, model):
        pass

    def sync_weights(self, model):
        self.overlaps += self.drawing
        self.version += 1
        return dict(seconds=0.0)


def train_loop(sampler, engine, steps, start=1):
    """train.py's order: take, (update), sync -> each step's (record, times)."""
    steps_done = []
    for step in range(start, steps + 1):
        rows, _, version, _ = sampler.take((step - 1) * 8, step - 1)
        assert rows == [(step - 1) * 8]
        times = {}
        sampler.sync(engine, None, times)
        record = sampler.step_metrics(step - 1 - version, torch.device("cpu"))
        steps_done.append((dict(record, sampler_version=version), times))
    return steps_done


@pytest.mark.parametrize("n", [0, 1, 3])
def test_sampler_alone_draws_in_order_never_during_a_sync(n):
    from engines.staleness import AheadSampler

    engine = StandIn()
    sampler = AheadSampler(engine.sample, n, prompts_per_step=8, steps=6)
    steps = train_loop(sampler, engine, 6)

    assert engine.overlaps == 0
    assert engine.drawn == [8 * k for k in range(6)]
    assert [r["sampler_version"] for r, _ in steps] == [max(0, j - 1 - n) for j in range(1, 7)]
    assert [r["staleness_max"] for r, _ in steps] == [min(j - 1, n) for j in range(1, 7)]
    assert all(r["stale_dropped"] == 0 for r, _ in steps)
    # a wait where batches were drawn ahead: none with n = 0, none at the last step
    assert ["wait" in t for _, t in steps] == [n > 0 and j < 6 for j in range(1, 7)]
    assert sampler.state_dict() == {}


def test_sampler_alone_drops_and_redraws(capsys):
    """Resumed at step 3 with --max-staleness 1 from batches 3 and 4 drawn by
    versions 0 and 1 (a run with 2), and from an older --async checkpoint's one
    batch (a tuple)."""
    from engines.staleness import AheadSampler

    engine = StandIn()
    engine.version = 2
    sampler = AheadSampler(engine.sample, 1, prompts_per_step=8, steps=6)
    sampler.load_state_dict({16: ([16], None, 0, 0.0), 24: ([24], None, 1, 0.0)}, 16)
    steps = train_loop(sampler, engine, 6, start=3)

    assert [r["stale_dropped"] for r, _ in steps] == [1, 1, 0, 0]
    assert [r["sampler_version"] for r, _ in steps] == [2, 3, 3, 4]
    assert engine.drawn == [16, 24, 32, 40]
    out = capsys.readouterr().out
    assert "resumed with 2 batch(es) drawn ahead (--max-staleness 1)" in out
    assert "dropped the batch at prompt 24: sampled by weights version 1, 2 behind" in out

    engine = StandIn()
    engine.version = 2
    old = AheadSampler(engine.sample, 1, prompts_per_step=8, steps=6)
    old.load_state_dict(([16], None, 1, 0.0), 16)
    (record, _), = train_loop(old, engine, 3, start=3)
    assert record["stale_dropped"] == 0 and record["staleness_max"] == 1
    assert engine.drawn == [24]


@pytest.fixture(scope="module")
def server(request, tiny):
    return shared_server(request, tiny)


def server_args(tiny, server, steps, *flags):
    return ["--model", tiny[0], "--vllm-mode", "server", *server.flags,
            "--lr", "3e-4", "--steps", str(steps),
            "--save-every", "2", "--eval-every", "0", "--eval-size", "8",
            "--prompts-per-step", "8", "--max-prompt-len", "16", *flags]


def check_versions(records, n, dropped=()):
    """Steps 1.. once each; batch j sampled by max(0, j - 1 - n) (a redrawn
    one, at the steps in dropped: by j - 1), trained from j - 1."""
    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1)), records

    for r in steps:
        j = r["step"]
        lag = 0 if j in dropped else min(j - 1, n)
        assert r["sampler_version"] == j - 1 - lag, r
        assert r["policy_version"] == j - 1, r
        assert r["staleness"] == r["staleness_mean"] == r["staleness_max"] == lag, r
        assert r["stale_dropped"] == (1 if j in dropped else 0), r


def test_zero_takes_turns(server, tiny, tmp_path):
    """--max-staleness 0: each batch sampled by the weights it trains, nothing
    drawn ahead (no wait for it), the ratio 1: server mode without the flag,
    record for record."""
    _, _, records = run_train(server_args(tiny, server, 3, "--max-staleness", "0"),
                              tmp_path / "zero")
    _, _, plain = run_train(server_args(tiny, server, 3), tmp_path / "plain")

    check_versions(records, 0)
    assert all("time_wait" not in r for r in records), records
    assert all(r["ratio_mean"] == 1 for r in records[1:]), records
    new = ("staleness_mean", "staleness_max", "stale_dropped")
    assert [{k: v for k, v in r.items() if k not in new}
            for r in without_timings(records)] == without_timings(plain)


def test_async_is_max_staleness_1(server, tiny, tmp_path):
    """The same records, versions and weights as --async."""
    _, _, a = run_train(server_args(tiny, server, 4, "--async"), tmp_path / "async")
    _, _, b = run_train(server_args(tiny, server, 4, "--max-staleness", "1"),
                        tmp_path / "one")

    check_versions(b, 1)
    assert without_timings(a) == without_timings(b)
    # drawn ahead: the sync wrote the weights, then waited for the next batch;
    # the last step has none
    assert all("time_stage" in r and "time_wait" in r for r in b[1:-1])
    assert "time_wait" not in b[-1]
    wa = load_file(tmp_path / "async" / "model" / "model.safetensors")
    wb = load_file(tmp_path / "one" / "model" / "model.safetensors")
    assert all((wa[k] == wb[k]).all() for k in wa)


@pytest.fixture(scope="module")
def two_behind(server, tiny, tmp_path_factory):
    """A run of 6 steps with --max-staleness 2 -> (its folder, its records)."""
    out_dir = tmp_path_factory.mktemp("two_behind")
    _, _, records = run_train(server_args(tiny, server, 6, "--max-staleness", "2"), out_dir)
    return out_dir, records


def test_two_versions_behind(two_behind):
    _, records = two_behind

    check_versions(records, 2)


def test_kill_resume_exact_then_lower_bound_drops(two_behind, server, tiny, tmp_path):
    """kill -9 after step 3: the checkpoint of step 2 holds batches 3 and 4
    (versions 0 and 1). Resumed as it was: the uninterrupted run's records and
    weights. Resumed with --max-staleness 1: both are 2 behind when taken, so
    dropped, said, counted and redrawn; steps 1..6 once each."""
    straight_dir, straight = two_behind
    killed = tmp_path / "killed"
    start_and_kill(killed, 1, kill_after_step=3,
                   extra=server_args(tiny, server, 6, "--max-staleness", "2"))
    lowered = tmp_path / "lowered"
    shutil.copytree(killed, lowered)

    _, out, records = run_train(server_args(tiny, server, 6, "--max-staleness", "2"), killed)

    assert "resumed with 2 batch(es) drawn ahead" in out, out[-3000:]
    assert without_timings(records) == without_timings(straight)
    a = load_file(straight_dir / "model" / "model.safetensors")
    b = load_file(killed / "model" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)

    _, out, records = run_train(server_args(tiny, server, 6, "--max-staleness", "1"), lowered)

    check_versions(records[:3], 2)
    check_versions(records, 1, dropped=(3, 4))
    for offset, version in ((16, 0), (24, 1)):
        assert (f"dropped the batch at prompt {offset}: sampled by weights version "
                f"{version}, 2 behind") in out, out[-3000:]


def test_two_ranks(server, tiny, tmp_path):
    """2 trainer ranks (DDP), --max-staleness 2: each rank's batches carry the
    versions one rank's do, the staleness all-reduced over them."""
    _, _, records = run_train(server_args(tiny, server, 4, "--max-staleness", "2"), tmp_path,
                              nproc=2)

    check_versions(records, 2)
