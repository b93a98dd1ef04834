"""
Every knob of train.py: its flags (argparse, with ranges), the recipe that
fills the flags left at None, and the rules between flags.
`python train.py --help` prints the same list.

    args = config.parse_args()    # the flags as the user gave them
    config.fill_defaults(args)    # None -> the recipe's value
    config.check_flags(args)      # the rules between flags, one line each
    config.resolve_aliases(args)  # an older flag -> the flags it stands for

checkpoint.run_config records the flags as the user gave them. The recipe is
the built-in task's, or R1's for a --dataset. The rules give the same verdict
on every rank.

Where a default comes from: a flag's own default below, or, where that is
None, `defaults()` (the recipe). Tests import this module to check ranges and
rules in milliseconds (tests/test_cli.py).
"""
import argparse
import math
import os
import sys

from common import fail, world

# -----------------------------------------------------------------------------
# The choices of the flags below, which the stages check their arguments against

# advantage.py: what the advantage divides by
SCALE_REWARDS = ("group", "batch", "none")
# advantage.py: how several rewards become one (GDPO: normalize_then_sum)
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
# loss.py's loss types: grpo is the default, the rest variants/ (objectives.py, reductions.py)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# the loss types with PPO's clipped surrogate (loss.clipped), which --delta caps
CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# loss.py: the ratio per token, or per sequence (GSPO)
IS_LEVELS = ("token", "sequence")
# variants/token_weights.py: the sampler-vs-trainer correction
IS_CORRECTIONS = (
    "off",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)
# loss.py's paths: the PyTorch reference, or the fused kernel (kernels/); --loss-impl
# adds "auto" (loss.choose_impl resolves it)
LOSS_IMPLS = ("torch", "triton")
# the default --lora-targets: attention and MLP projections
LORA_TARGETS = [
    "q_proj", "k_proj", "v_proj", "o_proj",  # attention
    "gate_proj", "up_proj", "down_proj",  # MLP
]

# the recipe's system prompt with --tools python (tools.py runs the blocks)
TOOLS_SYSTEM_PROMPT = (
    "You can run Python: write a ```python block that prints what you need. When the "
    "block closes "
    "it runs, and what it printed appears in an ```output block. Then state the "
    "answer.\n\n"
    "Example:\nUser: Ann buys 23 bags of apples with 47 apples in each bag. How many "
    "apples does "
    "she have now?\nAssistant: ```python\nprint(23 * "
    "47)\n```\n```output\n1081\n```\nShe has "
    "1081 apples.")


def number(kind=float, low=None, high=None, low_open=False, why=""):
    """argparse type: a finite `kind` in [low, high], or (low, high] with low_open.

    A bound of None is no bound. It refuses nan and inf, which would otherwise
    pass every comparison-based check silently.
    """
    if low is not None and high is not None:
        bounds = f"in {'(' if low_open else '['}{low}, {high}]"
    elif low is not None:
        bounds = f"{'>' if low_open else '>='} {low}"
    else:
        bounds = f"<= {high}"

    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        too_low = low is not None and (x <= low if low_open else x < low)
        too_high = high is not None and x > high
        if not math.isfinite(x) or too_low or too_high:
            raise argparse.ArgumentTypeError(f"must be {bounds}{why}, got {text}")
        return x
    return parse


# -----------------------------------------------------------------------------
# The flags. A default of None is the recipe's (defaults() below).
parser = argparse.ArgumentParser(
    description="GRPO trainer (see the docstring of train.py)")
# one line ("error: argument --G: must be >= 2 ..."), not the 50-flag usage block
parser.error = fail
add = parser.add_argument
int_ = number(int, 1)
pos = number(float, 0, low_open=True)

# --- model and data
add("--model", default=None,
    help="hub id or local dir; default: a tiny Qwen2 built from a config")
add("--dataset", default=None,
    help="hub id or .json/.jsonl/.csv/.parquet file; default: the built-in task")
add("--dataset-config", default=None)
add("--split", default="train")
add("--eval-split", default="test",
    help="held-out split "
         "(local files: e.g. --split 'train[50:]' --eval-split 'train[:50]')")
add("--prompt-column", default="prompt")
add("--solution-column", default="solution")
add("--system-prompt", default=None,
    help="default: data.DEFAULT_SYSTEM_PROMPT (R1's); '' for none")
add("--task-digits", type=number(int, 1, 6), default=3,
    help="built-in task: digits per prompt")

# --- rollouts
add("--G", default=8,
    type=number(int, 2, why=" (a group needs two completions to compare)"),
    help="completions per prompt")
add("--prompts-per-step", type=int_, default=32,
    help="prompts per step, all ranks together")
add("--dynamic-sampling", type=number(int, 0), default=0, metavar="ROUNDS",
    help="DAPO: replace groups of equal rewards by new prompts, "
         "at most ROUNDS rounds a step (0: off)")
add("--max-prompt-len", type=int_, default=512,
    help="longer prompts are dropped (with a warning)")
add("--max-new-tokens", type=int_, default=None,
    help="completion limit (recipe: digits+1 / 512)")
add("--temperature", default=1.0,
    type=number(float, 0, low_open=True,
                why=" for GRPO sampling (greedy completions never differ)"))
