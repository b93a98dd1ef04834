"""--partial-rollouts (server.py simplification 6, staleness.py) against vLLM's
own server: the session's (tests/test_server.py, shared_server, started with
--enable-scale-out).

What is checked:
- the generate route (/inference/v1/generate) samples what /v1/completions
  samples for the same seed, with the same log-probs, each token labelled
  with the version of the last sync;
- a sync in the middle of a generation: the generation goes on, some of its
  completions hold tokens of both versions, and each token's log-prob is its
  own version's (the old weights before the sync, the new after, to TOL): the
  kept requests' KV is recomputed with the new weights;
- train.py end to end: records with token staleness and partial_share,
  nothing dropped, and a kill -9 resumes (every step once);
- the sampler alone: the sync does not wait for the draw in flight;
- refusals, one line each: no --max-staleness N >= 1, a server without
  --enable-scale-out.

    python -m pytest -q tests/test_partial.py
"""
import threading
import time

import pytest
import torch

from helpers import run_train
from test_resume import start_and_kill
from test_server import TOL, client, requests_running, shared_server
from test_staleness import server_args

# one worker starts the session's server (--dist loadgroup): test_server.py's group
pytestmark = pytest.mark.xdist_group("vllm_server")

G = 4
# as long as the test server's rows allow (--max-model-len 64): a generation
# long enough for a sync to land in it
LONG = 48


@pytest.fixture(scope="module")
def server(request, tiny):
    return shared_server(request, tiny)


def logps_by(model, rollout, temperature):
    from test_rollout import trainer_logps

    return trainer_logps(model, rollout, temperature)


def test_generate_route_samples_as_completions(server, tiny):
    """The same seed, the same completions and log-probs through either route;
    every token labelled with the sync's version, -1 past each end."""
    _, model, _, prompts = tiny
    plain = client(server, tiny, seed=3)
    plain.sync_weights(model, version=4)
    versioned = client(server, tiny, seed=3, partial_rollouts=True)
    versioned.version = 4

    a = plain.generate(prompts, G, 10, temperature=0.7)
    b = versioned.generate(prompts, G, 10, temperature=0.7)

    assert torch.equal(a.completion_ids, b.completion_ids)
    assert (a.sampling_logps - b.sampling_logps).abs().max() < TOL
    assert (b.sampling_logps - logps_by(model, b, 0.7)).abs().max() < TOL
    sampled = b.completion_mask.bool()
    assert (b.token_versions[sampled] == 4).all() and (b.token_versions[~sampled] == -1).all()
    assert versioned.weight_version == 4


def test_a_sync_mid_generation_splits_completions(server, tiny):
    """Sync perturbed weights while a long generation runs: it goes on, and each
    token's log-prob is the weights' that its label names."""
    from test_rollout import perturbed

    _, model, _, prompts = tiny
    new = perturbed(model, 2)
    engine = client(server, tiny, partial_rollouts=True)

    for attempt in range(5):
        engine.sync_weights(model, version=10 * attempt)
        result = {}

        def draw():
            result["rollout"] = engine.generate(prompts * 4, G, LONG, temperature=1.0)

        thread = threading.Thread(target=draw)
        thread.start()
        # the sync lands once the requests run
        deadline = time.time() + 30
        while requests_running(server.url, server.cert) == 0 and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        synced = engine.sync_weights(new, keep_in_flight=True)
        thread.join(timeout=120)
        r = result["rollout"]

        versions = r.token_versions  # (N, T)
        sampled = r.completion_mask.bool()  # (N, T)
        old_tokens = sampled & (versions == 10 * attempt)
        new_tokens = sampled & (versions == 10 * attempt + 1)
        assert (old_tokens | new_tokens == sampled).all()
        # a version never goes back within a completion
        assert (versions[:, 1:][sampled[:, 1:]] >= versions[:, :-1][sampled[:, 1:]]).all()
        split = old_tokens.any(1) & new_tokens.any(1)  # (N,)
        if split.any():
            break
    print(f"split {split.sum().item()} of {len(split)} completions, attempt {attempt + 1}, "
          f"sync {synced['seconds']:.2f} s")
    assert split.any(), "no sync landed inside a generation in 5 tries"

    # each token's log-prob is its own version's, given the tokens before it
    old_error = (r.sampling_logps - logps_by(model, r, 1.0))[old_tokens].abs().max()
    new_error = (r.sampling_logps - logps_by(new, r, 1.0))[new_tokens].abs().max()
    print(f"old tokens vs old weights {old_error:.1e}, new tokens vs new weights {new_error:.1e}")
    assert old_error < TOL and new_error < TOL

    engine.sync_weights(model)  # the tiny model's weights back, for the next tests


