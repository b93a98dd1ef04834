"""
TRL's names: a GRPOConfig YAML file, or a `trl grpo` command line, read as
train.py's flags with TRL's meaning. The table: docs/trl.md.

    python train.py --config grpo.yaml       # TRL 1.16's fields (ours may join them)
    python train.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name trl-lib/DeepMath-103K \\
        --reward_funcs accuracy_reward think_format_reward --reward_weights 1.0 0.1 \\
        --use_vllm true                      # what `trl grpo` is given
    torchrun --nproc_per_node 8 train.py --config grpo.yaml

config.parse_args hands a run here only when a name is none of train.py's flags
(a file's field, or a command-line flag), and this module is imported by no
other run. TRL's spellings are read as TrlParser reads them: underscores or
dashes, `--use_vllm`, `--use_vllm true`, `--no_gradient_checkpointing`, a file's
`env:` section. Each name is one of four kinds (docs/trl.md):
- mapped (MAPPED): it becomes our flags, with TRL's meaning. A TRL default that
  differs from ours (loss_type dapo, the vLLM importance-sampling correction)
  is TRL's, and the start-up says so in one line;
- harmless (HARMLESS): no equivalent, and no number of the training depends on
  it (logging_steps, push_to_hub): one warning line, if it is not at TRL's default;
- refused (REFUSED): no equivalent, and the training would change (fp16,
  optim adafactor): the run stops in one line, unless it is at TRL's default;
- neither TRL's nor ours: the run stops in one line (a typo).
A name both have (beta, seed, loss_type) is TRL's in such a run. Our own flags
mix in, and win over the TRL field that maps to the same flag.

num_train_epochs needs the training set's size: parse_args leaves
args.trl_epochs, and train.py calls resolve_epochs once the rows are loaded.
Everything else is resolved here, before any heavy work.

Tests: python -m pytest -q tests/test_trl_names.py

Simplifications:
1. TRL 1.16's fields, and three of older TRL: max_prompt_length, warmup_ratio
   and torch_dtype (TRL 1.16 has none of them).
2. A prompt's completions stay on one rank, and an optimizer step never spans
   two generation batches. Batches TRL would split so stop in one line.
3. An epoch is TRL's: the training set's whole generation batches (the last,
   partial one is dropped). A fractional epoch rounds up to a whole step.
4. The learning-rate schedule is ours: a linear warmup, then a cosine to lr/10
   (TRL's cosine_with_min_lr, min_lr_rate 0.1). TRL's default, linear, is not
   here: the start-up line says so; a schedule asked for by name stops the run.
5. Prompts are ours (data.py): a plain-string prompt goes through the model's
   chat template, which TRL leaves as it is.
"""
import json
import math
import os

import config
from common import fail, print0, world

# -----------------------------------------------------------------------------
# TRL 1.16's fields: those that map to our flags, at TRL's defaults

MAPPED = dict(
    # model and data (`trl grpo`'s ScriptArguments, ModelConfig); torch_dtype: older dtype
    model_name_or_path=None,
    dtype="float32",
    torch_dtype=None,
    dataset_name=None,
    dataset_config=None,
    dataset_train_split="train",
    dataset_test_split="test",

    # the rewards
    reward_model_name_or_path=None,
    reward_funcs=None,
    reward_weights=None,

    # the batch and the run's length
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    generation_batch_size=None,
    steps_per_generation=None,
    num_generations=8,
    max_steps=-1,
    num_train_epochs=3.0,

    # sampling (max_prompt_length: older TRL's)
    max_completion_length=512,
    max_prompt_length=512,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    min_p=None,
    repetition_penalty=1.0,

    # the sampler: vLLM, colocated or a server
    use_vllm=False,
    vllm_mode="colocate",
    vllm_server_base_url=None,
    vllm_server_host="0.0.0.0",
    vllm_server_port=8000,
    vllm_gpu_memory_utilization=0.3,
    vllm_tensor_parallel_size=1,
    vllm_enable_sleep_mode=False,

    # the loss
    learning_rate=1e-6,
    beta=0.0,
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    loss_type="dapo",
    scale_rewards="group",
    multi_objective_aggregation="sum_then_normalize",
    num_iterations=1,
    mask_truncated_completions=False,
    importance_sampling_level="token",

    # the loss: its entropy terms
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    use_adaptive_entropy=False,
    entropy_target=0.2,
    entropy_coef_delta=0.005,
    entropy_coef_min=0.0,
    entropy_coef_max=1.0,

    # the loss: SAPO's and VESPO's
    sapo_temperature_pos=1.0,
    sapo_temperature_neg=1.05,
    vespo_k_pos=2.0,
    vespo_k_neg=3.0,
    vespo_lambda_pos=3.0,
    vespo_lambda_neg=2.0,

    # the loss: the reference model, the off-policy mask, the KL term
    sync_ref_model=False,
    ref_model_sync_steps=512,
    ref_model_mixup_alpha=0.6,
    off_policy_mask_threshold=None,
    use_bias_correction_kl=True,

    # the loss: vLLM's importance-sampling correction (_cap: clip_max's deprecated name)
    vllm_importance_sampling_correction=True,
    vllm_importance_sampling_mode="sequence_mask",
    vllm_importance_sampling_clip_max=3.0,
    vllm_importance_sampling_clip_min=None,
    vllm_importance_sampling_cap=None,

    # the optimizer and its schedule (warmup_ratio: older TRL's)
    lr_scheduler_type="linear",
    lr_scheduler_kwargs=None,
    warmup_steps=0,
    warmup_ratio=None,
    weight_decay=0.0,
    max_grad_norm=1.0,

    # the precision (bf16 None: true unless fp16), the memory, the seed
    bf16=None,
    fp16=False,
    gradient_checkpointing=True,
    fsdp=None,
    seed=42,

    # LoRA (ModelConfig)
    use_peft=False,
    lora_r=16,
    lora_alpha=32,
    lora_dropout=0.05,
    lora_target_modules=None,

    # output and checkpoints
    output_dir=None,
    save_steps=500,
    save_total_limit=None,
    resume_from_checkpoint=None,

    # evaluation and logging
    eval_strategy="no",
    eval_steps=None,
    logging_steps=10,
    log_completions=False,
    report_to="none",
    project="huggingface",
)