add("--top-p", type=number(float, 0, 1, low_open=True), default=1.0,
    help="sample from the likeliest tokens holding this share of the mass")
add("--top-k", type=number(int, 0), default=0,
    help="sample from the K likeliest tokens (0: all)")
add("--min-p", type=number(float, 0, 1), default=0.0,
    help="drop tokens less likely than MIN_P x the likeliest (0: off)")
add("--repetition-penalty", type=pos, default=1.0,
    help="CTRL's penalty on the prompt's and completion's tokens (1: off)")

add("--engine", default="auto", choices=["auto", "vllm", "hf"],
    help="auto: vLLM when installed")
add("--vllm-memory", type=number(float, 0, 1, low_open=True), default=0.3,
    help="vLLM memory fraction (of the GPU / NUMA RAM)")
add("--vllm-tp", type=int_, default=1,
    help="colocated vLLM: tensor-parallel over this many ranks")
add("--vllm-mode", default="colocate", choices=["colocate", "server"],
    help="server: see --vllm-url")
add("--vllm-sleep", action="store_true",
    help="colocated vLLM on CPU: free its weights and KV cache from each rollout to "
    "the next sync (less memory at the update's peak, a little more time a step)")
add("--vllm-url", default=None,
    help="server mode: http://HOST:PORT of vLLM's own server (server.py: how to start it)")
add("--vllm-api-key", default=None, metavar="KEY",
    help="server mode: the server's --api-key (sent as Authorization: Bearer KEY)")
add("--vllm-ca-cert", default=None, metavar="FILE",
    help="server mode: trust an https server whose certificate this PEM file signed "
    "(a self-signed one: its --ssl-certfile)")
add("--allow-plain-http", action="store_true",
    help="server mode: send --vllm-api-key over plain http to another host (a private "
    "network); without it, https or this machine's loopback only")
add("--allow-open-dev-routes", action="store_true",
    help="server mode: accept a loopback test server whose dev routes answer without "
    "the key (started without --middleware engines.worker_extension.RequireKey)")
add("--async", dest="async_", action="store_true",
    help="server mode: sample the next batch during this update (--max-staleness 1)")
add("--max-staleness", type=number(int, 0), default=None, metavar="N",
    help="server mode: sample batches during the updates, up to N weight versions "
    "behind the trainer; older ones are dropped and redrawn (0: take turns; staleness.py)")
add("--partial-rollouts", action="store_true",
    help="with --max-staleness N >= 1: a sync pauses the draws in flight and they go on "
    "with the new weights, each token's version logged (needs the server's "
    "--enable-scale-out; staleness.py)")
add("--tools", nargs="+", default=None,
    help="python: ToRL, each completion's ```python blocks run, the output spliced "
    "in; or function tools by import path, module.fn ... (tools.py)")
add("--environment", nargs="+", default=None,
    help="TRL's environment_factory: module.Class, one instance per completion, its "
    "methods the tools; several as name=module.Class, chosen by the rows' "
    "environment column (environment.py)")
add("--max-tool-calls", type=int_, default=4,
    help="tools: rounds of calls per completion")
add("--tool-output-tokens", type=number(int, 16), default=256,
    help="tools: a result's tokens (more: its end is kept)")
add("--tool-timeout", type=number(float, 0, 600, low_open=True), default=10.0,
    help="tools: seconds a call may take; then its process is killed")
add("--chat-template", default=None,
    help="a Jinja chat template file used instead of the tokenizer's "
    "(assets/chatml_tools.jinja: ChatML with tool calls)")

# --- rewards
add("--rewards", nargs="+", default=None,
    help="built-in names, dotted paths or reward-model dirs")
add("--reward-weights", type=number(float), nargs="+", default=None,
    help="one weight per reward")
add("--scale-rewards", default="group", choices=SCALE_REWARDS)
add("--reward-aggregation", default="sum_then_normalize", choices=REWARD_AGGREGATIONS,
    help="normalize_then_sum: each reward z-scored in its group first (GDPO)")
add("--overlong-buffer", type=number(int, 0), default=0, metavar="N",
    help="one more reward of weight 1, DAPO's soft overlong punishment: 0 up to "
         "--max-new-tokens - N tokens, then down to -1 at --max-new-tokens (0: off)")
add("--eval-reward", default=None,
    help="held-out accuracy's reward, like --rewards (recipe: exact match / accuracy)")
# under gloo's 1800 s collective timeout (NCCL's: 600 s)
add("--reward-timeout", type=number(float, 0, 1800, low_open=True), default=300,
    help="seconds a reward function may take on a batch; more ends the run, naming it")

# --- optimization
add("--steps", type=int_, default=400, help="GRPO steps (one rollout batch each)")
add("--lr", type=pos, default=None,
    help="recipe: 3e-4 tiny model / 1e-6 --model (x10 with LoRA)")
add("--warmup-steps", type=number(int, 0), default=10)
add("--weight-decay", type=number(float, 0), default=0.0)
add("--grad-clip", type=number(float, 0), default=1.0, help="max grad norm (0: off)")
add("--num-iterations", type=int_, default=1, help="mu: passes over each rollout batch")
add("--minibatch-size", type=number(int, 0), default=0,
    help="completions per optimizer step per rank (0: all)")
