"""
Rollout: sample G completions per prompt from the policy, with the sampler's own logprobs

    sampling_logps[i, t] = log softmax(process(logits_t) / temperature)[c]
    where c = completion_ids[i, t], the token sampled at step t of completion i

process: the repetition penalty, then min-p, top-k, top-p after the
temperature (sampling/truncation.py's kept_tokens). This is what the trainer
recomputes (model.selective_log_softmax, on logits truncated by
sampling/truncation.py when a filter is on), but for the repetition penalty. Raw logprobs are not (trl#4159).

This file holds the Rollout, the engine interface (Engine), the plain HF decode
loop (HFEngine) and make_engine. vLLM in the training process is
engines/vllm_engine.py (VLLMEngine); vLLM's own server on other machines is
engines/server.py (RemoteEngine).

Tests: python -m pytest -q tests/test_rollout*.py; benchmark: python -m bench rollout

Simplifications:
1. Each generate call samples from torch's global RNG on a private stream
   seeded by (seed, call number), and the trainer's RNG is restored. Never a
   seed per request: a prompt's G completions would match.
2. Under torchrun, one engine per rank. tensor_parallel_size N groups N
   consecutive ranks in one engine (VLLMEngine).
3. Both engines filter in vLLM 0.32's order: the repetition penalty (on the
   prompt's and completion's tokens), the temperature, min-p, top-k, then top-p
   over what is left. Greedy applies the penalty only.
4. HFEngine is gpt-fast's decode loop, plainly: each completion prefills its
   own copy of the prompt, transformers' cache grows a token a step, and every
   row steps until the last one ends. No paging. --fast (the default) swaps in
   fast/decode.py's loop: the same completions for the same uniforms, faster.
"""
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common import all_ranks_ok, private_rng, unwrap
from model import pad_id, sequence_batch, truncates


@dataclass
class Rollout:
    # (N,) each completion's prompt: each prompt G times
    prompt_ids: list[list[int]]
    # (N, T) long, right-padded with the pad id
    completion_ids: torch.Tensor
    # (N, T) float, 1 up to and including EOS (0 at tool outputs)
    completion_mask: torch.Tensor
    # (N, T) float32, the sampler's logprobs, 0 where masked
    sampling_logps: torch.Tensor
    # (N,) bool, EOS sampled (False: cut at max_new_tokens)
    is_finished: torch.Tensor
    # (N,) completions decoded up to (excluding) EOS
    texts: list[str]

    def reward_columns(self):
        """What this rollout adds to the reward functions' columns (reward.score):
        nothing here; the tools' ToolRollout adds its calls and environment rewards."""
        return {}

    def conversations(self):
        """Each completion as the conversation a reward function gets for a chat
        dataset: one assistant turn (the tools': their assistant and tool turns)."""
        return [[{"role": "assistant", "content": text}] for text in self.texts]


def build_rollout(prompt_ids, G, completions, logps, finished, pad_id, tokenizer):
    """Lists per completion -> a padded Rollout on CPU.

    The lists: each completion's token ids, their logprobs, and whether it
    reached EOS.
    """
    lengths = torch.tensor([len(c) for c in completions])  # (N,)
    mask = torch.arange(max([1] + lengths.tolist())) < lengths[:, None]  # (N, T)

    flat_ids = torch.tensor(list(itertools.chain(*completions)), dtype=torch.long)
    flat_logps = torch.tensor(list(itertools.chain(*logps)), dtype=torch.float32)
    completion_ids = torch.full(mask.shape, pad_id)  # (N, T)
    completion_ids.masked_scatter_(mask, flat_ids)
    sampling_logps = torch.zeros(mask.shape)  # (N, T)
    sampling_logps.masked_scatter_(mask, flat_logps)

    without_eos = [ids[:-1] if f else ids for ids, f in zip(completions, finished)]
    texts = tokenizer.batch_decode(without_eos, skip_special_tokens=True)

    every_prompt = [p for p in prompt_ids for _ in range(G)]
    is_finished = torch.tensor(finished, dtype=torch.bool)
    return Rollout(every_prompt, completion_ids, mask.float(), sampling_logps,
                   is_finished, texts)


def call_seed(seed, call):
    """The seed of generate call number `call`: distinct per (seed, call) below a
    million calls."""
    return seed * 1_000_003 + call


def process_logits(logits, seen, temperature, top_p=1.0, top_k=0, min_p=0.0,
                   repetition_penalty=1.0):
    """(N, V) fp32 logits -> scores to sample from, -inf where filtered.

    Greedy (temperature 0) leaves them unfiltered. seen (N, S): the tokens so far.
    Diverged logits are clamped: sampling goes on, as vLLM's does.
    """
    # a new tensor: the rest works on it in place
    scores = logits.nan_to_num(0.0).clamp_(-1e4, 1e4)  # (N, V)

    # CTRL (arXiv:1909.05858): a seen logit / penalty if > 0, else x penalty
    if repetition_penalty != 1.0:
        s = scores.gather(1, seen)
        penalized = torch.where(s < 0, s * repetition_penalty, s / repetition_penalty)
        scores = scores.scatter(1, seen, penalized)

    if temperature == 0:
        return scores
    scores = scores.div_(temperature)

    # min-p, top-k, top-p in vLLM's order: the trainer replays the same filter
    # (sampling/truncation.py)
    if truncates(top_k, top_p, min_p):
        from sampling.truncation import filtered_scores

        scores = filtered_scores(scores, top_k, top_p, min_p)  # (N, V)
    return scores



