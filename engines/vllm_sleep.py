"""--vllm-sleep: on CPU, the colocated vLLM engine frees its copy of the weights
and its KV cache from the end of a step's sampling to the next weight sync,
which refills both. Nothing reads them during the update, whose peak they would
add to: 0.8 GiB of a SmolLM2-135M run.

    python train.py --engine vllm --vllm-sleep

attach() is how train.py puts it in, once at set-up: the step's sampling (all
of its rounds, with --dynamic-sampling) ends with sleep, and the sync ends with
wake.

Tests: python -m pytest -q tests/test_rollout.py -k sleep

Simplifications:
1. vLLM's own sleep mode needs enable_sleep_mode at start, and a GPU: this one
   is the CPU's. vLLM's CPU linear layers hold their own packed copies of the
   weights (oneDNN), and the KV cache is one zeroed buffer. The layers' packed
   copies are dropped, and the buffer's storage is resized to 0 with its views
   kept (FSDP's way of freeing a parameter). The sync's reload_weights repacks
   every layer it sends, and wake gives the buffer back zeroed, as vLLM starts
   it.
2. It needs a sync that sends every layer (not LoRA's), and one engine per rank
   (not tensor-parallel shards, whose reload refills only some layers):
   config.py refuses the others.
"""
import time


def attach(sample_and_score, engine):
    """-> (sample_and_score, then sleep; sync_weights, then wake) for train.py.
    engine: a VLLMEngine, or the tools' engine around one."""
    vllm = getattr(engine, "engine", engine)

    def sample_then_sleep(consumed):
        drawn = sample_and_score(consumed)
        sleep(vllm)
        return drawn

    def sync_then_wake(model):
        result = engine.sync_weights(model)
        start = time.perf_counter()
        wake(vllm)
        result["seconds"] += time.perf_counter() - start
        return result

    return sample_then_sleep, sync_then_wake


def sleep(vllm):
    """Free the VLLMEngine's packed weights and its KV cache (CPU only; a no-op
    on GPU, for tensor-parallel shards, and when already asleep)."""
    if not vllm.on_cpu or vllm.tp_group is not None or vllm.asleep:
        return
    vllm.llm.collective_rpc(_free_weights_and_kv_cache)
    vllm.asleep = True


def wake(vllm):
    """After a sync: the KV buffer back, once every layer the sleep freed was
    sent again (repacked by the reload)."""
    if not vllm.asleep:
        return
    missing = sum(vllm.llm.collective_rpc(_layers_asleep), [])
    if missing:
        raise RuntimeError(f"--vllm-sleep freed layers this sync did not send "
                           f"({', '.join(missing[:3])}, ...): sleep needs a sync of every "
                           f"layer, not LoRA's")
    vllm.llm.collective_rpc(_restore_kv_cache)
    vllm.asleep = False


def _asleep(*args, **kwargs):
    raise RuntimeError("this vLLM layer is asleep: the next weight sync refills it")


def _free_weights_and_kv_cache(worker):
    """sleep, inside vLLM's worker."""
    runner = worker.model_runner

    # each linear layer's cpu_linear holds its packed weight
    for module in runner.get_model().modules():
        if hasattr(module, "cpu_linear"):
            module.cpu_linear = _asleep

    # every layer's KV cache is a view of one buffer (vLLM's allocate_kv_cache):
    # find the storages first, since a freed one's data_ptr is 0
    storages = {}
    for kv in runner.kv_caches:
        storages.setdefault(kv.untyped_storage().data_ptr(), kv)
    worker.tinygrpo_kv_sizes = [(kv, kv.untyped_storage().nbytes())
                                for kv in storages.values()]
    for kv, _ in worker.tinygrpo_kv_sizes:
        kv.untyped_storage().resize_(0)


def _restore_kv_cache(worker):
    """The KV buffer back at its size, zeroed as vLLM allocates it."""
    for kv, nbytes in worker.tinygrpo_kv_sizes:
        storage = kv.untyped_storage()
        storage.resize_(nbytes)
        storage.fill_(0)
    worker.tinygrpo_kv_sizes = []


def _layers_asleep(worker):
    """The names of the layers the last reload did not repack."""
    model = worker.model_runner.get_model()
    return [name for name, module in model.named_modules()
            if getattr(module, "cpu_linear", None) is _asleep]
