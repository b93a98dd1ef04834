"""`python -m bench MODE [flags]`: the command line.

bench/__init__.py lists the modes.
"""
import argparse
import importlib

import torch

import bench

# mode: (module in bench/, function)
MODES = {
    "rollout": ("engines", "bench_rollout"),
    "kernel": ("kernel", "bench_kernel"),
    "gpu": ("gpu", "bench_gpu"),
    "memory": ("memory", "bench_memory"),
    "lora": ("memory", "bench_lora"),
    "update": ("update", "bench_update"),
    "runs": ("runs", "bench_runs"),
    "trl": ("runs", "bench_trl"),
    # trl --real: the TRL side, in the subprocess it starts
    "_trl_real": ("trl_real", "trl_run"),
    "real": ("real", "bench_real"),
    "learn": ("learn", "bench_learn"),
    "overlap": ("overlap", "bench_overlap"),
    "server_ranks": ("overlap", "bench_server_ranks"),
    "contention": ("overlap", "bench_contention"),
    "decode": ("decode", "bench_decode"),
    # learn: the TRL side, in the subprocesses it starts
    "_trl_learn": ("learn", "trl_learn"),
    "tools_run": ("tools_run", "bench_tools_run"),
    "game_run": ("game_run", "bench_game_run"),
    "sameness": ("sameness", "bench_sameness"),
    # one setting of `memory`, in the subprocess it starts
    "_memory_step": ("memory", "memory_step"),
}


def parse_args():
    parser = argparse.ArgumentParser(prog="python -m bench", description=bench.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument

    add("mode", choices=list(MODES))
    add("out_dirs", nargs="*", help="runs: train.py out-dirs; sameness: run TREE "
        "OUTROOT, or compare BASEROOT NEWROOT")
    add("--tiny", action="store_true",
        help="small shapes, CPU-runnable (checks the script itself)")
    add("--repeats", type=int, default=None,
        help="timed repeats per figure (median reported); default 5 (gpu: 1 for "
        "rollouts, and with --tiny for the kernel too)")
    add("--threads", type=int, default=1, help="torch CPU threads")
    add("--peak-gbps", type=float, default=None,
        help="memory bandwidth for the roofline (GPU)")

    # gpu mode
    add("--out", default="bench_gpu.json", help="gpu: the JSON file written")
    add("--max-minutes", type=float, default=None,
        help="gpu (default 8): the whole run's deadline; the kernel section must end "
        "by 30%% of it, rollout by 65%%, train by 100%%. real (8): its learning "
        "run. learn (15): each run's training time")
    add("--vllm-memory", type=float, default=None,
        help="gpu: the vLLM engine's memory fraction in rollout and train "
        "(default: train.py's 0.3; --tiny on CPU: about 3 GB of the RAM)")
    add("--engine", default=None, choices=["auto", "vllm", "hf"],
        help="gpu: train.py's --engine (default: vllm with --tiny, else auto: "
        "vLLM when installed)")

    add("--new-tokens", type=int, default=64, help="memory: completion length")

    # trl mode
    add("--seeds", type=int, nargs="+", default=None,
        help="trl (default 0): one comparison per seed; learn, overlap (default 0 1)")
    add("--steps", type=int, default=None,
        help="trl: GRPO steps of each run (default: train.py's); gpu: the train "
        "section's steps (default 20); overlap: each run's (default 20)")
    add("--no-vllm", action="store_true",
        help="trl: leave out train.py --engine vllm")
    add("--eval-every", type=int, default=25,
        help="trl: held-out evaluation every N steps, both trainers")
    add("--real", action="store_true",
        help="trl: side by side on SmolLM2-135M-Instruct (bench/trl_real.py)")
    add("--low-memory", action="store_true",
        help="trl --real: both trainers recompute activations in the backward (TRL's "
        "gradient_checkpointing, its default; train.py --gradient-checkpointing), and "
        "train.py's vLLM engine sleeps during the update (--vllm-sleep)")

    # learn mode
    add("--no-trl", action="store_true", help="learn: train.py's runs only")
    add("--frozen", action="store_true",
        help="overlap: lr 1e-30 (no weight moves), evaluations at the start and end only: the steps an hour "
        "at equal completion lengths")
    add("--plot", default=None,
        help="learn, overlap: the PNG written (default: in its work folder)")

    # sameness mode
    add("--only", nargs="+", default=None, metavar="NAME",
        help="sameness run: these runs only (default: all of bench/sameness.py's RUNS)")
    add("--extra", default=None, metavar="FLAGS",
        help="sameness run: flags appended to every train.py run, one string "
        '(--extra="--fast auto")')

    # _trl_real, _trl_learn: its checkpoint and data; _trl_learn: its seed and
    # training seconds
    add("--model", help=argparse.SUPPRESS)
    add("--dataset", help=argparse.SUPPRESS)
    add("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add("--budget", type=float, default=None, help=argparse.SUPPRESS)

    # _memory_step: its one setting
    add("--micro", type=int, default=2, help=argparse.SUPPRESS)
    add("--completions", type=int, default=16, help=argparse.SUPPRESS)

    return parser.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.max_minutes is None:
        args.max_minutes = 15.0 if args.mode == "learn" else 8.0
    if args.seeds is None:
        args.seeds = [0, 1] if args.mode in ("learn", "overlap") else [0]
    if args.mode != "gpu":
        args.repeats = args.repeats or 5

    module, function = MODES[args.mode]
    getattr(importlib.import_module(f"bench.{module}"), function)(args)


if __name__ == "__main__":
    main()