def sample_tokens(scores, uniforms=None):
    """One token a row from p = softmax(scores) -> (N,) tokens and (N,) their
    log p. scores (N, V), -inf where filtered.

    uniforms (N, 1) fp64 in [0, 1): inverse transform sampling, the first token
    whose cumulative probability exceeds u
    (https://en.wikipedia.org/wiki/Inverse_transform_sampling). A token of
    probability 0 spans an empty interval: never drawn. None: the argmax
    (greedy).
    """
    logp = scores.log_softmax(-1)  # (N, V)
    if uniforms is None:
        token = scores.argmax(-1)  # (N,)
    else:
        cdf = logp.exp().double().cumsum(-1)  # (N, V)
        token = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True)[:, 0]  # (N,)
        # u rounded up to the total mass: the last token
        token = token.clamp(max=scores.shape[1] - 1)
    return token, logp.gather(1, token[:, None])[:, 0]


class Engine:
    """A rollout engine. generate samples through the subclass's sample.

    sample(prompts, n, max_new_tokens, rng_seed, ...) -> ids, logps, finished.
    """

    calls = 0  # generate calls so far: the position in the sampling streams
    tp_group = None  # the tensor-parallel group sharing this engine (rollout.py, simplification 2)
    tp_rank = 0

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, **sampling):
        """G completions per prompt, each until EOS or max_new_tokens.

        sampling: top_p, top_k, min_p, repetition_penalty. Temperature 0: one
        greedy completion, repeated G times.
        """
        # the group's shards sample all its ranks' prompts at once
        everyone = [prompt_ids]
        if self.tp_group is not None:
            everyone = [None] * dist.get_world_size(self.tp_group)
            dist.all_gather_object(everyone, prompt_ids, group=self.tp_group)
        prompts = sum(everyone, [])  # (B,) the group's prompts, rank after rank

        token_lists = all(isinstance(p, list) and p and isinstance(p[0], int)
                          for p in prompts)
        if not prompts or not token_lists:
            raise ValueError("prompt_ids must be a non-empty list of non-empty lists of "
                             "token ids, e.g. tokenizer(prompts)['input_ids']")
        if G < 1 or max_new_tokens < 1:
            raise ValueError(f"G ({G}) and max_new_tokens ({max_new_tokens}) "
                             f"must be >= 1")

        if temperature == 0:
            n = 1
        else:
            n = G
        seed = call_seed(self.seed, self.calls)
        lists = self.sample(prompts, n, max_new_tokens, seed, temperature=temperature,
                            **sampling)
        self.calls += 1

        # this rank's completions, each repeated G // n times
        start = sum(map(len, everyone[: self.tp_rank])) * n
        stop = start + len(prompt_ids) * n
        lists = [[x for x in xs[start:stop] for _ in range(G // n)] for xs in lists]
        return build_rollout(prompt_ids, G, *lists, self.pad_id, self.tokenizer)

    def sleep(self):
        """Free what the engine holds until the next sync_weights, if it can."""

    def state_dict(self):
        return dict(calls=self.calls)

    def load_state_dict(self, state):
        self.calls = state["calls"]

    def close(self):
        pass


def as_lists(tokens, logps, lengths, done):
    """A decode loop's steps -> (completions, their log-probs, finished), lists
    of N: tokens and logps a (N,) tensor a step, lengths (N,) each row's tokens
    up to its first EOS, done (N,) whether it ended on one."""
    lengths = lengths.tolist()
    tokens = torch.stack(tokens, 1).cpu()  # (N, steps)
    logps = torch.stack(logps, 1).float().cpu()  # (N, steps)
    completions = [x[:k].tolist() for x, k in zip(tokens, lengths)]
    logps = [x[:k].tolist() for x, k in zip(logps, lengths)]
    return completions, logps, done.tolist()


class HFEngine(Engine):
    def __init__(self, model, tokenizer, *, seed=0, dtype="float32"):
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self.pad_id = pad_id(tokenizer)
        self.dtype = getattr(torch, str(dtype).removeprefix("torch."))

        eos = unwrap(model).generation_config.eos_token_id
        if not isinstance(eos, list):
            eos = [eos]
        self.eos_ids = sorted({tokenizer.eos_token_id} | set(eos) - {None})

    @torch.no_grad()
    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0, **filters):
        """gpt-fast's decode loop: prefill the prompts, then one token a step
        through the KV cache, until every row has ended or max_new_tokens."""
        model = unwrap(self.model)
        greedy = temperature == 0
        # each prompt n times, left-padded: (N, P) ids, mask and RoPE positions
        rows = [p for p in prompt_ids for _ in range(n)]
        no_completions = torch.zeros(len(rows), 0, dtype=torch.long)  # (N, 0)
        batch = sequence_batch(rows, no_completions, self.pad_id)
        ids, mask, positions = (x.to(model.device) for x in batch)
        N = len(rows)
        eos = torch.tensor(self.eos_ids, device=ids.device)

        # FSDP2 all-gathers every forward: the ranks step together until the last ends
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        synced = dist.is_initialized() and sharded
        steps = max_new_tokens
        agree = bool
        if synced:  # FSDP2 (scale/fsdp.py): every forward is a collective
            from scale.fsdp import most_on_any_rank

            steps = most_on_any_rank(max_new_tokens, ids.device)
            agree = all_ranks_ok

        was_training = model.training
        model.eval()
        tokens = []  # (N,) a step
        logps = []  # (N,) a step
        done = torch.zeros(N, dtype=torch.bool, device=ids.device)  # (N,)
        lengths = torch.zeros(N, dtype=torch.long, device=ids.device)  # (N,) up to the first EOS
        # the tokens so far, for the repetition penalty: a real token in place of each pad
        seen = torch.where(mask.bool(), ids, ids[:, -1:])  # (N, P)
        autocast = torch.autocast(model.device.type, self.dtype,
                                  enabled=self.dtype != torch.float32)
        with private_rng(rng_seed), autocast:
            # 1) prefill: the prompts' KV cache and the first token's logits
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            logits = out.logits[:, -1]  # (N, V)

            for t in range(steps):
                # 2) sample a token a row (a rank past its own limit steps on: FSDP2)
                if t < max_new_tokens:
                    scores = process_logits(logits.float(), seen, temperature,
                                            **filters)  # (N, V)
                    uniforms = None
                    if not greedy:
                        uniforms = torch.rand(N, 1, dtype=torch.float64, device=ids.device)
                    token, logp = sample_tokens(scores, uniforms)  # (N,) each
                    token = token.masked_fill(done, self.pad_id)
                    tokens.append(token)
                    logps.append(logp)
                    lengths += ~done
                    done = done | torch.isin(token, eos)
                    seen = torch.cat([seen, token[:, None]], 1)  # (N, S+1)

                if agree(t + 1 >= max_new_tokens or bool(done.all())):
                    break

                # 3) one decode step: the new token through the cache
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)  # (N, P+t+1)
                logits = model(input_ids=token[:, None], attention_mask=mask,
                               past_key_values=cache, position_ids=positions[:, -1:] + t + 1,
                               use_cache=True).logits[:, -1]  # (N, V)
        model.train(was_training)

        return as_lists(tokens, logps, lengths, done)

    def sync_weights(self, model):
        # it samples with the trainer's own parameters
        return dict(seconds=0.0, bytes=0)


def pick_engine(kind, model, tensor_parallel_size=1):
    """--engine "auto" | "vllm" | "hf" -> ("vllm" or "hf", why in a few words).

    On a CPU, vLLM's per-step scheduling costs more than a small model's forward.
    The HF loop is faster below ~25M parameters, vLLM from there on with long
    completions (docs/benchmarks.md: Rollouts).
    """
    if kind != "auto":
        return kind, "--engine " + kind

    n = sum(p.numel() for p in model.parameters()) / 1e6
    if torch.cuda.is_available():
        why = "auto: a GPU"
    elif tensor_parallel_size > 1:
        why = "auto: --vllm-tp"
    elif n < 25:
        return "hf", (f"auto: a CPU and {n:.2f}M params, "
                      f"where the HF loop is faster (< 25M)")
    else:
        why = f"auto: a CPU and {n:.0f}M params, where vLLM is faster (>= 25M)"

    try:
        import vllm  # noqa: F401
    # ImportError, or a broken install (CUDA torchvision, CPU torch)
    except Exception as e:
        return "hf", f"auto: vLLM unavailable ({type(e).__name__}: {e})"
    return "vllm", why


def make_engine(kind, *, model, tokenizer, model_path, seed=0, dtype="float32",
                **vllm_kwargs):
    """"vllm": VLLMEngine(model_path, ...) (engines/vllm_engine.py), "hf":
    HFEngine(model, tokenizer, ...).

    The client of a rollout server is engines/server.py's RemoteEngine.
    """
    if kind == "vllm":
        from engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, seed=seed, dtype=dtype, **vllm_kwargs)
    if kind != "hf":
        raise ValueError(f"engine kind must be 'vllm' or 'hf' (pick_engine), "
                         f"got {kind!r}")
    return HFEngine(model, tokenizer, seed=seed, dtype=dtype)