# The type of a field whose default does not say it (None, or an int that may
# be a float): command-line words and YAML text are read as it.
KINDS = {
    # model and data
    "model_name_or_path": str,
    "dtype": str,
    "torch_dtype": str,
    "dataset_name": str,
    "dataset_config": str,
    "reward_model_name_or_path": str,
    "reward_funcs": list,
    "reward_weights": "floats",

    # the batch, the run's length, sampling
    "generation_batch_size": int,
    "steps_per_generation": int,
    "num_train_epochs": float,
    "max_completion_length": int,
    "max_prompt_length": int,
    "min_p": float,
    "vllm_server_base_url": str,

    # the loss
    "epsilon_high": float,
    "delta": float,
    "scale_rewards": "scale",
    "off_policy_mask_threshold": float,
    "vllm_importance_sampling_clip_max": float,
    "vllm_importance_sampling_clip_min": float,
    "vllm_importance_sampling_cap": float,

    # the optimizer, the precision, LoRA
    "lr_scheduler_kwargs": dict,
    "warmup_steps": "count",
    "warmup_ratio": float,
    "bf16": bool,
    "fsdp": list,
    "lora_alpha": float,
    "lora_target_modules": list,

    # output, checkpoints, evaluation, logging
    "output_dir": str,
    "save_steps": "count",
    "save_total_limit": int,
    "resume_from_checkpoint": str,
    "eval_steps": "count",
    "logging_steps": "count",
    "report_to": list,

    # refused ones (REFUSED), read as TRL reads them
    "generation_kwargs": dict,
    "chat_template_kwargs": dict,
    "model_init_kwargs": dict,
}

# TRL's defaults that a run from TRL's names takes where ours differ, and says
# so at start-up (only those the run did not give)
DIFFERS = (
    "loss_type", "learning_rate", "warmup_steps", "seed", "max_completion_length",
    "entropy_coef", "use_vllm", "gradient_checkpointing", "per_device_train_batch_size",
    "vllm_importance_sampling_correction", "use_bias_correction_kl", "lora_dropout",
)

# -----------------------------------------------------------------------------
# TRL's fields with no equivalent here: field -> (TRL's default, why)

# harmless: one warning line when given at another value
LOGGING = "train.py logs every step (metrics.jsonl, --report-to, --log-completions)"
HUB = "nothing is pushed to the Hub here"
EVALUATION = "the held-out evaluation is train.py's (--eval-every, --eval-size)"
SPEED = "a speed or memory setting of TRL's trainer: no number of the training changes"
LOADING = "TRL's data loader: train.py draws the prompts itself (data.batch_indices)"
LAUNCH = "train.py runs under torchrun: DDP, or --fsdp"
SAVING = "train.py saves every --save-every steps and at the end, keeps --keep-last"

HARMLESS = {
    # logging
    **{name: (default, LOGGING) for name, default in dict(
        logging_strategy="steps",
        logging_first_step=False,
        log_on_each_node=True,
        logging_nan_inf_filter=True,
        log_level="passive",
        log_level_replica="warning",
        disable_tqdm=None,
        run_name=None,
        trackio_space_id=None,
        trackio_bucket_id=None,
        trackio_static_space_id=None,
        include_num_input_tokens_seen="no",
        skip_memory_metrics=True,
        debug="",
        log_multimodal=True,
        num_completions_to_print=None,
        log_unique_prompts=False,
    ).items()},

    # the Hub
    **{name: (default, HUB) for name, default in dict(
        push_to_hub=False,
        hub_token=None,
        hub_private_repo=None,
        hub_model_id=None,
        hub_strategy="every_save",
        hub_always_push=False,
        hub_revision=None,
        log_completions_hub_repo=None,
    ).items()},

    # evaluation
    **{name: (default, EVALUATION) for name, default in dict(
        eval_delay=0,
        per_device_eval_batch_size=8,
        prediction_loss_only=False,
        eval_on_start=False,
        eval_do_concat_batches=True,
        eval_use_gather_object=False,
        eval_accumulation_steps=None,
        include_for_metrics=[],
        batch_eval_metrics=False,
        bf16_full_eval=False,
        fp16_full_eval=False,
        num_generations_eval=None,

        # the phases that run, and the best model kept
        do_train=False,
        do_eval=False,
        do_predict=False,
        load_best_model_at_end=False,
        metric_for_best_model=None,
        greater_is_better=None,
        test_split_size=None,
    ).items()},

    # speed and memory
    **{name: (default, SPEED) for name, default in dict(
        tf32=None,
        gradient_checkpointing_kwargs=None,
        torch_compile=False,
        torch_compile_backend=None,
        torch_compile_mode=None,
        use_liger_kernel=False,
        liger_kernel_config=None,
        use_cache=False,
        torch_empty_cache_steps=None,

        # generation
        ds3_gather_for_generation=True,
        pad_to_multiple_of="auto",
        cache_implementation=None,
        use_transformers_continuous_batching=False,
        transformers_continuous_batching_config=None,
        use_transformers_paged=False,
        vllm_model_impl="vllm",
        vllm_server_timeout=240.0,
        vllm_group_port=51216,
        vllm_max_model_length=None,

        # the model's loading, and the devices
        attn_implementation=None,
        use_cpu=False,
        bnb_4bit_quant_type="nf4",
        use_bnb_nested_quant=False,
        bnb_4bit_quant_storage=None,
        average_tokens_across_devices=True,
    ).items()},

    # the data loader
    **{name: (default, LOADING) for name, default in dict(
        dataloader_drop_last=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=True,
        dataloader_persistent_workers=False,
        dataloader_prefetch_factor=None,
        dataloader_multiprocessing_context=None,
        dataloader_in_order=True,
        remove_unused_columns=False,
        label_names=None,
        train_sampling_strategy="random",
        length_column_name="length",
        data_seed=None,
        ignore_data_skip=False,
    ).items()},

    # the launch
    **{name: (default, LAUNCH) for name, default in dict(
        ddp_find_unused_parameters=None,
        ddp_bucket_cap_mb=None,
        ddp_broadcast_buffers=None,
        ddp_static_graph=None,
        ddp_backend=None,
        ddp_timeout=1800,
        fsdp_config=None,
        deepspeed=None,
        accelerator_config=None,
        parallelism_config=None,
        local_rank=-1,
        ignore_bias_buffers=False,
        full_determinism=False,
    ).items()},

    # saving
    **{name: (default, SAVING) for name, default in dict(
        save_strategy="steps",
        save_only_model=False,
        save_on_each_node=False,
        enable_jit_checkpoint=False,
        restore_callback_states_from_checkpoint=False,
    ).items()},

    # each with its own reason
    "trust_remote_code": (False, "models load without their own code here"),
    "disable_dropout": (False, "the policy always runs without dropout here"),
    "label_smoothing_factor": (0.0, "GRPO's loss has no labels to smooth"),
    "max_tool_calling_iterations": (None, "tools: --max-tool-calls, with --tools"),
}

