"""--max-staleness N (staleness.py) end to end against vLLM's own server: the
session's (tests/test_server.py, shared_server).

Batch j is sampled by weights version max(0, j - 1 - N), as the server reports
it, and trained from version j - 1: N = 0 takes turns (staleness 0 every
step), N = 1 is --async record for record, N = 2 runs two versions behind. A
kill -9 resumes bit-identically (the checkpoint holds the batches drawn
ahead); resumed with a lower N, the batches now too stale are dropped, said in
a line, counted (stale_dropped) and redrawn, and every step is logged once.

    python -m pytest -q tests/test_staleness.py
"""
import shutil

import pytest
from safetensors.torch import load_file

from helpers import run_train, without_timings
from test_resume import start_and_kill
from test_server import API_KEY, shared_server

# one worker starts the session's server (--dist loadgroup): test_server.py's group
pytestmark = pytest.mark.xdist_group("vllm_server")


@pytest.fixture(scope="module")
def server(request, tiny):
    return shared_server(request, tiny)


def server_args(tiny, server, steps, *flags):
    return ["--model", tiny[0], "--vllm-mode", "server", "--vllm-url", server.url,
            "--vllm-api-key", API_KEY, "--lr", "3e-4", "--steps", str(steps),
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
    drawn ahead (no wait for it), the ratio 1 (on-policy, as server mode
    without the flag)."""
    _, _, records = run_train(server_args(tiny, server, 3, "--max-staleness", "0"),
                              tmp_path)

    check_versions(records, 0)
    assert all("time_wait" not in r for r in records), records
    assert all(r["ratio_mean"] == 1 for r in records[1:]), records


def test_async_is_max_staleness_1(server, tiny, tmp_path):
    """The same records, versions and weights as --async."""
    _, _, a = run_train(server_args(tiny, server, 4, "--async"), tmp_path / "async")
    _, _, b = run_train(server_args(tiny, server, 4, "--max-staleness", "1"),
                        tmp_path / "one")

    check_versions(b, 1)
    assert without_timings(a) == without_timings(b)
    # drawn ahead: the sync waited for the next batch; the last step has none
    assert all("time_wait" in r for r in b[1:-1]) and "time_wait" not in b[-1]
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
