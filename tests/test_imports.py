"""What importing a module drags in, and the shape of the project's imports.

The first checks run in a fresh interpreter, since the test process has imported
everything. The last ones read the import statements of the project's modules.
"""
import ast
import os
import subprocess
import sys

from helpers import ENV, ROOT

NO_TRITON = """
import importlib.abc, sys
# this interpreter is a machine without Triton
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
"""


def run_fresh(code):
    """Run code in a new interpreter from the repo root, as `python train.py` would see
    the modules."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          env={**ENV, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_training_without_triton(tmp_path):
    """A machine without Triton can still load a model and train on the CPU.

    transformers probes the module name `kernels` (the HF kernels hub package) when
    it loads a model, and from the repo root it imports ours. So kernels/__init__.py
    must not import Triton, or a machine without it cannot load a model at all.
    With Triton installed, torch's dynamo imports it anyway: the check here is that
    our kernel module stays unloaded.
    """
    run_fresh(NO_TRITON + f"""
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
Qwen2ForCausalLM(config).save_pretrained({str(tmp_path)!r})
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})

import batch, kernels, loss
logits = model(torch.tensor([[1, 2, 3]])).logits  # (1, 3, V)
impl, _ = loss.choose_impl("auto", "cpu")
rows = batch.UpdateBatch(completion_ids=torch.tensor([[4, 5, 6]]),
                         completion_mask=torch.ones(1, 3), advantages=torch.ones(1),
                         sampling_logps=None)
settings = loss.LossSettings(impl=impl)
out = loss.policy_loss(logits, rows, settings, minibatch_size=1,
                       minibatch_tokens=torch.tensor(3.0))
out[0].backward()
assert "kernels.grpo" not in sys.modules

# the kernel itself still needs Triton: the error comes at first use
try:
    from kernels import fused_grpo_token_loss
    raise AssertionError("imported the kernel without Triton")
except ModuleNotFoundError as e:
    assert e.name == "triton", e
""")


def test_loading_a_model_leaves_the_kernel_unloaded(tmp_path):
    """With Triton installed, transformers' probe imports our package.

    It does not import kernels/grpo.py.
    """
    run_fresh(f"""
import sys
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
Qwen2ForCausalLM(config).save_pretrained({str(tmp_path)!r})
AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
assert "kernels.grpo" not in sys.modules, "loading a model imported kernels/grpo.py"

# and the lazy import still works
from kernels import fused_grpo_token_loss
assert "kernels.grpo" in sys.modules
""")


def test_stage_modules_import_no_other_stage():
    """loss, reward and advantage are tensor-in/tensor-out stages.

    Importing them loads no other stage.
    """
    run_fresh("""
import sys
import advantage, loss, reward
loaded = {"rollout", "train", "task", "engines.server", "checkpoint"} & set(sys.modules)
assert not loaded, f"imported {sorted(loaded)}"
""")


# -----------------------------------------------------------------------------
# The import graph, read from the source: the project's modules at the repo root
# and in its folders

# the folders of modules: the kernel, the speed machinery, each feature's room
PACKAGES = ("kernels", "fast", "data_sources", "engines", "environments", "resume", "rewards",
            "runlog", "sampling", "scale", "tools", "trl_compat", "variants")
# the top level: the five stages, the loop, the flags, and what a default run needs
TOP_LEVEL = {"train", "config", "rollout", "reward", "advantage", "loss", "model", "data",
             "task", "batch", "common", "checkpoint"}


def project_modules():
    """{module name: its file} for the project's own modules (tests and bench aside)."""
    modules = {}
    for name in sorted(os.listdir(ROOT)):
        if name.endswith(".py"):
            modules[name[:-3]] = os.path.join(ROOT, name)

    for package in PACKAGES:
        folder = os.path.join(ROOT, package)
        modules[package] = os.path.join(folder, "__init__.py")
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py") and name != "__init__.py":
                modules[f"{package}.{name[:-3]}"] = os.path.join(folder, name)

    return modules


def module_level(nodes):
    """The import statements among nodes that run when the module is imported.

    These are the imports at module level, in its if/try/with blocks and in class
    bodies. An import inside a function runs at its first call, and cannot close a
    cycle at import time.
    """
    for node in nodes:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue

        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue

        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from module_level(getattr(node, field, []))


def top_level_imports(path, modules):
    """The project modules that the file at path imports when it is imported."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    folder = os.path.basename(os.path.dirname(path))
    package = folder if folder in PACKAGES else ""

    found = set()
    for node in module_level(tree.body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = f"{package}.{base}" if base else package
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        found.update(n for n in names if n in modules)

    return found


def import_graph():
    modules = project_modules()
    return {name: top_level_imports(path, modules) for name, path in modules.items()}


def imports_anywhere(path):
    """The module names a file imports, at any level (a function's included)."""
    names = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
    return names


def test_the_top_level_holds_the_stages_and_what_a_default_run_needs():
    """At most 12 .py files at the top; every feature lives in a folder named for
    what it holds, and no folder shadows the standard library or an installed
    package (a script run from the repo root would import ours)."""
    top = {name[:-3] for name in os.listdir(ROOT) if name.endswith(".py")}
    assert top == TOP_LEVEL, sorted(top ^ TOP_LEVEL)

    run_fresh(f"""
import importlib.util, sys
sys.path.remove({ROOT!r}) if {ROOT!r} in sys.path else None
sys.path = [p for p in sys.path if p not in ("", ".")]
taken = [name for name in {PACKAGES!r} if importlib.util.find_spec(name) is not None]
assert not taken, f"folders named as installed modules: {{taken}}"
""")


def test_config_imports_only_common():
    """config.py holds the flags and their choice tuples, which every module may
    read: it imports nothing else of the project, at any level, so no import of
    it closes a circle (TRL's names: train.py hands the run to trl_compat)."""
    modules = project_modules()
    ours = {name for name in imports_anywhere(modules["config"])
            if name.split(".")[0] in modules}
    assert ours <= {"common"}, sorted(ours)


def test_the_loop_reads_as_the_algorithm():
    """train.py's `for step` body stays short: each optional feature attaches at
    set-up to what the loop calls, or is a line in it."""
    lines = open(os.path.join(ROOT, "train.py"), encoding="utf-8").read().splitlines()
    start = lines.index("for step in bar:")
    body = []
    for line in lines[start + 1:]:
        if line and not line.startswith(" "):
            break
        body.append(line)
    assert len(body) <= 90, len(body)


def test_common_is_a_leaf():
    """common.py imports nothing from the project: every other module may import it."""
    assert import_graph()["common"] == set()


def test_no_import_cycles():
    """The project's module-level imports run one way: no module imports itself back."""
    graph = import_graph()
    done = set()

    def visit(name, path):
        if name in path:
            cycle = path[path.index(name):] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return

        for imported in sorted(graph[name]):
            if imported != name:
                visit(imported, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_the_stages_never_import_fast():
    """fast/ is installed by train.py (--fast) and reaches the stages only
    through what fast.install hands back: no other module imports it, at any
    level (a function's import included)."""
    modules = project_modules()
    importers = set()
    for name, path in modules.items():
        if name in ("train", "fast") or name.startswith("fast."):
            continue
        if any(n == "fast" or n.startswith("fast.") for n in imports_anywhere(path)):
            importers.add(name)
    assert not importers, sorted(importers)
