"""
Bounded staleness in server mode (TRL 1.19's AsyncGRPOTrainer, max_staleness):
AheadSampler draws the next batches from vLLM's server while the trainer
updates, up to N weight versions ahead of it. train.py builds one per rank with
--max-staleness N (--async is --max-staleness 1: attach), and logs each step's
versions in server mode (version_logger); a default run never imports this
file.

    python train.py --model DIR --vllm-mode server --vllm-url URL --max-staleness 2

Batch j (1, 2, ...) holds the prompts at offset (j - 1) x --prompts-per-step
(data.batch_indices) and is trained at step j, from weights version j - 1 (the
version the last sync named: server.RemoteEngine). When the trainer takes
batch j, the sampler is asked for the batches up to j + N; the sync after the
step waits for them. So batch j is sampled by version max(0, j - 1 - N) and is
exactly min(j - 1, N) versions stale:
- N = 0: sampling and training take turns (server mode without the flag);
- N = 1: today's --async (verl's one-step-off-policy): batch j + 1 is sampled
  while step j updates, with the weights before it.
A batch more than N versions behind the trainer when taken is dropped, said in
one line, counted in the step's record (stale_dropped) and redrawn (the same
prompts, the current weights). That happens when a run resumes with a lower
--max-staleness than its checkpoint's batches were drawn with.

--partial-rollouts (verl's partial rollout): the sync does not wait for the
draws in flight. It pauses them on the server, sends the weights, and they go
on with the new ones (server.py simplification 6), so a batch's later tokens
are fresher than its first. Each token's version comes back with it; the
step's staleness is then over tokens (staleness_mean, staleness_max: its
oldest token), partial_share is the share of completions whose tokens two or
more versions sampled, and the drop rule looks at the oldest token. The price:
which tokens a sync splits depends on timing, so runs do not repeat bit for bit.

Tests: python -m pytest -q tests/test_staleness.py tests/test_async.py tests/test_partial.py

Simplifications:
1. One draw at a time per rank, in the order asked (a chain of background
   calls, each waiting for the one before). vLLM batches the ranks' requests,
   and each draw's prompts already go out many at once (server.py).
2. A sync never overlaps a draw of its rank: sync() first waits for every draw
   asked so far, and no draw is asked for until the next take. Two reasons: a
   draw during the reload would mix two weight versions in one batch, under
   the one version the server reports after it; and which weights sampled a
   batch would depend on timing, not on the step. The price: when the sampler
   is the slower side, the trainer waits at the sync for it (time_wait), as it
   would at the next take. What it buys: each batch's version is a function of
   its step, so runs repeat bit for bit and resume exactly. The trainer's
   share of the sync comes first: it writes the weights' file
   (server.RemoteEngine.stage_weights, time_stage) while the server still
   samples; the server's reload alone falls between two draws.
3. The checkpoint (after the sync: no draw in flight) holds the drawn batches
   not yet trained, each with its version; a resumed run trains on them. One
   that resumes with a lower --max-staleness drops those now too stale, at
   their take, and redraws them.
4. Staleness is in weight versions (one per step's sync), as TRL's. With one
   batch a step and every rank's batch drawn in step, the step's mean and max
   over ranks are equal; both are logged, as all-reduced.
"""
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist

from common import ddp, print0
from engines.background import in_background, result_everywhere


def attach(sample, engine, times, args, policy_version, pending=None, next_offset=0):
    """train.py's set-up for --max-staleness N -> (the AheadSampler; its take,
    which the loop calls as sample; its sync, as sync_weights).

    sample: train.py's; times: the step's seconds by phase, which the sync adds
    the trainer's wait to; pending: a resumed checkpoint's batches drawn ahead
    (None: a new run), the next step's at next_offset.
    """
    sampler = AheadSampler(sample, args.max_staleness, args.prompts_per_step, args.steps,
                           args.partial_rollouts, policy_version=policy_version)
    if pending is not None:
        sampler.load_state_dict(pending, next_offset)

    def sync_weights(model):
        """Once the batches asked for are in: times' wait is the trainer's for them."""
        return sampler.sync(engine, model, times)

    return sampler, sampler.take, sync_weights