# refused: the run stops in one line when given at another value
ADAMW = "the optimizer is torch's AdamW (betas 0.9, 0.999, eps 1e-8)"

REFUSED = {
    # the optimizer
    "optim": ("adamw_torch_fused", ADAMW),
    "optim_args": (None, ADAMW),
    "optim_target_modules": (None, ADAMW),
    "adam_beta1": (0.9, ADAMW),
    "adam_beta2": (0.999, ADAMW),
    "adam_epsilon": (1e-8, ADAMW),

    # the training's numbers
    "neftune_noise_alpha": (None, "no noise is added to the embeddings here"),
    "auto_find_batch_size": (False, "TRL refuses it for GRPO too"),
    "router_aux_loss_coef": (None, "no Mixture-of-Experts loss here"),
    "cast_lm_head_to_fp32": (False, "the LM head runs in --dtype here"),

    # sampling
    "generation_kwargs": (None, "sampling takes the flags of train.py only"),
    "chat_template_kwargs": (None, "the chat template takes no arguments here "
                                   "(--chat-template FILE replaces it)"),
    "vllm_structured_outputs_regex": (None, "sampling is unconstrained here"),

    # the data
    "shuffle_dataset": (True, "the prompts are always shuffled here"),
    "dataset_streaming": (False, "a dataset is loaded whole here"),
    "datasets": ([], "one dataset here: give dataset_name"),
    "streaming": (False, "a dataset is loaded whole here"),

    # the model
    "model_init_kwargs": (None, "the model loads with train.py's settings only"),
    "model_revision": ("main", "a model loads at its main revision here"),

    # LoRA
    "lora_task_type": ("CAUSAL_LM", "LoRA here adapts a causal LM"),
    "use_rslora": (False, "LoRA's scale here is alpha / rank"),
    "use_dora": (False, "LoRA here is plain LoRA"),
    "lora_target_parameters": (None, "LoRA here adapts modules (lora_target_modules)"),
    "lora_modules_to_save": (None, "LoRA here trains the adapters only"),

    # quantization
    "load_in_8bit": (False, "the weights are not quantized here"),
    "load_in_4bit": (False, "the weights are not quantized here"),
}

# every TRL field here, at its default
DEFAULTS = {**MAPPED,
            **{name: default for name, (default, _) in {**HARMLESS, **REFUSED}.items()}}
# a TRL bool that defaults to true also has a --no_NAME flag (TrlParser's)
TRUE_BOOLS = {name for name, default in DEFAULTS.items() if default is True}


def is_trl(name):
    """Whether name (underscores or dashes) is one of TRL's fields or flags."""
    name = str(name).replace("-", "_")
    if name.startswith("no_") and name[3:] in TRUE_BOOLS:
        return True
    return name in DEFAULTS


def trl_only(name):
    """A TRL name that is not one of our flags: its run is TRL's."""
    return is_trl(name) and our_flag(name) is None


def our_flag(name):
    """name (underscores or dashes) -> our flag, exactly as argparse spells it,
    or None."""
    flag = "--" + str(name).replace("_", "-")
    if flag in config.parser._option_string_actions:
        return flag
    return None


# -----------------------------------------------------------------------------
# Reading the values


def to_bool(text):
    """TrlParser's string_to_bool."""
    if text.lower() in ("yes", "true", "t", "y", "1"):
        return True
    if text.lower() in ("no", "false", "f", "n", "0"):
        return False
    raise ValueError


def coerce(value, kind):
    """A value (YAML's, or a command-line word) -> TRL's type; ValueError if it is not."""
    if value is None or (kind is not str and value in ("none", "null", "None")):
        return None

    if kind in (list, "floats"):
        values = value if isinstance(value, list) else [value]
        if kind == "floats":
            return [coerce(v, float) for v in values]
        return [str(v) for v in values]
    if isinstance(value, list):
        raise ValueError

    if kind is bool:
        return value if isinstance(value, bool) else to_bool(str(value))

    if kind is int:
        fraction = isinstance(value, float) and not value.is_integer()
        if isinstance(value, bool) or fraction:
            raise ValueError
        return int(value)

    if kind in (float, "count"):
        if isinstance(value, bool):
            raise ValueError
        value = float(value)
        return int(value) if kind == "count" and value.is_integer() else value

    if kind is dict:
        value = json.loads(value) if isinstance(value, str) else value
        if not isinstance(value, dict):
            raise ValueError
        return value

    if kind == "scale":  # TRL: true is group, false none
        if isinstance(value, bool) or str(value).lower() in ("true", "false"):
            return "group" if coerce(value, bool) else "none"
    return str(value)