add("--micro-batch-size", type=number(int, 0), default=0,
    help="completions per forward/backward (0: the minibatch; on the CPU, at most "
         "as many as keep the (n, --max-new-tokens, V) logits within 2^25 numbers)")
add("--gradient-checkpointing", action="store_true",
    help="recompute each decoder layer's activations in backward: less memory, "
         "about a third more update compute (TRL's gradient_checkpointing)")
add("--lora-rank", type=number(int, 0), default=0,
    help="train LoRA adapters of this rank, base frozen (0: full fine-tuning)")
add("--lora-alpha", type=pos, default=None,
    help="LoRA scale = alpha / rank (default alpha: 2 x rank)")
add("--lora-dropout", type=number(float, 0, 1), default=0.0,
    help="dropout on the adapters' input, in the update")
add("--lora-targets", nargs="+", default=LORA_TARGETS,
    help="the modules that get adapters")

# --- loss
add("--loss-type", default="grpo", choices=LOSS_TYPES,
    help="cispo, sapo, vespo: other objectives; luspo: GSPO x length")
add("--beta", type=number(float, 0), default=0.0,
    help="KL coefficient (0: no reference model)")
add("--epsilon-low", type=number(float, 0), default=0.2)
add("--epsilon-high", type=number(float, 0), default=0.2,
    help="cispo: the weight's cap itself")
add("--delta", type=pos, default=None,
    help="two-sided clip: where A < 0 the ratio is capped at DELTA (INTELLECT-2)")
add("--vespo-k", type=pos, nargs=2, default=[2.0, 3.0], metavar=("POS", "NEG"),
    help="vespo: the Gamma weight's shape k for A >= 0 and A < 0")
add("--vespo-lambda", type=pos, nargs=2, default=[3.0, 2.0], metavar=("POS", "NEG"),
    help="vespo: the Gamma weight's rate lambda for A >= 0 and A < 0")
add("--sapo-tau", type=pos, nargs=2, default=[1.0, 1.05], metavar=("POS", "NEG"),
    help="sapo: the gate's temperatures for A > 0 and A <= 0")
add("--kl-bias-correction", action="store_true",
    help="KL x ratio: the unbiased reverse-KL gradient (DeepSeek-V3.2)")
add("--mask-truncated", action="store_true",
    help="drop completions cut at --max-new-tokens (DAPO)")
add("--top-entropy-quantile", type=number(float, 0, 1), default=1.0, metavar="RHO",
    help="policy loss on the top-RHO share of the step's tokens by entropy, "
         "all ranks (1: all)")
add("--is-correction", default="off", choices=IS_CORRECTIONS,
    help="sampler-vs-trainer importance sampling, "
         "per token or sequence, truncated or masked")
add("--is-min", type=number(float, 0), default=0.0, help="IS ratio bound C_min (0: none)")
add("--is-max", type=pos, default=3.0, help="IS ratio bound C_max")
add("--off-policy-mask", type=number(float, 0), default=None, metavar="DELTA",
    help="drop A < 0 sequences whose mean KL(sampler || policy) > DELTA (DeepSeek-V3.2)")
add("--importance-sampling-level", default="token", choices=IS_LEVELS)
add("--entropy-coef", type=number(float, 0), default=None,
    help="entropy bonus (recipe: 0.1 / 0)")
add("--adaptive-entropy", action="store_true",
    help="the entropy coefficient follows --entropy-target (Skywork-OR1)")
add("--entropy-target", type=number(float, 0), default=0.2,
    help="--adaptive-entropy: the bonus is on while the entropy is at most this")
add("--entropy-coef-delta", type=number(float, 0), default=0.005,
    help="--adaptive-entropy: the coefficient's change per optimizer step")
add("--entropy-coef-min", type=number(float, 0), default=0.0)
add("--entropy-coef-max", type=number(float, 0), default=1.0)
add("--sync-ref-every", type=number(int, 0), default=0, metavar="N",
    help="TR-DPO: every N optimizer steps the reference moves toward the policy (0: off)")
add("--ref-mixup-alpha", type=number(float, 0, 1), default=0.6,
    help="--sync-ref-every: ref <- alpha x policy + (1 - alpha) x ref")
add("--tis-cap", type=number(float, 0), default=0.0,
    help="alias of --is-correction token_truncate --is-max TIS_CAP (0: off)")
add("--loss-impl", default="auto", choices=["auto", "triton", "torch"],
    help="auto: Triton on CUDA")

# --- evaluation, checkpoints, logging
add("--eval-every", type=number(int, 0), default=50,
    help="held-out evaluation every N steps (0: at the end only)")
add("--eval-size", type=int_, default=500, help="held-out prompts evaluated")
add("--eval-samples", type=number(int, 0), default=0,
    help="sampled completions per held-out prompt: pass@k (0: 1, off)")
add("--eval-k", type=int_, nargs="+", default=None,
    help="pass@k for each k <= --eval-samples n (default: 1 and n)")
add("--save-every", type=int_, default=100,
    help="checkpoint every N steps (and at the end)")