class AheadSampler:
    def __init__(self, sample, max_staleness, prompts_per_step, steps, partial=False,
                 policy_version=0):
        """sample(offset) -> (rows, rollout, weight version, seconds): one
        batch of train.py's, the prompts at offset. max_staleness: N. The
        last batch is at offset (steps - 1) x prompts_per_step. partial:
        --partial-rollouts (the rollouts then carry token_versions).
        policy_version: the trainer's weights version now (the steps done);
        each sync advances it."""
        self.sample = sample
        self.policy_version = policy_version
        self.max_staleness = max_staleness
        self.prompts_per_step = prompts_per_step
        self.steps = steps
        self.partial = partial
        # the last batch taken, under partial: token_staleness()
        self.token_lag = None
        # offset -> a Future of its batch: drawn, or being drawn
        self.batches = {}
        # the last draw asked for: the next waits for it (engines/staleness.py, simplification 1)
        self.last = None
        # batches dropped since the last record
        self.dropped = 0

    def draw(self, offset):
        """Ask for the batch at offset, after the draws asked before."""
        before = self.last

        def in_turn():
            if before is not None:
                # its error is raised where its batch is taken
                before.exception()
            return self.sample(offset)

        self.batches[offset] = self.last = in_background(in_turn)

    def take(self, offset, policy_version=None):
        """The batch at offset, for the trainer at policy_version (this step's
        weights; None: the version the syncs so far left). Asks for the batches
        up to N steps ahead; drops and redraws one more than N versions behind
        (each rank takes the same verdict: their batches are drawn in step)."""
        if policy_version is None:
            policy_version = self.policy_version
        if offset not in self.batches:
            self.draw(offset)

        while True:
            batch = result_everywhere(self.batches.pop(offset))
            lag = policy_version - batch[2]
            if lag <= self.max_staleness:
                break
            self.dropped += 1
            print0(f"dropped the batch at prompt {offset}: sampled by weights version "
                   f"{batch[2]}, {lag} behind the trainer's {policy_version}, more than "
                   f"--max-staleness {self.max_staleness}; redrawn")
            self.draw(offset)
        if self.partial and getattr(batch[1], "token_versions", None) is not None:
            self.token_lag = token_staleness(batch[1].token_versions, policy_version)

        # the batches up to N steps ahead, the last step's included
        last = (self.steps - 1) * self.prompts_per_step
        ahead = offset + self.max_staleness * self.prompts_per_step
        for later in range(offset + self.prompts_per_step, min(ahead, last) + 1,
                           self.prompts_per_step):
            if later not in self.batches:
                self.draw(later)
        return batch

    def sync(self, engine, model, times):
        """engine.sync_weights(model) once every draw asked for is in
        (engines/staleness.py, simplification 2) -> its result. times["wait"]: the seconds the
        trainer waited for them, where batches are drawn ahead. Under
        --partial-rollouts at once: the draws in flight pause meanwhile."""
        self.policy_version += 1
        if self.partial:
            return engine.sync_weights(model, keep_in_flight=True)

        if self.batches:
            # the trainer writes the weights while the server samples
            t0 = time.time()
            engine.stage_weights(model)
            times["stage"] = time.time() - t0
            times["wait"] = wait_for(self.last)
        # one verdict on every rank for each batch drawn ahead (the same count
        # on every rank)
        for offset in sorted(self.batches):
            result_everywhere(self.batches[offset])
        return engine.sync_weights(model)

    def step_metrics(self, lag, device):
        """The step's staleness (versions) over all ranks, and the batches
        dropped since the last record."""
        # staleness summed, over how many, the completions, how many are split;
        # the largest is lag's: under --partial-rollouts, the oldest token's
        sums = [float(lag), 1.0, 0.0, 0.0]
        if self.token_lag is not None:  # --partial-rollouts: over the tokens
            sums = self.token_lag
        totals = torch.tensor(sums, device=device, dtype=torch.float64)
        worst = torch.tensor([float(lag)], device=device, dtype=torch.float64)
        if ddp:
            dist.all_reduce(totals)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)

        metrics = dict(staleness_mean=(totals[0] / totals[1]).item(),
                       staleness_max=worst.item(), stale_dropped=self.dropped)
        if self.token_lag is not None:
            metrics["partial_share"] = (totals[3] / totals[2]).item()
        self.dropped = 0
        return metrics

    def state_dict(self):
        """The batches drawn and not yet trained (after a sync: none in flight),
        by offset, for the checkpoint (engines/staleness.py, simplification 3)."""
        return {offset: future.result() for offset, future in sorted(self.batches.items())}

    def load_state_dict(self, pending, next_offset):
        """A checkpoint's batches, trained when their steps come; next_offset:
        the next step's prompts. Its staleness bound may have been higher: take()
        drops what is now too stale."""
        if isinstance(pending, tuple):
            # a checkpoint of --async before this file: the next step's batch
            pending = {next_offset: pending}
        for offset, batch in sorted((pending or {}).items()):
            self.batches[offset] = done(batch)
        print0(f"resumed with {len(self.batches)} batch(es) drawn ahead "
               f"(--max-staleness {self.max_staleness})")


def version_logger(sampler, device):
    """train.py's step logger in server mode: which weights sampled the step's
    batch (sampler_version, from the server), which trained on it
    (policy_version), and the staleness between; with --max-staleness, the
    sampler's numbers over all ranks (AheadSampler.step_metrics)."""
    def log_versions(step, record, rows, rollout, rewards, advantages):
        lag = step - 1 - record["sampler_version"]
        record.update(policy_version=step - 1, staleness=lag)
        if sampler:  # staleness_mean, staleness_max (all ranks), stale_dropped
            record.update(sampler.step_metrics(lag, device))

    return log_versions


def token_staleness(versions, policy_version):
    """(N, T) the version of each sampled token, -1 past each end (server.py's
    VersionedRollout) -> [their staleness summed, the tokens, the completions,
    those two or more versions sampled]."""
    sampled = versions >= 0  # (N, T)
    lag = (policy_version - versions)[sampled]  # (tokens,)
    oldest = versions.masked_fill(~sampled, policy_version + 1).amin(1)  # (N,)
    split = versions.amax(1) > oldest  # (N,)
    sums = [lag.sum().item(), lag.numel(), versions.shape[0], split.sum().item()]
    return [float(x) for x in sums]


def done(result):
    """A Future that holds result."""
    future = Future()
    future.set_result(result)
    return future


def wait_for(future):
    """Seconds until future is done (its error, if any, is raised at its take)."""
    t0 = time.time()
    future.exception()
    return time.time() - t0