def kind_of(name):
    """A TRL field's type: KINDS', else its default's."""
    default = DEFAULTS[name]
    if name in KINDS:
        return KINDS[name]

    if default is None:
        return str
    return list if isinstance(default, list) else type(default)


WHAT = {bool: "true or false", int: "an integer", float: "a number", "count": "a number",
        "floats": "numbers", dict: "a mapping (JSON on the command line)"}


def read_value(name, value, where):
    """A TRL field's value -> its type, or stop in one line."""
    kind = kind_of(name)
    try:
        return coerce(value, kind)
    except (ValueError, TypeError):
        fail(f"{where}{name}: {value!r} is not {WHAT.get(kind, 'a value')}")


def command_line(argv):
    """argv -> [(name, its words)]: `--name v ...`, `--name=v`, or `--name` alone."""
    items = []
    for word in argv:
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            items.append((name, [value] if eq else []))
        elif not items:
            fail(f"unrecognized argument {word!r}: a value with no flag before it")
        else:
            items[-1][1].append(word)

    return items


def our_spelling(name):
    """A name on the command line that is our flag (TRL's underscores, or a
    prefix argparse takes) -> the flag; None if it is not ours."""
    flag = our_flag(name)
    if flag:
        return flag

    prefix = "--" + name.replace("_", "-")
    matches = [f for f in config.parser._option_string_actions if f.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None


def read_file(path):
    """A --config file's fields, read as config.recipe_words reads them (which
    has said any problem with the file already)."""
    import yaml

    with open(path) as f:
        return yaml.safe_load(f) or {}


# -----------------------------------------------------------------------------
# The run: TRL's fields given, and the flags they become


class TRLRun:
    """The TRL fields given (the command line's over the file's), TRL's
    defaults for the rest, and the words of our flags they become."""

    def __init__(self, given, where, ours, mine):
        self.given = given  # field -> its value
        self.where = where  # field -> where it was given: "--config FILE: " or ""
        self.ours = ours  # the dests of our flags given by their own names
        self.mine = mine  # those flags' values (the rest at our defaults)
        self.words = []  # (field, its flags' words)
        self.defaults = []  # "field value": TRL's defaults taken where ours differ
        self.warnings = []
        self.schedule = False  # TRL's default lr schedule, which is not ours

    def get(self, field):
        return self.given.get(field, DEFAULTS[field])

    def put(self, field, flag, *values):
        """Our flag with values, for field: unless the run gave the flag itself."""
        if config.parser._option_string_actions[flag].dest in self.ours:
            return

        switch = len(values) == 1 and values[0] is True  # (1 == True)
        words = [flag] if switch else [flag, *map(str, values)]
        self.words.append((field, words))

        if field not in self.given and field in DIFFERS:
            self.defaults.append(f"{field} {text(self.get(field))}")

    def emit(self, field, flag):
        """The field's value as flag, when given, or a TRL default of DIFFERS."""
        value = self.get(field)
        values = value if isinstance(value, list) else [value]
        if value is not None and (field in self.given or field in DIFFERS):
            self.put(field, flag, *values)

    def our(self, dest, field):
        """The run's value of our flag dest: its own if given, else the field's."""
        return getattr(self.mine, dest) if dest in self.ours else self.get(field)

    def ignore(self, fields, why):
        """A warning for each of fields given at another value than TRL's default."""
        for field in fields:
            if field in self.given and not at_default(self.given[field], DEFAULTS[field]):
                self.warnings.append(f"warning: {field} {text(self.given[field])}: "
                                     f"ignored ({why})")

    def refuse(self, field, why, fix="drop it"):
        fail(f"{self.where.get(field, '')}{field} {text(self.get(field))} has no "
             f"equivalent here ({why}): {fix}")


def text(value):
    """A value as a TRL user writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(map(text, value))
    if value is None:
        return "null"
    return str(value)


# -----------------------------------------------------------------------------
# The mapping, one part of the run at a time (docs/trl.md: the same table)


def model_and_data(r):
    r.emit("model_name_or_path", "--model")
    for field in ("dtype", "torch_dtype"):
        if r.get(field) not in (None, "float32"):
            r.refuse(field, "the weights load in float32 here, AdamW's master copy; "
                            "bf16 true is the compute dtype")

    if r.our("dataset", "dataset_name") is None:
        r.ignore(("dataset_config", "dataset_train_split", "dataset_test_split"),
                 "no dataset_name: the built-in task")
        return

    r.emit("dataset_name", "--dataset")
    r.emit("dataset_config", "--dataset-config")
    r.emit("dataset_train_split", "--split")
    r.emit("dataset_test_split", "--eval-split")

    # TRL renders the dataset's prompt as it is, with no system prompt
    if "system_prompt" not in r.ours:
        r.words.append(("dataset_name", ["--system-prompt", ""]))
        r.defaults.append("no system prompt")


def rewards(r):
    """reward_model_name_or_path and reward_funcs -> --rewards; TRL's fixed
    soft overlong punishment -> --overlong-buffer."""
    funcs = r.get("reward_funcs") or []
    weights = r.get("reward_weights")
    if r.get("reward_model_name_or_path"):
        funcs = [r.get("reward_model_name_or_path"), *funcs]

    # `trl grpo` builds it with max_completion_len=1280, soft_punish_cache=256;
    # ours ramps over the last --overlong-buffer tokens of --max-new-tokens
    if "get_soft_overlong_punishment" in funcs:
        i = funcs.index("get_soft_overlong_punishment")
        length = r.our("max_new_tokens", "max_completion_length")
        if length != 1280 or (weights and len(weights) == len(funcs) and weights[i] != 1):
            fail(f"reward_funcs get_soft_overlong_punishment: `trl grpo` fixes it at "
                 f"max_completion_len=1280 and weight 1, here it is --overlong-buffer N "
                 f"over --max-new-tokens ({length}): set max_completion_length 1280, or "
                 f"drop it for --overlong-buffer")

        funcs = funcs[:i] + funcs[i + 1:]
        if weights and len(weights) == len(funcs) + 1:
            weights = weights[:i] + weights[i + 1:]
        r.put("reward_funcs", "--overlong-buffer", 256)

    if funcs:
        r.put("reward_funcs", "--rewards", *funcs)
    if weights is not None:
        r.put("reward_weights", "--reward-weights", *weights)


def batch(r):
    """TRL's batch, counted in completions -> ours, in prompts.

    A generation batch, per_device_train_batch_size x ranks x steps_per_generation
    completions (steps_per_generation: gradient_accumulation_steps unless given),
    is one of our steps; an optimizer step takes per_device x
    gradient_accumulation_steps of them a rank; a forward, per_device.
    """
    fields = ("per_device_train_batch_size", "gradient_accumulation_steps",
              "generation_batch_size", "steps_per_generation", "num_generations")
    own = {"G", "prompts_per_step", "minibatch_size", "micro_batch_size"} & r.ours
    if own and not any(f in r.given for f in fields):
        return  # the run's own batch flags, TRL's defaults aside

    G = r.our("G", "num_generations")
    per_device = r.get("per_device_train_batch_size")
    accumulation = r.get("gradient_accumulation_steps")
    generation_batch = r.get("generation_batch_size")
    steps = r.get("steps_per_generation")
    per_step = per_device * world  # completions per forward, all ranks

    # TRL's rules (GRPOConfig.__post_init__), in its words
    if generation_batch is not None and steps is not None:
        fail("'generation_batch_size' and 'steps_per_generation' can not be both "
             "configured at the same time")
    if generation_batch is not None and generation_batch % per_step:
        fail(f"generation_batch_size ({generation_batch}) must be divisible by the "
             f"global batch size ({per_device} * {world})")
    if generation_batch is not None:
        steps = generation_batch // per_step

    if steps is None:
        steps = accumulation
        if per_step * steps % G:
            fewest = G // math.gcd(G, world * accumulation)
            fail(f"the effective batch size (num_processes * per_device_train_batch_size "
                 f"* gradient_accumulation_steps = {world} * {per_device} * "
                 f"{accumulation}) must be evenly divisible by num_generations ({G}), "
                 f"TRL's rule: e.g. per_device_train_batch_size "
                 f"{fewest * math.ceil(per_device / fewest)}")

    generation_batch = per_step * steps
    if generation_batch % G:
        fail(f"generation_batch_size ({generation_batch}) must be divisible by "
             f"num_generations ({G})")

    # ours: a prompt's G completions on one rank, whole optimizer steps a batch
    if per_device * steps % G:
        fail(f"per_device_train_batch_size x steps_per_generation ({per_device} x "
             f"{steps}) must be a multiple of num_generations ({G}) here: a prompt's "
             f"completions stay on one rank")
    if steps % accumulation:
        fail(f"steps_per_generation ({steps}) must be a multiple of "
             f"gradient_accumulation_steps ({accumulation}) here: an optimizer step "
             f"never spans two generation batches")

    r.emit("num_generations", "--G")
    r.put("per_device_train_batch_size", "--prompts-per-step", generation_batch // G)
    r.put("per_device_train_batch_size", "--micro-batch-size", per_device)
    if steps != accumulation:
        r.put("gradient_accumulation_steps", "--minibatch-size",
              per_device * accumulation)


def sampling(r):
    r.emit("max_completion_length", "--max-new-tokens")
    if r.get("max_completion_length") is None:
        r.refuse("max_completion_length", "a completion stops at --max-new-tokens",
                 fix="give a number")
    r.emit("max_prompt_length", "--max-prompt-len")

    for field in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        r.emit(field, "--" + field.replace("_", "-"))

    colocate = ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                "vllm_enable_sleep_mode")
    server = ("vllm_server_base_url", "vllm_server_host", "vllm_server_port")
    if not uses_vllm(r):
        r.put("use_vllm", "--engine", "hf")
        r.ignore(("vllm_mode", *colocate, *server), "without use_vllm, as in TRL")
        return

    r.put("use_vllm", "--engine", "vllm")
    r.emit("vllm_mode", "--vllm-mode")
    if r.our("vllm_mode", "vllm_mode") == "server":
        url = r.get("vllm_server_base_url")
        url = url or f"http://{r.get('vllm_server_host')}:{r.get('vllm_server_port')}"
        r.put("vllm_server_base_url", "--vllm-url", url)
        r.ignore(colocate, "only with vllm_mode colocate, as in TRL")
        return

    r.emit("vllm_gpu_memory_utilization", "--vllm-memory")
    r.emit("vllm_tensor_parallel_size", "--vllm-tp")
    if r.get("vllm_enable_sleep_mode"):
        r.put("vllm_enable_sleep_mode", "--vllm-sleep", True)
    r.ignore(server, "only with vllm_mode server, as in TRL")


def uses_vllm(r):
    """TRL's use_vllm, or our --engine where the run gave it."""
    if "engine" in r.ours:
        return r.mine.engine != "hf"
    return r.get("use_vllm")


def loss(r):
    r.emit("learning_rate", "--lr")
    r.emit("beta", "--beta")
    r.emit("loss_type", "--loss-type")
    r.emit("scale_rewards", "--scale-rewards")
    r.emit("multi_objective_aggregation", "--reward-aggregation")
    r.emit("num_iterations", "--num-iterations")
    r.emit("importance_sampling_level", "--importance-sampling-level")

    r.emit("delta", "--delta")
    r.emit("top_entropy_quantile", "--top-entropy-quantile")
    r.emit("off_policy_mask_threshold", "--off-policy-mask")
    r.emit("entropy_coef", "--entropy-coef")
    if r.get("mask_truncated_completions"):
        r.put("mask_truncated_completions", "--mask-truncated", True)

    # epsilon_high: epsilon's unless given
    if "epsilon" in r.given or "epsilon_high" in r.given:
        r.put("epsilon", "--epsilon-low", r.get("epsilon"))
        high = r.get("epsilon_high")
        r.put("epsilon_high", "--epsilon-high",
              r.get("epsilon") if high is None else high)

    # TRL: the KL term times the IS ratio, by default (DeepSeek-V3.2)
    if r.our("beta", "beta") > 0 and r.get("use_bias_correction_kl"):
        r.put("use_bias_correction_kl", "--kl-bias-correction", True)

    loss_type = r.our("loss_type", "loss_type")
    sapo = ("sapo_temperature_pos", "sapo_temperature_neg")
    if loss_type == "sapo" and any(f in r.given for f in sapo):
        r.put("sapo_temperature_pos", "--sapo-tau", *map(r.get, sapo))
    if loss_type != "sapo":
        r.ignore(sapo, "only with loss_type sapo, as in TRL")

    vespo = ("vespo_k_pos", "vespo_k_neg", "vespo_lambda_pos", "vespo_lambda_neg")
    if loss_type == "vespo" and any(f in r.given for f in vespo):
        r.put("vespo_k_pos", "--vespo-k", r.get("vespo_k_pos"), r.get("vespo_k_neg"))
        r.put("vespo_lambda_pos", "--vespo-lambda", r.get("vespo_lambda_pos"),
              r.get("vespo_lambda_neg"))
    if loss_type != "vespo":
        r.ignore(vespo, "only with loss_type vespo, as in TRL")

    reference = ("ref_model_sync_steps", "ref_model_mixup_alpha")
    if r.get("sync_ref_model"):
        r.put("sync_ref_model", "--sync-ref-every", r.get("ref_model_sync_steps"))
        r.emit("ref_model_mixup_alpha", "--ref-mixup-alpha")
    else:
        r.ignore(reference, "without sync_ref_model, as in TRL")

    adaptive = ("entropy_target", "entropy_coef_delta", "entropy_coef_min",
                "entropy_coef_max")
    if r.get("use_adaptive_entropy"):
        r.put("use_adaptive_entropy", "--adaptive-entropy", True)
        for field in adaptive:
            r.emit(field, "--" + field.replace("_", "-"))
    else:
        r.ignore(adaptive, "without use_adaptive_entropy, as in TRL")

    importance_sampling(r)


def importance_sampling(r):
    """vLLM's sampler against the trainer: TRL corrects it by default, with a
    sequence-level mask at 3. The correction is for vLLM's samples only."""
    fields = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
              "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
              "vllm_importance_sampling_cap")

    if not uses_vllm(r):
        r.ignore(fields, "for vLLM's samples only (use_vllm), as in TRL")
        return
    if {"is_correction", "tis_cap"} & r.ours:
        return  # the run's own correction
    if not r.get("vllm_importance_sampling_correction"):
        r.ignore(fields[1:], "without vllm_importance_sampling_correction, as in TRL")
        return

    cap = r.get("vllm_importance_sampling_cap")
    most = r.get("vllm_importance_sampling_clip_max") if cap is None else cap
    if most is None:
        r.refuse("vllm_importance_sampling_clip_max", "--is-max is a number",
                 fix="give a large one")

    r.put("vllm_importance_sampling_correction", "--is-correction",
          r.get("vllm_importance_sampling_mode"))
    r.put("vllm_importance_sampling_clip_max", "--is-max", most)
    if r.get("vllm_importance_sampling_clip_min") is not None:
        r.put("vllm_importance_sampling_clip_min", "--is-min",
              r.get("vllm_importance_sampling_clip_min"))