add("--keep-last", type=int_, default=2, help="checkpoints kept")
add("--resume", default="auto", choices=["auto", "yes", "no"],
    help="auto: continue the out-dir's run if any")
add("--out-dir", default="out",
    help="metrics.jsonl, metrics.png, checkpoints, final model")
add("--log-completions", type=number(int, 0), default=0, metavar="N",
    help="TRL's log_completions: every N steps, each completion (prompt, text, rewards, "
         "advantage) to completions.jsonl and a few above the progress bar; read them "
         "with `python -m runlog.completions show OUT_DIR` (0: off)")
add("--report-to", nargs="+", default=None, choices=["wandb", "trackio", "tensorboard", "none"],
    help="TRL's report_to: also log each step's record to these dashboards (report.py); "
         "none: to none")
add("--project", default="tinygrpo",
    help="--report-to trackio or wandb: the dashboards' project (TRL's project)")
add("--wandb", default=None, metavar="PROJECT",
    help="--report-to wandb --project PROJECT (the older spelling)")

# --- runtime
add("--seed", type=number(int, 0), default=0)
add("--threads", type=int_, default=1,
    help="torch CPU threads per rank (1 is fastest on small CPUs)")
add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
    help="compute dtype; weights stay fp32; auto: bf16 on CUDA")
add("--fsdp", action="store_true",
    help="shard the policy (and reference) with FSDP2, per decoder layer")
add("--fast", default="auto", choices=["auto", "on", "off"],
    help="the speed machinery in fast/, installed once at load (fast.install): auto "
         "turns on what is measured to help on this device, on all of it where it "
         "applies, off the plain reference path")
add("--config", default=None, metavar="FILE.yaml",
    help="a recipe file (recipes/): these flags by name, dashes or underscores; the "
         "command line's flags override it")


def config_file(argv):
    """The --config FILE argv names, or None."""
    find = argparse.ArgumentParser(add_help=False)
    find.add_argument("--config")
    find.error = fail
    given, _ = find.parse_known_args(argv)
    return given.config


def speaks_trl(argv):
    """Whether argv names a flag that is none of ours, or a --config file with a
    key that is none of ours: TRL's names (GRPOConfig's fields, `trl grpo`'s
    flags), which trl_compat/trl_names.py reads with TRL's meaning (train.py
    hands it the run)."""
    if any(word.split("=")[0] not in parser._option_string_actions
           for word in argv if word.startswith("--")):
        return True
    path = config_file(argv)
    return path is not None and recipe_words(path) is None


def parse_args(argv=None):
    """The flags: a --config file's, then the command line's over them. Our
    names only: TRL's go to trl_compat/trl_names.py (speaks_trl, docs/trl.md)."""
    if argv is None:
        argv = sys.argv[1:]
    argv = list(argv)

    # the file's flags go first as words: the parser checks them as it checks
    # the command line's, and a later flag wins
    path = config_file(argv)
    if path:
        # a key that is no flag stops the run here, in one line (TRL's names:
        # train.py hands a file of them to trl_compat/trl_names.py)
        words = recipe_words(path, skip=lambda key: False)
        # its values checked alone first, so that an error names the file
        parser.error = lambda message: fail(f"--config {path}: {message}")
        try:
            parser.parse_args(words)
        finally:
            parser.error = fail
        argv = words + argv
    return parser.parse_args(argv)


def recipe_words(path, skip=None):
    """A recipe file's flags as command-line words. Each key is a flag, dashes
    or underscores (G: --G); a list is a flag's values; a switch is true or
    false; null leaves a flag at its default; a value starting with ~/ is in
    the home folder, as a shell would read it. Bad input stops the run in one
    line: a file that is not there or not YAML, an unknown flag, a wrong type.

    A key that is no flag makes it None: the file may be TRL's (trl_names.py),
    which reads it again with skip(key) true for TRL's fields, and stops on a key
    that is neither TRL's nor a flag."""
    import yaml

    try:
        with open(path) as f:
            fields = yaml.safe_load(f)
    except OSError as e:
        fail(f"--config {path}: cannot read it ({e.strerror})")
    except yaml.YAMLError as e:
        first_line = str(e).strip().splitlines()[0]
        fail(f"--config {path}: not a YAML file ({first_line})")
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        fail(f"--config {path}: a recipe maps flag names to values, "
             f"got a {type(fields).__name__}")

    options = {s: a for a in parser._actions for s in a.option_strings}
    flags = {s for s in options if s not in ("--config", "--help")}
    if skip is None and any("--" + str(key).replace("_", "-") not in flags for key in fields):
        return None
    words = []
    for key, value in fields.items():
        if skip and skip(key):
            continue
        flag = "--" + str(key).replace("_", "-")
        action = options.get(flag)
        if flag not in flags:
            fail(f"--config {path}: unknown field {key!r}: not a flag of train.py "
                 f"(python train.py --help), nor a field of TRL's GRPOConfig (docs/trl.md)")
        if value is None:
            continue

        # a switch: on, or left off
        if action.nargs == 0:
            if not isinstance(value, bool):
                fail(f"--config {path}: {key} is a switch: true or false, got {value!r}")
            if value:
                words.append(flag)
            continue

        values = value if isinstance(value, list) else [value]
        if isinstance(value, list) and action.nargs is None:
            fail(f"--config {path}: {key} takes one value, got a list {value!r}")
        if not all(isinstance(v, (str, int, float)) for v in values):
            fail(f"--config {path}: {key} takes numbers or text, got {value!r}")
        words.append(flag)
        for v in values:
            if isinstance(v, str) and v.startswith("~/"):
                v = os.path.expanduser(v)
            words.append(str(v))
    return words


