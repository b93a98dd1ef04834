"""What importing a module drags in, checked in a fresh interpreter (the test process has imported everything)."""
import subprocess
import sys

from helpers import ENV, ROOT

NO_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):  # this interpreter is a machine without Triton
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
"""


def run_fresh(code):
    """Run code in a new interpreter from the repo root, as `python train.py` would see the modules."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**ENV, "PYTHONPATH": ROOT},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_training_without_triton(tmp_path):
    """transformers probes the module name `kernels` (the HF kernels hub package) when it loads a model and,
    from the repo root, imports ours: kernels/__init__.py must not import Triton, or a machine without it
    cannot load a model at all. (With Triton installed torch's dynamo imports it anyway, so the check here
    is that our kernel module stays unloaded.)"""
    run_fresh(NO_TRITON + f"""
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
Qwen2ForCausalLM(config).save_pretrained({str(tmp_path)!r})
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
import kernels, loss
logits = model(torch.tensor([[1, 2, 3]])).logits  # (1, 3, V)
loss.policy_loss(logits, torch.tensor([[4, 5, 6]]), torch.ones(1), torch.ones(1, 3), minibatch_size=1,
                 minibatch_tokens=torch.tensor(3.0), impl=loss.resolve_impl("auto", "cpu"))[0].backward()
assert "kernels.grpo" not in sys.modules
try:  # the kernel itself still needs Triton: the error comes at first use
    from kernels import fused_grpo_token_loss
    raise AssertionError("imported the kernel without Triton")
except ModuleNotFoundError as e:
    assert e.name == "triton", e
""")


def test_loading_a_model_leaves_the_kernel_unloaded(tmp_path):
    """With Triton installed: transformers' probe imports our package but not kernels/grpo.py."""
    run_fresh(f"""
import sys
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
Qwen2ForCausalLM(config).save_pretrained({str(tmp_path)!r})
AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
assert "kernels.grpo" not in sys.modules, "loading a model imported kernels/grpo.py"
from kernels import fused_grpo_token_loss  # and the lazy import still works
assert "kernels.grpo" in sys.modules
""")


def test_stage_modules_import_no_other_stage():
    """loss, reward and advantage are tensor-in/tensor-out stages: importing them loads no other stage."""
    run_fresh("""
import sys
import advantage, loss, reward
loaded = {"rollout", "train", "task", "server", "checkpoint"} & set(sys.modules)
assert not loaded, f"imported {sorted(loaded)}"
""")