def optimizer(r):
    r.emit("weight_decay", "--weight-decay")
    r.emit("max_grad_norm", "--grad-clip")
    r.emit("seed", "--seed")

    if r.get("gradient_checkpointing"):
        r.put("gradient_checkpointing", "--gradient-checkpointing", True)
    if r.get("fsdp"):
        r.put("fsdp", "--fsdp", True)

    # precision: bf16 is TRL's default unless fp16
    if r.get("fp16"):
        r.refuse("fp16", "--dtype is float32 or bfloat16: use bf16 true")
    bf16 = r.get("bf16") is not False
    r.put("bf16", "--dtype", "bfloat16" if bf16 else "float32")
    if "bf16" not in r.given and "dtype" not in r.ours:
        r.defaults.append("bf16 true")

    # the schedule: ours is HF's cosine_with_min_lr at min_lr_rate 0.1
    kind, extra = r.get("lr_scheduler_type"), r.get("lr_scheduler_kwargs") or {}
    lr = r.our("lr", "learning_rate")
    ours = (kind == "cosine_with_min_lr"
            and extra in ({"min_lr_rate": 0.1}, {"min_lr": lr / 10}))
    given = "lr_scheduler_type" in r.given or "lr_scheduler_kwargs" in r.given

    if given and not ours:
        where = r.where.get("lr_scheduler_type", r.where.get("lr_scheduler_kwargs", ""))
        asked = " ".join([kind] + ([json.dumps(extra)] if extra else []))
        fail(f"{where}lr_scheduler_type {asked} has no equivalent here: the schedule is "
             f"a warmup, then a cosine to lr/10 (lr_scheduler_type cosine_with_min_lr, "
             f"lr_scheduler_kwargs {{\"min_lr_rate\": 0.1}}): give that, or drop it")
    if not given:
        r.schedule = True