# -----------------------------------------------------------------------------
# The recipe: what fills the flags left at None

def defaults(builtin_task, tiny_model, digits, rewards=None, lora=False, tools=None,
             environment=False):
    """The recipe behind every flag left at None.

    The built-in task's: a tiny model from scratch, so a high lr, an entropy
    bonus, and exact match plus position shaping.
    A --dataset's: R1's (format 0.1 + accuracy 1.0). With tools, the final
    number alone (final_number_reward); --tools python adds its system prompt
    (which asks for no <think> format). An --environment's: no reward but the
    environment's own, unless --rewards.
    Rewards given without weights weigh 1 each. LoRA (--lora-rank) trains with
    a 10x higher lr.
    """
    if builtin_task:
        recipe = dict(
            max_new_tokens=digits + 1,  # the answer, then EOS
            entropy_coef=0.1,
            rewards=["exact_match_reward", "task.position_reward"],
            reward_weights=[1.0, 0.5],
            eval_reward="exact_match_reward",
        )
    else:
        recipe = dict(
            max_new_tokens=512,
            entropy_coef=0.0,
            rewards=["think_format_reward", "accuracy_reward"],
            reward_weights=[0.1, 1.0],
            eval_reward="accuracy_reward",
        )

    # with tools the answer must be written out: final_number_reward, not
    # math-verify's, which scores "123 * 509" as its value
    if tools and not builtin_task:
        recipe.update(rewards=["final_number_reward"], reward_weights=[1.0],
                      eval_reward="final_number_reward")
    if tools == "python" and not builtin_task:
        recipe.update(system_prompt=TOOLS_SYSTEM_PROMPT)
    # an environment may own the reward (get_reward): train.py adds it, and
    # the evaluation's default is it (else final_number_reward)
    if environment and not builtin_task:
        recipe.update(rewards=[], reward_weights=[], eval_reward=None)

    # LoRA's best lr is ~10x full fine-tuning's (docs/benchmarks.md)
    recipe["lr"] = (3e-4 if tiny_model else 1e-6) * (10 if lora else 1)
    if rewards:
        recipe["reward_weights"] = [1.0] * len(rewards)
    return recipe


def tool_kind(tools):
    """--tools -> "python" (ToRL's fences), "functions", or None."""
    if tools is None:
        return None
    if tools == ["python"]:
        return "python"
    return "functions"


def fill_defaults(args):
    """Set every flag left at None to the recipe's value, in place."""
    recipe = defaults(
        builtin_task=args.dataset is None,
        tiny_model=args.model is None,
        digits=args.task_digits,
        rewards=args.rewards,
        lora=args.lora_rank > 0,
        tools=tool_kind(args.tools),
        environment=args.environment is not None,
    )

    for k, v in recipe.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    return args


# -----------------------------------------------------------------------------
# The rules between flags (argparse checked each flag's own range)

# A flag that matters only under another one: given without it, it would be
# ignored in silence.
# flag (its dest) -> (is the other one on?, what to add)
def uses_tools(args):
    return args.tools is not None or args.environment is not None


def colocated_vllm(args):
    return args.vllm_mode == "colocate" and args.engine != "hf"


COLOCATED_VLLM = "the colocated vLLM engine (drop --engine hf and --vllm-mode server)"