def test_train_end_to_end_then_resume(server, tiny, tmp_path):
    """--max-staleness 1 --partial-rollouts: token staleness within the bound,
    nothing dropped; killed after step 3, it resumes and logs every step once."""
    flags = ("--max-staleness", "1", "--partial-rollouts", "--max-new-tokens", "24")
    _, _, records = run_train(server_args(tiny, server, 4, *flags), tmp_path / "straight")

    steps = [r for r in records if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 0 <= r["staleness_mean"] <= r["staleness_max"] <= 1, r
        assert 0 <= r["partial_share"] <= 1 and r["stale_dropped"] == 0, r
        assert "time_wait" not in r, r
    # batch 1 is drawn before any step: all version 0, none split
    assert steps[0]["staleness_max"] == 0 and steps[0]["partial_share"] == 0

    killed = tmp_path / "killed"
    start_and_kill(killed, 1, kill_after_step=3, extra=server_args(tiny, server, 6, *flags))
    _, out, records = run_train(server_args(tiny, server, 6, *flags), killed)
    assert [r["step"] for r in records] == list(range(7)), out[-3000:]
    assert "resumed with" in out


def test_sampler_alone_syncs_during_a_draw():
    """Under partial the sync goes at once, a draw in flight (the stand-in
    counts it), and the trainer never waits at the sync."""
    from engines.staleness import AheadSampler

    class SlowStandIn:
        def __init__(self):
            self.version = 0
            self.drawing = 0
            self.overlaps = 0

        def sample(self, offset):
            self.drawing += 1
            time.sleep(0.2)
            self.drawing -= 1
            return [offset], None, self.version, 0.2

        def sync_weights(self, model, keep_in_flight=False):
            assert keep_in_flight
            self.overlaps += self.drawing
            self.version += 1
            return dict(seconds=0.0)

    engine = SlowStandIn()
    sampler = AheadSampler(engine.sample, 1, prompts_per_step=8, steps=4, partial=True)
    for step in range(1, 5):
        sampler.take((step - 1) * 8, step - 1)
        times = {}
        sampler.sync(engine, None, times)
        assert "wait" not in times
    assert engine.overlaps >= 2


def test_token_staleness():
    from engines.staleness import token_staleness

    versions = torch.tensor([[3, 3, 4, -1], [4, 4, 4, 4], [-1, -1, -1, -1]])  # (N, T)
    sums = token_staleness(versions, 5)
    # lags 2 2 1 | 1 1 1 1: 9 over 7 tokens; 3 completions, the first split
    assert sums == [9.0, 7.0, 3.0, 1.0]


def test_refusals(server, tiny, capsys):
    import config
    from engines.server import RemoteEngine

    base = ["--vllm-mode", "server", "--vllm-url", "http://127.0.0.1:1"]
    cases = [
        (base + ["--partial-rollouts"],
         "--partial-rollouts does nothing without --max-staleness N >= 1"),
        (base + ["--max-staleness", "0", "--partial-rollouts"],
         "--partial-rollouts does nothing without --max-staleness N >= 1"),
    ]
    parser = config.parser
    for argv, message in cases:
        args = config.fill_defaults(parser.parse_args(argv))
        with pytest.raises(SystemExit):
            config.check_flags(args)
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and message in out, out

    # a server without --enable-scale-out answers the route with 403
    engine = client(server, tiny)

    def forbidden(path, payload=None, timeout=None):
        error = RuntimeError(f"rollout server {server.url}{path} rejected the request "
                             f"(403: Scale-out endpoints are disabled.)")
        error.status = 403
        raise error

    engine.request = forbidden
    with pytest.raises(ConnectionError, match="start it with --enable-scale-out") as e:
        RemoteEngine.check_generate_route(engine)
    assert "\n" not in str(e.value)
