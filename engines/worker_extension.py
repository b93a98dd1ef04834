"""
The code server mode runs inside vLLM's own server: a worker extension, mixed
into each of the server's workers, that server.RemoteEngine calls through
vLLM's dev-mode route POST /collective_rpc; and a middleware that keeps every
route but /health behind the server's key. Start the server with both (and
this folder on PYTHONPATH):

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=. python -m vllm.entrypoints.openai.api_server \\
        --model DIR --worker-extension-cls engines.worker_extension.WeightSync \\
        --middleware engines.worker_extension.RequireKey --api-key KEY ...

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
3. vLLM's --api-key guards /v1, /v2, /inference and /cohere only
   (vllm/entrypoints/serve/middleware/authenticate.py): /collective_rpc, which
   runs the methods below (tinygrpo_reload loads any file it is given into the
   served model), /pause, /reset_prefix_cache and the RL API answer anyone.
   RequireKey guards them all with the same key, compared as vLLM compares it.
"""
import hashlib
import json
import os
import secrets

# the one route a request without the key reaches: vLLM's data-parallel
# supervisor and load balancers poll it, and it tells nothing but "up"
OPEN_ROUTES = ("/health",)


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


class RequireKey:
    """An ASGI middleware for vLLM's server (--middleware
    engines.worker_extension.RequireKey; vLLM 0.32 adds a class named there
    with app.add_middleware): every request but OPEN_ROUTES needs
    "Authorization: Bearer KEY", KEY one of the server's own keys, else 401
    (a websocket is closed before it opens). A server started without a key
    answers 401 to all of them: there is no key to check.

    The keys are those vLLM's own AuthenticationMiddleware checks: --api-key
    (several may be given), else the VLLM_API_KEY environment variable. They
    are read from the arguments vLLM parsed, which its build_app leaves on the
    app (app.state.args) before any request: no second parse of sys.argv that
    could disagree with vLLM's own (`vllm serve`'s positional model, config
    files).
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        # lifespan: start-up and shut-down, no request
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)

        path = scope["path"].removeprefix(scope.get("root_path", ""))
        keys = server_keys(scope)
        if path in OPEN_ROUTES or has_key(scope, keys):
            return await self.app(scope, receive, send)
        await refuse(scope, send, keys)


def server_keys(scope):
    """The server's keys: its --api-key list, else VLLM_API_KEY (as vLLM's
    middleware/register.py), from the args on the app (RequireKey says why)."""
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]
    return [key for key in keys if key]


def has_key(scope, keys):
    """Does the request carry one of keys? Compared as vLLM compares them: the
    SHA-256 digests (of equal length whatever the key's), in constant time,
    against every key."""
    headers = dict(scope["headers"])
    scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() != "bearer":
        return False

    digest = hashlib.sha256(given.encode()).digest()
    match = False
    for key in keys:
        match |= secrets.compare_digest(digest, hashlib.sha256(key.encode()).digest())
    return match


async def refuse(scope, send, keys):
    """401 with vLLM's own body (a websocket: closed, policy violation), and
    the fix where the server has no key at all."""
    if scope["type"] == "websocket":
        # before the accept, the server answers the handshake with 403
        return await send({"type": "websocket.close", "code": 1008})

    message = "Unauthorized"
    if not keys:
        message += (": this server has no key, and RequireKey lets no request but "
                    "/health through: start it with --api-key KEY")
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