DEPENDS_ON = {
    "lora_alpha": (lambda a: a.lora_rank > 0, "--lora-rank R"),
    "lora_dropout": (lambda a: a.lora_rank > 0, "--lora-rank R"),
    "lora_targets": (lambda a: a.lora_rank > 0, "--lora-rank R"),
    "vllm_url": (lambda a: a.vllm_mode == "server", "--vllm-mode server"),
    "vllm_api_key": (lambda a: a.vllm_mode == "server", "--vllm-mode server"),
    "vllm_ca_cert": (lambda a: a.vllm_mode == "server", "--vllm-mode server"),
    "allow_plain_http": (lambda a: a.vllm_mode == "server", "--vllm-mode server"),
    "allow_open_dev_routes": (lambda a: a.vllm_mode == "server", "--vllm-mode server"),
    "max_staleness": (lambda a: a.vllm_mode == "server", "--vllm-mode server"),
    "partial_rollouts": (lambda a: a.max_staleness or a.async_,
                         "--max-staleness N >= 1 (or --async)"),
    "vllm_memory": (colocated_vllm, COLOCATED_VLLM),
    "vllm_sleep": (colocated_vllm, COLOCATED_VLLM),
    "dataset_config": (lambda a: a.dataset is not None, "--dataset"),
    "split": (lambda a: a.dataset is not None, "--dataset"),
    "eval_split": (lambda a: a.dataset is not None, "--dataset"),
    "prompt_column": (lambda a: a.dataset is not None, "--dataset"),
    "solution_column": (lambda a: a.dataset is not None, "--dataset"),
    "system_prompt": (lambda a: a.dataset is not None,
                      "--dataset (the built-in task has none)"),
    "task_digits": (lambda a: a.dataset is None, "the built-in task: drop --dataset"),
    "max_tool_calls": (uses_tools, "--tools or --environment"),
    "tool_output_tokens": (uses_tools, "--tools or --environment"),
    "tool_timeout": (uses_tools, "--tools or --environment"),
    "is_min": (lambda a: a.is_correction != "off", "--is-correction MODE"),
    "is_max": (lambda a: a.is_correction != "off", "--is-correction MODE"),
    "sapo_tau": (lambda a: a.loss_type == "sapo", "--loss-type sapo"),
    "vespo_k": (lambda a: a.loss_type == "vespo", "--loss-type vespo"),
    "vespo_lambda": (lambda a: a.loss_type == "vespo", "--loss-type vespo"),
    "delta": (lambda a: a.loss_type in CLIPPED_LOSS_TYPES,
              "a clipped --loss-type (grpo, bnpo, dr_grpo, dapo, luspo)"),
    "kl_bias_correction": (lambda a: a.beta > 0, "--beta > 0 (a KL term)"),
    "sync_ref_every": (lambda a: a.beta > 0, "--beta > 0 (a reference model to move)"),
    "ref_mixup_alpha": (lambda a: a.sync_ref_every > 0, "--sync-ref-every N"),
    "entropy_target": (lambda a: a.adaptive_entropy, "--adaptive-entropy"),
    "entropy_coef_delta": (lambda a: a.adaptive_entropy, "--adaptive-entropy"),
    "entropy_coef_min": (lambda a: a.adaptive_entropy, "--adaptive-entropy"),
    "entropy_coef_max": (lambda a: a.adaptive_entropy, "--adaptive-entropy"),
    "project": (lambda a: a.wandb or {"trackio", "wandb"} & set(a.report_to or ()),
                "--report-to trackio or wandb"),
}


def dependent_flag_errors(args):
    """One line for each flag given (not at its default) while the flag it
    depends on is off."""
    errors = []
    for dest, (is_on, needs) in DEPENDS_ON.items():
        given = getattr(args, dest) != parser.get_default(dest)
        if given and not is_on(args):
            flag = "--" + dest.replace("_", "-")
            errors.append(f"{flag} does nothing without {needs}: add it, "
                          f"or drop the flag")
    return errors


def check_loss_settings(settings, impl=None):
    """ValueError, one line, at the first rule between the loss's settings that they break.

    The one place these rules live. settings: a loss.LossSettings, or train.py's
    parsed flags, which name the same attributes (so the words are the flags');
    impl: the loss's path, settings.impl when None (the flags have --loss-impl
    instead). check_flags runs it on the flags (loss_rule_broken), and a caller
    that builds LossSettings itself runs it once, at set-up. The values the
    flags' parser refuses are refused here too where a wrong one would not fail
    on its own (an unknown loss_type does: loss.grpo_loss, loss.reduce_loss).
    """
    s = settings
    impl = s.impl if impl is None else impl
    level = s.importance_sampling_level
    vespo = (*s.vespo_k, *s.vespo_lambda)

    # argparse's choices and ranges, for a caller that builds the settings itself
    choices = [
        (level in IS_LEVELS, f"importance_sampling_level={level!r}: choose one of {IS_LEVELS}"),
        (s.is_correction in IS_CORRECTIONS,
         f"is_correction={s.is_correction!r}: choose one of {IS_CORRECTIONS}"),
        (impl in LOSS_IMPLS,
         f"impl={impl!r}: choose one of {LOSS_IMPLS} (choose_impl resolves 'auto')"),
        (all(x > 0 for x in vespo), f"vespo's k and lambda must be > 0, got {vespo}"),
    ]

    # the rules between the settings
    rules = [
        (s.loss_type != "luspo" or level == "sequence",
         "--loss-type luspo is GSPO's sequence ratio, weighed by length: add "
         "--importance-sampling-level sequence"),
        (s.loss_type != "vespo" or level == "token",
         "--loss-type vespo builds its sequence weight from the token ratios: drop "
         "--importance-sampling-level sequence"),
        (s.loss_type != "vespo" or not s.is_correction.startswith("sequence"),
         f"--loss-type vespo adds the token IS ratios to its sequence ratio: use "
         f"--is-correction {s.is_correction.replace('sequence', 'token')}"),
        (impl != "triton" or level != "sequence",
         "--loss-impl triton supports --importance-sampling-level token only; "
         "use --loss-impl torch"),
        (impl != "triton" or s.loss_type != "vespo",
         "--loss-impl triton has no per-sequence weight for --loss-type vespo: "
         "use --loss-impl torch"),
        (s.delta is None or s.loss_type not in CLIPPED_LOSS_TYPES
         or s.delta > 1 + s.epsilon_high,
         f"--delta {s.delta} caps the ratio where A < 0 above the clip: give "
         f"--delta > 1 + --epsilon-high = {1 + s.epsilon_high:g} (INTELLECT-2: 4)"),
        (s.loss_type != "cispo" or s.epsilon_high >= 1,
         "--loss-type cispo caps the IS weight at --epsilon-high itself: "
         "give a cap >= 1 (e.g. 5)"),
        (s.is_min <= s.is_max,
         f"--is-min {s.is_min} must be <= --is-max {s.is_max}"),
    ]
    for ok, msg in choices + rules:
        if not ok:
            raise ValueError(msg)