def lora(r):
    fields = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
    if not r.get("use_peft"):
        r.ignore(fields, "without use_peft, as in TRL")
        return

    r.put("use_peft", "--lora-rank", r.get("lora_r"))
    r.put("lora_alpha", "--lora-alpha", r.get("lora_alpha"))
    r.emit("lora_dropout", "--lora-dropout")

    targets = r.get("lora_target_modules")
    # PEFT's choice for Llama and Qwen models; all-linear: ours
    if targets is None and "lora_targets" not in r.ours:
        targets = ["q_proj", "v_proj"]
        r.defaults.append("lora_target_modules q_proj v_proj (PEFT's for Llama and Qwen)")
    if targets == ["all-linear"]:
        targets = config.LORA_TARGETS
    r.put("lora_target_modules", "--lora-targets", *targets)


def output(r):
    r.emit("output_dir", "--out-dir")
    r.emit("save_total_limit", "--keep-last")

    resume = r.get("resume_from_checkpoint")
    if resume is not None and str(resume).lower() not in ("true", "false"):
        r.refuse("resume_from_checkpoint", "a run resumes from its --out-dir's last "
                                           "checkpoint: give that run's output_dir")
    if resume is not None and str(resume).lower() == "true":
        r.put("resume_from_checkpoint", "--resume", "yes")

    # the dashboards: flags of ours that may not be there yet
    report = r.get("report_to")
    if "report_to" in r.given and "all" in report:
        r.warnings.append("warning: report_to all: ignored (name the dashboards: "
                          "--report-to wandb trackio tensorboard)")
    elif our_flag("report_to"):
        r.emit("report_to", "--report-to")
    else:
        r.ignore(("report_to",), "train.py has no --report-to")

    if our_flag("project"):
        r.emit("project", "--project")
    else:
        r.ignore(("project",), "train.py has no --project")

    if r.get("log_completions") and not our_flag("log_completions"):
        r.ignore(("log_completions",), "train.py has no --log-completions")
    if r.get("eval_strategy") == "epoch":
        r.ignore(("eval_strategy",), "the evaluation runs every --eval-every steps")


