"""
The methods server mode runs inside vLLM's own server: a worker extension,
mixed into each of the server's workers, that server.RemoteEngine calls through
vLLM's dev-mode route POST /collective_rpc. Start the server with it (and this
folder on PYTHONPATH):

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=. python -m vllm.entrypoints.openai.api_server \\
        --model DIR --worker-extension-cls engines.worker_extension.WeightSync ...

(TRL and verl reach into vLLM's workers the same way.) It imports nothing of
ours: the server's node needs this one file, not the trainer's dependencies.

Simplifications:
1. The CPU path's weights come as a safetensors file that the trainer wrote on
   a filesystem the server reads (the same node). On GPUs the weights go by
   vLLM's NCCL weight transfer instead (server.py), which needs none of this
   but model_info.
2. The file holds the trainer's full state dict, lm_head.weight included for
   tied embeddings: vLLM's own reload_weights(weights_path=...) of a
   save_pretrained folder does not re-tie the head (its log-probs were off by
   17-33 here), and a layer is refreshed only once all its weights arrived.
"""


class WeightSync:
    """Mixed into vLLM's worker class (vLLM 0.32: worker_base.py): self is the
    worker, self.model_runner its model runner."""

    def tinygrpo_model_info(self):
        """What the client checks before it trusts this server: the model's
        shape, the log-probs' mode, this worker's share of the server."""
        config = self.vllm_config.model_config
        text = config.hf_text_config
        weight_transfer = self.vllm_config.weight_transfer_config
        fields = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "tie_word_embeddings")
        info = {name: getattr(text, name, None) for name in fields}
        info.update(architectures=list(config.architectures or []),
                    dtype=str(config.dtype).removeprefix("torch."),
                    max_model_len=config.max_model_len,
                    logprobs_mode=config.logprobs_mode,
                    weight_transfer=getattr(weight_transfer, "backend", None),
                    device=str(self.vllm_config.device_config.device_type),
                    chunked_prefill=bool(self.vllm_config.scheduler_config.enable_chunked_prefill))
        return info

    def tinygrpo_reload(self, path):
        """Reload every weight in the safetensors file at path, in place (the
        layer-wise reload re-processes each layer once its weights are in)."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        # an unreadable file fails here, with the weights untouched
        tensors = load_file(path)

        weights = iter(tensors.items())
        try:
            self.model_runner.reload_weights(weights_iterator=weights,
                                             is_checkpoint_format=True)
        except Exception as e:
            # A reload that fails midway (a weight of the wrong shape) leaves
            # layers on the meta device, and the next step would kill the
            # engine. Put every layer back (its old weights where none of the
            # new arrived): the server keeps serving, and the next full sync
            # replaces them all.
            finalize_layerwise_reload(self.model_runner.get_model(),
                                      self.vllm_config.model_config)
            # vLLM shows the message only: name the error
            raise RuntimeError(f"reloading {path}: {type(e).__name__} {e}") from e
        return len(tensors)