def loss_rule_broken(args):
    """The line of the first rule between the loss's flags that args break
    (check_loss_settings), or None."""
    # auto picks the kernel only where it runs (loss.choose_impl): the rules
    # that refuse it are for --loss-impl triton
    impl = "triton" if args.loss_impl == "triton" else "torch"
    try:
        check_loss_settings(args, impl)
    except ValueError as e:
        return str(e)
    return None


def check_flags(args):
    """The rules between train.py's flags, before any heavy work.

    One clear line each, and the same verdict on every rank. The loss's rules:
    check_loss_settings (loss_rule_broken).
    """
    # the batch sizes: completions per rank per step, per optimizer step, per forward
    n_local = args.prompts_per_step // max(1, world) * args.G
    minibatch = args.minibatch_size or n_local
    micro = args.micro_batch_size or minibatch

    # a hub id looks like org/name and is no local path
    hub_id = False
    if args.model is not None:
        local = args.model.startswith((".", "/", "~")) or os.path.exists(args.model)
        hub_id = args.model.count("/") == 1 and not local
    k_text = " ".join(map(str, args.eval_k or ()))

    # --tools: the modes the tool loop does not serve yet (it wraps one rank's
    # colocated engine)
    modes = [
        ("--vllm-mode server", args.vllm_mode == "server"),
        ("--async", args.async_),
        (f"--vllm-tp {args.vllm_tp}", args.vllm_tp > 1),
        ("--fsdp", args.fsdp),
        ("the built-in digit task (no --dataset)", args.dataset is None),
    ]
    no_tools = ", ".join(mode for mode, on in modes if on)
    tools_flag = "--tools " + " ".join(args.tools or [])
    if args.environment:
        tools_flag = "--environment"
    loss_error = loss_rule_broken(args)

    checks = [
        (not (uses_tools(args) and no_tools),
         f"{tools_flag} does not run with {no_tools} yet (the tool loop "
         f"wraps a colocated engine, one per rank): drop one of the two"),
        (not ("python" in (args.tools or []) and (args.environment or len(args.tools) > 1)),
         "--tools python (ToRL's fenced code) runs alone: for the python tool beside "
         "others, use --environment environments.python_tool.PythonTool"),
        (args.chat_template is None or os.path.isfile(args.chat_template),
         f"--chat-template {args.chat_template}: no such file"),

        (args.prompts_per_step >= world,
         f"--prompts-per-step {args.prompts_per_step} < {world} ranks: "
         f"every rank needs a prompt"),
        (args.prompts_per_step % world == 0,
         f"--prompts-per-step {args.prompts_per_step} must be divisible by the "
         f"{world} ranks"),
        (args.eval_size >= world,
         f"--eval-size must be >= the {world} ranks (each evaluates a share), "
         f"got {args.eval_size}"),

        (not args.fsdp or world > 1,
         "--fsdp shards over ranks: launch with torchrun --nproc_per_node N (N >= 2)"),
        (not (args.fsdp and args.lora_rank),
         "--lora-rank does not work with --fsdp: drop --fsdp (LoRA's frozen base "
         "in --dtype and small adapters fit one GPU per rank under DDP)"),
        (args.vllm_mode == "colocate" or args.vllm_url,
         "--vllm-mode server needs --vllm-url http://HOST:PORT"),
        (args.vllm_ca_cert is None or os.path.isfile(args.vllm_ca_cert),
         f"--vllm-ca-cert {args.vllm_ca_cert}: no such file"),
        (not args.async_ or args.vllm_mode == "server",
         "--async overlaps a rollout server's generation with the update: add "
         "--vllm-mode server --vllm-url http://HOST:PORT (a colocated engine "
         "shares the trainer's device)"),
        (not (args.vllm_sleep and args.lora_rank),
         "--vllm-sleep needs a sync of every layer, and LoRA's sends the adapted "
         "ones: drop one of them"),
        (not (args.vllm_sleep and args.vllm_tp > 1),
         "--vllm-sleep frees one engine's layers, not a tensor-parallel shard's: "
         "drop one of --vllm-sleep and --vllm-tp"),
        (world % args.vllm_tp == 0,
         f"--vllm-tp {args.vllm_tp} must divide the {world} ranks"),
        (args.vllm_tp == 1 or (args.engine != "hf" and args.vllm_mode == "colocate"),
         "--vllm-tp applies to the colocated vLLM engine: drop it with --engine hf, "
         "or set the server's own TP"),

        # luspo and vespo's levels, the kernel's reach, delta, cispo's cap, the IS bounds
        (loss_error is None, loss_error),
        (not (args.tis_cap and args.is_correction != "off"),
         "--tis-cap C is --is-correction token_truncate --is-max C: "
         "give one of the two"),

        (args.model is None or os.path.isdir(args.model) or hub_id,
         f"--model {args.model!r}: no such directory (give a local "
         f"save_pretrained folder or a hub id like org/name)"),
        (len(args.reward_weights) == len(args.rewards),
         f"--reward-weights has {len(args.reward_weights)} values for "
         f"{len(args.rewards)} --rewards: give one per reward"),
        (args.overlong_buffer <= args.max_new_tokens,
         f"--overlong-buffer {args.overlong_buffer} is longer than --max-new-tokens "
         f"{args.max_new_tokens}: the punishment ramps over the last N tokens allowed"),
        # an --environment's get_reward weighs 1 (train.py adds it)
        (any(args.reward_weights) or args.environment,
         "--reward-weights are all 0: every advantage would be 0 and nothing "
         "learned; give a reward a non-zero weight"),

        # n_local 0 is said above
        (n_local == 0 or not (n_local % minibatch or minibatch % micro),
         f"--micro-batch-size {micro} must divide --minibatch-size {minibatch}, "
         f"which must divide the {n_local} completions per rank per step "
         f"(prompts-per-step / ranks * G)"),

        (args.dynamic_sampling != 1,
         "--dynamic-sampling 1 draws no second round, so it drops no group: "
         "give the most rounds a step may draw (>= 2), or 0 for off"),
        (not (args.async_ and args.dynamic_sampling),
         "--async samples one round ahead; --dynamic-sampling's extra rounds "
         "would sample in step with the update: use one of them"),
        (not (args.async_ and args.max_staleness is not None),
         f"--async is --max-staleness 1: give one of --async and --max-staleness "
         f"{args.max_staleness}"),
        (not (args.max_staleness is not None and args.dynamic_sampling),
         "--max-staleness draws one round a step; --dynamic-sampling's extra rounds "
         "would be drawn in step with the update: use one of them"),
        (args.eval_samples or not args.eval_k,
         "--eval-k needs --eval-samples n: pass@k is estimated from n sampled "
         "completions per held-out prompt"),
        (all(k <= args.eval_samples for k in args.eval_k or ()),
         f"--eval-k {k_text}: each k must be <= --eval-samples {args.eval_samples}"),

        # GDPO z-scores each reward in its group, then the sum over the batch
        (args.reward_aggregation == "sum_then_normalize" or args.scale_rewards == "group",
         f"--scale-rewards {args.scale_rewards} does nothing with --reward-aggregation "
         f"normalize_then_sum (it z-scores each reward in its group, then the sum over "
         f"the batch): drop one"),
        # TR-DPO moves a reference of its own (TRL refuses PEFT too)
        (not (args.sync_ref_every and args.lora_rank),
         "--sync-ref-every does not work with --lora-rank: the reference is the policy "
         "with its adapters off, no copy to move; drop one"),
        (not (args.sync_ref_every and args.fsdp),
         "--sync-ref-every does not work with --fsdp yet (the reference's shards are "
         "not mixed or checkpointed): drop one"),
        (not args.adaptive_entropy or args.entropy_coef_min <= args.entropy_coef_max,
         f"--entropy-coef-min {args.entropy_coef_min} must be <= --entropy-coef-max "
         f"{args.entropy_coef_max}"),
        (not args.adaptive_entropy
         or args.entropy_coef_min <= args.entropy_coef <= args.entropy_coef_max,
         f"--adaptive-entropy starts from --entropy-coef {args.entropy_coef}: it must lie "
         f"in [--entropy-coef-min, --entropy-coef-max] = [{args.entropy_coef_min}, "
         f"{args.entropy_coef_max}]"),

        # --report-to: TRL's "none" reports nowhere; --wandb names its own project
        (not args.report_to or "none" not in args.report_to or len(args.report_to) == 1,
         f"--report-to {' '.join(args.report_to or ())}: none reports nowhere: give it "
         f"alone, or drop it"),
        (not (args.wandb and args.project != parser.get_default("project")),
         f"--wandb {args.wandb} is --report-to wandb --project {args.wandb}: give the "
         f"project once"),

        # the filters keep the likeliest token only: sampling is greedy
        (args.top_k != 1 and args.min_p < 1,
         "--top-k 1 and --min-p 1 keep only the likeliest token: a group's G "
         "completions would never differ; give --top-k >= 2 (0: off) or --min-p < 1"),

        (args.log_completions <= args.steps,
         f"--log-completions {args.log_completions} logs one step in "
         f"{args.log_completions}, and the run has --steps {args.steps}: none would be "
         f"logged; give N <= --steps"),
    ]
    for ok, msg in checks:
        if not ok:
            fail(msg)

    for msg in dependent_flag_errors(args):
        fail(msg)


def resolve_aliases(args):
    """Set the flags an older flag stands for, in place (after check_flags).

    --tis-cap C is --is-correction token_truncate --is-max C. --async is
    --max-staleness 1.
    """
    if args.async_:
        args.max_staleness = 1
    if args.tis_cap:
        args.is_correction = "token_truncate"
        args.is_max = args.tis_cap
    return args