def harmless_and_refused(r):
    """The fields with no equivalent: a warning or a stop, unless at TRL's default."""
    for field, value in r.given.items():
        if field in HARMLESS and not at_default(value, HARMLESS[field][0]):
            r.warnings.append(f"warning: {field} {text(value)}: no equivalent here, "
                              f"ignored ({HARMLESS[field][1]})")

        # adamw_torch: the same AdamW, unfused
        ours = field in REFUSED and (at_default(value, REFUSED[field][0])
                                     or value == "adamw_torch")
        if field in REFUSED and not ours:
            r.refuse(field, REFUSED[field][1])


def at_default(value, default):
    """Whether a value given is TRL's default (a list field's, as its one item)."""
    if default in ([], None):
        return value in ([], {}, None, "")
    return value == default or value == [default]


PARTS = (model_and_data, rewards, batch, sampling, loss, optimizer, lora, output,
         harmless_and_refused)


# -----------------------------------------------------------------------------
# What needs the run's optimizer steps (after the flags are parsed)


def optimizer_steps_per_step(args):
    """TRL counts optimizer steps; one of our steps takes this many."""
    n_local = max(1, args.prompts_per_step // world * args.G)  # 0: check_flags says it
    return args.num_iterations * max(1, n_local // (args.minibatch_size or n_local))


def counts(r, args):
    """max_steps, warmup_steps, save_steps, eval_steps, logging_steps: TRL's
    optimizer steps (or a share of the run's, under 1) -> ours.

    -> {our dest: share of the run's optimizer steps}, for resolve_epochs when
    num_train_epochs sets the run's length.
    """
    k = optimizer_steps_per_step(args)
    shares = {}

    def count(dest, value, opt_steps=False):
        """value optimizer steps (a share of the run's, under 1) -> args.dest."""
        if dest in r.ours or value is None:
            return

        if 0 < value < 1:
            shares[dest] = value
        elif opt_steps:
            setattr(args, dest, int(value))
        else:
            setattr(args, dest, max(1, math.ceil(value / k)))

    max_steps = r.get("max_steps")
    if "steps" not in r.ours and max_steps > 0 and max_steps % k:
        fail(f"max_steps {max_steps} must be a multiple of the {k} optimizer steps each "
             f"generation batch takes here (num_iterations x steps_per_generation / "
             f"gradient_accumulation_steps)")
    if "steps" not in r.ours and max_steps > 0:
        args.steps = max_steps // k

    # warmup: a count, or a share (older TRL's warmup_ratio)
    warmup = r.get("warmup_steps")
    if not warmup and r.get("warmup_ratio"):
        warmup = r.get("warmup_ratio")
    count("warmup_steps", warmup, opt_steps=True)
    if (not {"warmup_steps", "warmup_ratio"} & set(r.given)
            and "warmup_steps" not in r.ours):
        r.defaults.append("warmup_steps 0")

    if "save_steps" in r.given:
        count("save_every", r.get("save_steps"))

    strategy = r.get("eval_strategy")
    if strategy == "no" and "eval_strategy" in r.given and "eval_every" not in r.ours:
        args.eval_every = 0
    if strategy == "steps":
        count("eval_every", r.get("eval_steps") or r.get("logging_steps"))

    if r.get("log_completions") and our_flag("log_completions"):
        count("log_completions", r.get("logging_steps"))
    elif "logging_steps" in r.given:
        r.ignore(("logging_steps",), LOGGING)

    return shares


def apply_shares(args, shares, k):
    """The counts TRL gives as a share of the run's optimizer steps, now that
    --steps is known."""
    total = args.steps * k
    for dest, share in shares.items():
        opt_steps = math.ceil(total * share)
        value = opt_steps if dest == "warmup_steps" else max(1, math.ceil(opt_steps / k))
        setattr(args, dest, value)


# -----------------------------------------------------------------------------
# The entry points: config.parse_args, and train.py once the rows are loaded


def parse_args(argv):
    """argv holding TRL's names -> train.py's flags (argparse's Namespace).

    One line for each TRL field ignored, one for TRL's defaults taken; one line
    and exit on a field refused, an unknown name, or a TRL rule broken.
    """
    items = command_line(argv)
    path = next((words[-1] for name, words in items if name == "config" and words), None)
    fields, recipe = {}, None
    if path:
        # any problem with the file said; None: not ours
        recipe = config.recipe_words(path)
        fields = read_file(path)

    # no TRL name: our flags, spelled with underscores or abbreviated
    names = [*fields, *(n for n, _ in items)]
    if not any(trl_only(name) or name == "env" for name in names):
        return ours_alone(items, path, recipe)

    # TRL's fields: the file's, then the command line's over them
    given, where = {}, {}
    for key, value in fields.items():
        name = str(key).replace("-", "_")
        if name == "env":
            os.environ.update({str(k): str(v) for k, v in (value or {}).items()})
        elif is_trl(name):
            read_field(name, value, f"--config {path}: ", given, where)

    # our flags: the file's, then the command line's
    ours = []
    if path:
        ours = config.recipe_words(path, skip=lambda key: key == "env" or is_trl(key))
        check(ours, f"--config {path}: ")
    for name, values in items:
        if is_trl(name):
            read_field(name.replace("-", "_"), words_value(name, values), "", given,
                       where)
        elif our_spelling(name):
            ours += [our_spelling(name), *values]
        else:
            fail(f"unrecognized argument --{name}: not a flag of train.py "
                 f"(python train.py --help), nor TRL's (docs/trl.md)")

    mine = config.parser.parse_args(ours)
    dests = {config.parser._option_string_actions[w].dest for w in ours
             if w in config.parser._option_string_actions}

    # the TRL fields' words, each checked by the parser alone: an error names its field
    r = TRLRun(given, where, dests, mine)
    for part in PARTS:
        part(r)
    for field, words in r.words:
        check(words, f"{where.get(field, '')}{field} {text(r.get(field))}: ")
    args = config.parser.parse_args([w for _, words in r.words for w in words] + ours)

    resolve_counts(r, args)

    for line in r.warnings:
        print0(line)
    if r.defaults:
        print0("TRL's defaults, where train.py's differ (docs/trl.md): "
               + ", ".join(dict.fromkeys(r.defaults))
               + ("; not its linear lr schedule: ours, a warmup, then a cosine to lr/10"
                  if r.schedule else ""))

    return args


def ours_alone(items, path, recipe):
    """A run with no TRL name: our flags, spelled with underscores or abbreviated."""
    if path and recipe is None:
        config.recipe_words(path, skip=is_trl)  # its unknown field stops the run

    words = []
    for name, values in items:
        if our_spelling(name) is None:
            fail(f"unrecognized argument --{name}: not a flag of train.py "
                 f"(python train.py --help), nor TRL's (docs/trl.md)")
        words += [our_spelling(name), *values]

    return config.parse_args(words)


def resolve_counts(r, args):
    """The counts TRL gives in optimizer steps -> ours (counts); the run's length:
    max_steps -> --steps now, or num_train_epochs left in args.trl_epochs for
    resolve_epochs."""
    shares = counts(r, args)
    k = optimizer_steps_per_step(args)

    by_epochs = "steps" not in r.ours and r.get("max_steps") <= 0
    if by_epochs and r.get("num_train_epochs") <= 0:
        fail(f"{r.where.get('num_train_epochs', '')}num_train_epochs "
             f"{text(r.get('num_train_epochs'))} trains no step: give a number > 0, or "
             f"max_steps")

    if by_epochs:
        args.trl_epochs = dict(num_train_epochs=r.get("num_train_epochs"), shares=shares,
                               optimizer_steps_per_step=k)
        if "num_train_epochs" not in r.given:
            r.defaults.append(f"num_train_epochs {text(r.get('num_train_epochs'))}")
    else:
        apply_shares(args, shares, k)


def read_field(name, value, where, given, where_of):
    """One TRL field into given: --no_NAME is NAME false."""
    if name.startswith("no_") and name[3:] in TRUE_BOOLS:
        if value not in (None, True, []):
            fail(f"{where}--{name} takes no value, got {text(value)}")
        name, value = name[3:], False

    given[name] = read_value(name, value, where)
    where_of[name] = where


def words_value(name, values):
    """A TRL flag's command-line words -> one value: a list for a list field,
    true for a bare switch, else its one word."""
    field = name.replace("-", "_")
    if field.startswith("no_") and field[3:] in TRUE_BOOLS:
        return values[0] if values else None  # read_field refuses a value
    if kind_of(field) in (list, "floats"):
        return values
    if not values and kind_of(field) is bool:
        return True

    if len(values) != 1:
        fail(f"--{name} takes one value, got {len(values)}")
    return values[0]


def check(words, where):
    """Parse words alone, so that an error names where they came from."""
    config.parser.error = lambda message: fail(f"{where}{message}")
    try:
        config.parser.parse_args(words)
    finally:
        config.parser.error = fail


def resolve_epochs(args, num_rows):
    """num_train_epochs -> --steps, once the training set's size is known
    (train.py, after data.load_rows). TRL's epoch: its whole generation
    batches, num_rows // prompts-per-step; ValueError if there is none."""
    pending = args.trl_epochs
    per_epoch = num_rows // args.prompts_per_step
    if per_epoch == 0:
        raise ValueError(f"num_train_epochs: the {num_rows} training prompts fill no "
                         f"step of {args.prompts_per_step} prompts (TRL drops a partial "
                         f"batch): give max_steps")

    args.steps = math.ceil(pending["num_train_epochs"] * per_epoch)
    apply_shares(args, pending["shares"], pending["optimizer_steps_per_step"])
    print0(f"num_train_epochs {text(pending['num_train_epochs'])} over {num_rows} "
           f"training prompts, {args.prompts_per_step} a step ({per_epoch} steps an "
           f"epoch): --steps {args.steps}")
