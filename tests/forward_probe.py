"""A probe that train.py loads as a reward function: --rewards forward_probe.zero.

tests/ is on PYTHONPATH in helpers.run_train. Importing this module hooks the
forward of every nn.Embedding in the process, and a forward over more than
MICRO sequences stops the run. With --engine vllm (whose model has its own
embedding class) every such forward is the trainer's: the update, the old
log-probs, the reference log-probs.
"""
import torch

MICRO = 2  # the --micro-batch-size the test passes


def _check_batch(module, args):
    if not isinstance(module, torch.nn.Embedding) or not args:
        return

    if args[0].dim() == 2 and args[0].shape[0] > MICRO:
        raise RuntimeError(f"a trainer forward over {args[0].shape[0]} sequences: "
                           f"more than --micro-batch-size {MICRO}")


torch.nn.modules.module.register_module_forward_pre_hook(_check_batch)


def zero(completions, **kw):
    return [0.0] * len(completions)
