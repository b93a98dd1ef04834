"""
Benchmarks, one mode per stage. Every figure is a ratio against a baseline
measured in the same run. From the repo root:

    python -m bench rollout            # vLLM vs the HF engine: tokens/s, weight sync
    python -m bench kernel             # fused GRPO loss vs PyTorch, torch.compile, Liger
    python -m bench kernel --tiny      # the same on tiny shapes, TRITON_INTERPRET=1 (CPU)
    python -m bench gpu                # the README's GPU figures in one run (<= 8 min)
    python -m bench gpu --tiny         # the same code paths on CPU at toy sizes (CI)
    python -m bench memory             # peak RSS of one update step per micro-batch size
    python -m bench lora               # trainer memory with and without LoRA (Qwen2.5)
    python -m bench update             # the update, prefix-shared vs whole sequences
    python -m bench runs OUT [OUT ...] # out-dirs: median step, stages, time to >= 0.95
    python -m bench trl --seeds 0 1 2  # TRL's GRPOTrainer vs train.py (needs trl)
    python -m bench trl --real         # the same on SmolLM2-135M-Instruct (bench/trl_real.py)
    python -m bench real --max-minutes 15  # SmolLM2-135M-Instruct: speed against the floor
    python -m bench learn              # SmolLM2-135M-Instruct learns word problems, TRL beside it
    python -m bench overlap            # SmolLM2: vLLM's server, sync vs --max-staleness 2 vs colocated
    python -m bench server_ranks       # SmolLM2: 2 ranks' sampling, vLLM's server vs our old one
    python -m bench contention         # SmolLM2's update on core 1, alone and beside a load on core 0
    python -m bench decode             # SmolLM2-135M-Instruct: the HF decode, plain head vs tiled
    python -m bench tools_run          # --tools python vs no tools: 4-5 digit products
    python -m bench game_run           # guess the number, with vs without the environment

rollout runs on CPU or GPU, memory and real on CPU, kernel on a GPU. gpu needs one
GPU; with --tiny it takes about 1 min of CPU. trl runs train.py with both engines
(HF, vLLM). update measures the forward + backward.

`gpu` runs three sections, each printed as it goes. The JSON (--out, default
bench_gpu.json) is written after each one. Models are built from configs (random
init): nothing is downloaded. A section that fails or passes its deadline (its
share of --max-minutes) records its error, and the next one runs. The exit status
is 1 if any failed.
1. kernel:  the kernel table at N = 16,384 tokens, V = 151,936, bf16, beta 0 and
            0.04.
2. rollout: vLLM vs the HF engine on a Qwen2.5-0.5B-shaped model (its 151,936
            vocabulary, tied embeddings), 64 prompts x G = 8 x 512 new tokens. Also
            the in-process weight sync, and the memory the vLLM engine allocates at
            start-up (weights + KV cache) at --vllm-memory.
3. train:   20 steps of train.py (a subprocess) on that model in bf16, 16 prompts x
            G = 8 x 256 tokens. The median seconds per step over steps 3-20 (rollout,
            reward, update, sync, total), and the peak memory it logs (mem_peak_gb:
            trainer and in-process engine together), beside the engine's share from
            section 2.

Files: shared.py (shapes, the never-EOS tokenizer, random-init models, the median
timer), engines.py (rollout), kernel.py, gpu.py and gpu_train.py (gpu), memory.py
(memory, lora), update.py, runs.py (runs, trl), trl_real.py (trl --real), learn.py
(learn); __main__.py parses the command line.
"""
