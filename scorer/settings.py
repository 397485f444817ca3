"""The serving configuration: one definition of every setting of ``scorer serve``, ``scorer score``
and the Ray deployment, with one parser.

Each field of ``Settings`` names the front ends that take it (``serve``, ``score``, ``ray``);
``add_arguments`` turns the fields of one front end into argparse flags (``--max-batch-tokens``
for ``max_batch_tokens``) and ``from_args`` reads them back; Ray's ``ScorerArgs`` is a pydantic
model of the ``ray`` fields. ``Settings`` validates every value once, whichever front end gave it,
and derives what the engine needs: ``engine_config()``, ``build_engine()`` (the server derives its
batch policy and test knobs from it: ``server.lifecycle``). The per-request options of ``scorer
score`` come from ``ScoreOptions`` the same way (``add_request_arguments``).
"""

from __future__ import annotations

import argparse
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from .options import (
    BACKENDS,
    CPU_AUTO_MIB,
    DOC_SPECIAL_TOKENS,
    DTYPE_NAMES,
    FALLBACKS,
    GPU_AUTO_SHARE,
    GPU_MIN_CACHE_READ_ROWS_PER_TOKEN,
    GPU_MIN_CACHE_READ_TOKENS,
    MAX_DOC_BYTES,
    MAX_DOC_TOKENS,
    MAX_DOCS,
    MAX_REQUEST_BYTES,
    MODEL_KERNELS,
    PREFIX_CACHE_MODES,
    QUANTIZATIONS,
    SCORE_MODES,
    TEMPLATE_NAMES,
    TRUNCATE_MODES,
    ScoreOptions,
)

# Nothing here imports torch or the engine at module level: the command line parses its
# arguments (and answers --help or a bad flag) before the model stack loads.
if typing.TYPE_CHECKING:
    from .engine import Engine, EngineConfig

SERVE, SCORE, RAY = "serve", "score", "ray"
EVERY = (SERVE, SCORE, RAY)
SERVERS = (SERVE, RAY)


def setting(default, help: str, *, choices=None, scopes=SERVERS, metavar=None, check=None):
    """A field of ``Settings``; ``check(value)`` returns what is wrong with a value, or None."""
    meta = {"help": help, "choices": choices, "scopes": scopes, "metavar": metavar, "check": check}
    return field(default=default, metadata=meta)


def flag(name: str) -> str:
    """The command-line flag of a setting: ``--max-queue`` for ``max_queue``."""
    return "--" + name.replace("_", "-")


def at_least(low):
    return lambda v: None if v >= low else f"is less than {low}"


def _port(v):
    return None if 0 <= v <= 65535 else "is not a port (0-65535)"


def _positive(v):
    return None if v > 0 else "is not more than 0"


def _device(v):
    if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
        return "is not cpu, cuda or cuda:N"
    import torch

    if v != "cpu" and not torch.cuda.is_available():
        return "needs CUDA, which this machine does not have (torch.cuda.is_available() is False)"
    return None


def _checkpoint(v):
    """A directory the engine can load: a supported config.json, safetensors, a tokenizer."""
    if not Path(v).is_dir():
        return "is not a directory"
    if not (Path(v) / "config.json").is_file():
        return "has no config.json"
    from .models.loader import check_checkpoint

    try:
        check_checkpoint(v)
    except ValueError as e:
        return f"cannot be served: {e}"
    return None


def _template_file(v):
    from .request import load_template

    if not Path(v).is_file():
        return "is not a file"
    try:
        load_template(v)
    except ValueError as e:
        return f"is not a template: {e}"
    return None


def _auto_or_count(unit: str = "", most: int | None = None):
    """``auto`` or a whole number from 0 (to ``most``), of ``unit``."""

    def check(v):
        if v == "auto":
            return None
        try:
            n = int(v)
        except ValueError:
            return f"is not a number{f' of {unit}' if unit else ''} or auto"
        if most is not None:
            return None if 0 <= n <= most else f"is not 0-{most}"
        return None if n >= 0 else "is less than 0"

    return check


def _admission(v):
    from .prefix_cache import admission  # torch's import: checked after parsing, as _auto_policy

    try:
        admission(v)
    except ValueError:
        return "is not auto, 1 or 2"
    return None


def _auto_policy(v):
    from .planning.choose import AUTO_POLICIES  # beside the schemes, so checked after parsing

    return None if v in AUTO_POLICIES else f"is not one of {', '.join(AUTO_POLICIES)}"


def _auto_or_positive(v):
    if v == "auto":
        return None
    try:
        n = int(v)
    except ValueError:
        return "is not a number or auto"
    return None if n >= 1 else "is less than 1"


def _file(v):
    return None if Path(v).is_file() else "is not a file"


def _key_file(v):
    if not Path(v).is_file():
        return "is not a file"
    keys = [line.strip() for line in Path(v).read_text(errors="replace").splitlines()]
    return None if any(k and not k.startswith("#") for k in keys) else "holds no key"


API_KEY_ENV = "SCORER_API_KEY"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _log_level(v):
    return None if v.upper() in LOG_LEVELS else f"is not one of {', '.join(LOG_LEVELS)}"


@dataclass(frozen=True)
class Settings:
    # the model and how it runs
    model: str | None = setting(
        None,
        "checkpoint directory, with its config.json (default: the embedded tiny model)",
        scopes=EVERY,
        metavar="DIR",
        check=_checkpoint,
    )
    attention_backend: str = setting(
        "auto",
        "auto (FlashInfer where it can run the model, else the torch reference), torch or flashinfer",
        choices=BACKENDS,
        scopes=EVERY,
    )
    attention_fallback: str = setting(
        "none",
        "when --attention-backend flashinfer cannot run: none (say why and exit 2) or torch (run the"
        " torch reference, shown in the start log and scorer_model_info)",
        choices=FALLBACKS,
        scopes=EVERY,
    )
    device: str | None = setting(
        None, "cpu, cuda or cuda:N (default: cuda when available)", scopes=EVERY, check=_device
    )
    dtype: str | None = setting(
        None, "default: bfloat16 on cuda, float32 on cpu", choices=DTYPE_NAMES, scopes=EVERY
    )
    template: str = setting(
        "",
        "the prompt template of a call that names none: one of "
        + ", ".join(TEMPLATE_NAMES)
        + " or --template-file's (default: qwen3_reranker, or --template-file's when given)",
        scopes=(SERVE, RAY),
        metavar="NAME",
    )
    template_file: str | None = setting(
        None,
        "a template of your own: a JSON or YAML file of name, prefix (with {query}, optionally"
        " {instruction}), item_head, item_tail, doc_lead, default_instruction, labels, score_mode",
        scopes=EVERY,
        metavar="FILE",
        check=_template_file,
    )
    score_label: str = setting(
        "",
        "a score head's relevant label (a *ForSequenceClassification checkpoint of several labels):"
        " its index, or its name in config.json's id2label (default: the last)",
        scopes=EVERY,
        metavar="LABEL",
    )
    model_kernels: str = setting(
        "auto",
        "norm, RoPE and SiLU-and-mul: flashinfer (fused, fp32 inside), fused (flashinfer plus one QKV"
        " GEMM and Triton's q/k norm + RoPE kernel), torch (HF's op order), or auto (fused with"
        " FlashInfer attention on CUDA)",
        choices=MODEL_KERNELS,
        scopes=EVERY,
    )
    quantization: str = setting(
        "none",
        "fp8: the decoder's linear layers (q/k/v/o, gate/up/down) as FP8 e4m3 GEMMs, weights per output"
        " channel, activations per token (the LM head, embeddings, norms and attention stay in --dtype);"
        " a pre-quantized FP8 checkpoint runs its own FP8 weights. none: every layer in --dtype (a"
        " pre-quantized checkpoint dequantized). docs/quantization.md",
        choices=QUANTIZATIONS,
        scopes=EVERY,
    )
    cuda_graph_max_tokens: int = setting(
        16384,
        "on CUDA, forward passes up to this many tokens replay piecewise CUDA graphs captured at"
        " start-up (everything but attention); 0: always eager",
        scopes=EVERY,
        check=at_least(0),
    )
    host_threads: int = setting(
        1,
        "with the model on a GPU, torch's intra-op threads for the host's tensor work (planning,"
        " read-out): its ops are small, and threads cost more to fork and join than they save, far"
        " more on cores the front ends share; 0: torch's default. The CPU model keeps torch's default",
        check=at_least(0),
    )
    auto_policy: str = setting(
        "default",
        "how scheme=auto picks: calibrated (H200 cost model), article (section 5.3), ragged, or default"
        " (calibrated on FlashInfer, ragged on the CPU, the article's guide for torch on a GPU)",
        metavar="POLICY",
        check=_auto_policy,
        scopes=EVERY,
    )
    prefix_cache_mib: str | int = setting(
        "auto",
        "MiB of device memory for the prefix cache's K/V pool (prompt K/V kept across calls);"
        f" auto: {GPU_AUTO_SHARE:.0%} of the memory free after the model loads on a GPU,"
        f" {CPU_AUTO_MIB} MiB on the CPU; 0: off",
        metavar="MIB|auto",
        check=_auto_or_count("MiB"),
    )
    prefix_cache_admit: str | int = setting(
        "auto",
        "when the prefix cache writes a prompt's block to its pool: 1 (on its first sighting: the"
        " second call of a prompt reads it), 2 (on its second: a prompt seen once, a unique query,"
        " costs nothing and runs off the cache, but each repeated prompt is computed twice) or auto"
        " (1 while at least 1/16 of the blocks written or seen lately came back, else 2)",
        metavar="auto|1|2",
        check=_admission,
    )
    prefix_cache_min_read: str | int = setting(
        "auto",
        "rows of its forward a batch's prefix-cache hits must save for it to read them; one whose hits"
        " save fewer computes its prompts, within a pass's token budget (the pool's paged reads cost"
        " a small batch more than that);"
        f" auto: {GPU_MIN_CACHE_READ_TOKENS} plus one per {GPU_MIN_CACHE_READ_ROWS_PER_TOKEN} rows"
        " of the batch on a GPU, 0 (every hit read) on the CPU",
        metavar="TOKENS|auto",
        check=_auto_or_count("tokens"),
    )
    # limits of a call
    max_docs: int = setting(MAX_DOCS, "documents per call", check=at_least(1))
    max_doc_tokens: int = setting(MAX_DOC_TOKENS, "tokens per document", check=at_least(1))
    max_doc_bytes: int = setting(
        MAX_DOC_BYTES,
        "UTF-8 bytes of one document's text, checked before any work",
        check=at_least(1),
    )
    max_request_bytes: int = setting(
        MAX_REQUEST_BYTES,
        "UTF-8 bytes of a call's text (prompt, instruction, docs), checked first",
        check=at_least(1),
    )
    # batching
    max_batch_tokens: int = setting(
        16384,
        "token budget of one forward pass: calls are merged up to it, a larger call runs alone in"
        " several passes that reuse its prompt's K/V",
        check=at_least(1),
    )
    max_wait_ms: float = setting(
        2.0, "longest a queued call waits for others to fill its batch", check=at_least(0)
    )
    max_queue: int = setting(
        256, "calls waiting beyond this are refused with RESOURCE_EXHAUSTED", check=at_least(1)
    )
    loop_path_gaps: float = setting(
        1.0,
        "a short batch that finds the device idle runs on the event loop, without worker-thread"
        " hand-offs, while calls arrive at least this many of its estimated times apart (0: whenever"
        " the device is idle; a large value: never)",
        check=at_least(0),
    )
    cut_before_heavy: float = setting(
        4.0,
        "a batch is cut before a queued call that computes at least this many times the tokens of"
        " the calls ahead of it in the batch (0: never), so that calls read from the prefix cache do"
        " not wait for a long prompt computed beside them; the long call leads the next batch",
        check=at_least(0),
    )
    # the standalone server
    host: str = setting("127.0.0.1", "address to listen on (gRPC, HTTP and metrics)", scopes=(SERVE,))
    port: int = setting(50051, "gRPC port (0: any free one)", scopes=(SERVE,), check=_port)
    metrics_port: int = setting(
        9464, "Prometheus /metrics port (Ray: the first one tried); 0: off", check=_port
    )
    http_port: int = setting(
        0,
        "HTTP rerank port: Cohere /v2/rerank, Jina /v1/rerank, TEI /rerank, /health, /info; 0: off",
        scopes=(SERVE,),
        check=_port,
    )
    frontends: str = setting(
        "auto",
        "front-end processes (gRPC and HTTP on the same ports, parsing and tokenizing) feeding this"
        " process's engine; 0: all in one process; auto: 0 on the CPU, else one per two cores beyond"
        " two, at most 4",
        scopes=(SERVE,),
        metavar="N|auto",
        check=_auto_or_count(most=64),
    )
    busy_poll_ms: float = setting(
        0.0,
        "every process's event loop polls without sleeping for this long after its last I/O, so a"
        " call or a reply arriving meanwhile is read without a wake-up (a core a process while"
        " calls keep coming; 0: off)",
        scopes=(SERVE,),
        check=at_least(0),
    )
    engine_process: str = setting(
        "auto",
        "the replica's engine (model, batcher, device work) in a child process of its own, the"
        " replica's process only taking Ray's calls and tokenizing: on, off, auto (on with the"
        " model on a GPU), or shared (the replicas are front ends of one engine per GPU, an Engine"
        " deployment of its own on their node)",
        choices=("auto", "on", "off", "shared"),
        scopes=(RAY,),
    )
    api_key: str | None = setting(
        None,
        "require Authorization: Bearer KEY (scorer serve: HTTP and gRPC; Ray: HTTP; default: no key"
        f" asked). Discouraged: the command line shows in ps; give --api-key-file or ${API_KEY_ENV} instead",
        metavar="KEY",
    )
    api_key_file: str | None = setting(
        None,
        f"--api-key read from this file: one key a line, several for several tenants (before ${API_KEY_ENV},"
        " then --api-key)",
        scopes=(SERVE,),
        metavar="FILE",
        check=_key_file,
    )
    cache_salt_from_key: bool = setting(
        False,
        "each call's prefix-cache salt derived from the API key it authenticated with (and its own salt):"
        " callers of different keys never share cached prompt K/V, nor see each other's prompts in"
        " usage.cached_prompt_tokens or latency (needs a key; docs/security.md)",
        scopes=(SERVE,),
    )
    metrics_auth: bool = setting(
        False,
        "/metrics on --metrics-port wants the API key too (Authorization: Bearer KEY; needs a key)",
        scopes=(SERVE,),
    )
    require_cache_salt: bool = setting(
        False,
        "refuse a call without a cache salt (options.cache_salt, HTTP's X-Cache-Salt) with"
        " INVALID_ARGUMENT: no caller shares the prefix cache by omission",
        scopes=(SERVE,),
    )
    max_message_bytes: int = setting(64 * 2**20, "largest request or response message", scopes=(SERVE,))
    # the network edge (docs/limits.md)
    max_connections: str | int = setting(
        "auto",
        "open connections per listener (HTTP, gRPC) of each process; at the cap a new HTTP connection"
        " closes an idle one (503 when none is idle) and gRPC closes new ones; auto: a quarter of what"
        " the file-descriptor limit (RLIMIT_NOFILE) leaves after 128, 8 to 10,000",
        scopes=(SERVE,),
        metavar="N|auto",
        check=_auto_or_positive,
    )
    http_keep_alive_s: float = setting(
        5.0, "HTTP: an idle keep-alive connection is closed after this long", scopes=(SERVE,), check=_positive
    )
    http_header_timeout_s: float = setting(
        10.0,
        "HTTP: a request's headers must be complete this long after its connection opened or its last"
        " answer (else 408 and closed); gRPC: the connection's handshake",
        scopes=(SERVE,),
        check=_positive,
    )
    http_body_timeout_s: float = setting(
        30.0,
        "HTTP: a request's body must arrive within this long of its headers (else 408)",
        scopes=(SERVE,),
        check=_positive,
    )
    max_header_bytes: int = setting(
        32 * 1024, "HTTP: bytes of a request's headers in all (more: 431)", scopes=(SERVE,), check=at_least(1)
    )
    max_headers: int = setting(
        100, "HTTP: header fields of a request (more: 431)", scopes=(SERVE,), check=at_least(1)
    )
    grpc_idle_timeout_s: float = setting(
        300.0, "gRPC: a connection without a call this long is sent GOAWAY", scopes=(SERVE,), check=_positive
    )
    grpc_max_connection_age_s: float = setting(
        0.0,
        "gRPC: a connection older than this is sent GOAWAY, its calls given --grace-seconds to finish"
        " (spreads clients over new replicas); 0: no limit",
        scopes=(SERVE,),
        check=at_least(0),
    )
    grpc_keepalive_s: float = setting(
        60.0,
        "gRPC: the server pings a connection this long quiet, and closes it when the ping is not answered"
        " in 20 s (a client gone without closing)",
        scopes=(SERVE,),
        check=_positive,
    )
    drain_seconds: float = setting(
        5.0,
        "after SIGTERM: keep serving this long with health NOT_SERVING",
        scopes=(SERVE,),
        check=at_least(0),
    )
    grace_seconds: float = setting(
        30.0, "after the drain: longest wait for calls in flight", scopes=(SERVE,), check=at_least(0)
    )
    tls_cert: str | None = setting(
        None, "serve TLS with this certificate chain", scopes=(SERVE,), metavar="PEM", check=_file
    )
    tls_key: str | None = setting(
        None, "private key of --tls-cert", scopes=(SERVE,), metavar="PEM", check=_file
    )
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR", check=_log_level)
    # a Ray replica
    call_timeout_s: float | None = setting(
        None,
        "longest deadline of a call from its arrival at the replica; the client's x-timeout-ms metadata"
        " counts when earlier (Ray's proxy passes metadata on, not gRPC deadlines)",
        scopes=(RAY,),
        check=_positive,
    )
    metrics_host: str = setting("0.0.0.0", "address of the replica's /metrics", scopes=(RAY,))
    metrics_port_tries: int = setting(
        8,
        "replicas on one node take the next free metrics port, up to this many",
        scopes=(RAY,),
        check=at_least(1),
    )
    # test knobs (never in production)
    debug_forward_delay_ms: float = setting(
        0.0, "test knob: sleep this long before every forward batch", check=at_least(0)
    )
    debug_oom_above_tokens: int = setting(
        0, "test knob: a forward batch over this many tokens raises OutOfMemoryError", scopes=(SERVE,)
    )
    debug_fault_prompt: str = setting(
        "", "test knob: a forward batch with a call of this prompt raises RuntimeError", scopes=(SERVE,)
    )
    debug_tokenize_delay_ms: float = setting(
        0.0, "test knob: sleep this long before tokenizing every call", scopes=(SERVE,), check=at_least(0)
    )

    def __post_init__(self) -> None:
        """A value that cannot work raises ValueError naming its flag and field, before anything
        starts: ``--max-queue (max_queue): 0 is less than 1``."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: give --tls-cert and --tls-key, or neither")
        if self.api_key and self.api_key_file:
            raise ValueError("--api-key and --api-key-file: give one")
        keyed = self.api_key or self.api_key_file or os.environ.get(API_KEY_ENV)
        for name in ("cache_salt_from_key", "metrics_auth"):
            if getattr(self, name) and not keyed:
                raise ValueError(
                    f"{flag(name)} needs an API key: --api-key-file, ${API_KEY_ENV} or --api-key"
                )
        for f in fields(self):
            value, choices, check = getattr(self, f.name), f.metadata["choices"], f.metadata["check"]
            if value is None or value == "":
                continue
            if choices is not None and value not in choices:
                problem = f"is not one of {', '.join(choices)}"
            else:
                problem = check(value) if check else None
            if problem:
                raise ValueError(f"{flag(f.name)} ({f.name}): {value!r} {problem}")
        self._check_model_options()

    def _check_model_options(self) -> None:
        """--template among the templates, --score-label a label of the model's score head."""
        from .engine import prompting, score_head

        try:
            prompting(self.engine_config(), None)
        except ValueError as e:
            raise ValueError(f"--template (template): {e}") from None
        if self.score_label:
            from .config import ModelConfig
            from .models.tiny import ensure_tiny_model

            try:
                score_head(ModelConfig.from_hf(self.model or ensure_tiny_model()), self.score_label)
            except ValueError as e:
                raise ValueError(f"--score-label (score_label): {e}") from None

    def engine_config(self) -> EngineConfig:
        from .engine import EngineConfig

        return EngineConfig(
            max_docs=self.max_docs,
            max_doc_tokens=self.max_doc_tokens,
            max_tokens_per_pass=self.max_batch_tokens,
            auto_policy=self.auto_policy,
            max_doc_bytes=self.max_doc_bytes,
            max_request_bytes=self.max_request_bytes,
            template=self.template,
            template_file=self.template_file or "",
            score_label=self.score_label,
            min_cache_read_tokens=None
            if self.prefix_cache_min_read == "auto"
            else int(self.prefix_cache_min_read),
        )

    def build_engine(self, config: EngineConfig | None = None) -> Engine:
        import torch

        from .runtime import build_engine

        return build_engine(
            self.model,
            self.attention_backend,
            self.device,
            getattr(torch, self.dtype) if self.dtype else None,
            config or self.engine_config(),
            attention_fallback=self.attention_fallback,
            kernels=self.model_kernels,
            cuda_graph_max_tokens=self.cuda_graph_max_tokens,
            prefix_cache_mib=self.prefix_cache_mib,
            prefix_cache_admit=self.prefix_cache_admit,
            quantization=self.quantization,
        )


def names_for(scope: str) -> list[str]:
    """The settings a front end takes."""
    return [f.name for f in fields(Settings) if scope in f.metadata["scopes"]]


def add_arguments(parser: argparse.ArgumentParser, scope: str) -> None:
    """One flag per setting of ``scope``."""
    hints = typing.get_type_hints(Settings)
    for f in fields(Settings):
        if scope in f.metadata["scopes"]:
            _add(parser, f.name, f.metadata, hints[f.name], f.default)


def from_args(args: argparse.Namespace, scope: str) -> Settings:
    """Settings from the flags of ``scope`` (a bad value raises ValueError naming the field)."""
    return Settings(**{name: getattr(args, name) for name in names_for(scope)})


def scorer_args_model():
    """Ray's ``ScorerArgs``: a pydantic model of the ``ray`` settings (unknown keys refused)."""
    from pydantic import ConfigDict, create_model

    hints = typing.get_type_hints(Settings)
    defs = {f.name: (hints[f.name], f.default) for f in fields(Settings) if RAY in f.metadata["scopes"]}
    model = create_model("ScorerArgs", __config__=ConfigDict(extra="forbid", protected_namespaces=()), **defs)
    model.__doc__ = (
        "Arguments of one replica: the ``args`` of a serve config, or ``key=value`` after ``serve run``."
    )
    return model


REQUEST_HELP = {
    "scheme": "shared-prefix scheme (naive, ragged, cascade, multi_item, ...; docs/schemes.md), or auto"
    " (chosen by shape)",
    "label_tokens": "label words, each a single vocabulary token (default: the template's; yes no for most)",
    "label_token_ids": "label token ids instead of --label-tokens",
    "template": f"prompt template: {', '.join(TEMPLATE_NAMES)} or --template-file's (default: qwen3_reranker,"
    " or --template-file's when given)",
    "score_mode": "softmax: P(first label) over the labels; logprob: log P(first label); raw: the first"
    " label's logit (a score head's output); sigmoid: its sigmoid (default: the template's, else softmax)",
    "truncate": "a doc over the limit: error, or doc_end (cut its end)",
    "max_doc_tokens": "tokens per document (0: the engine's limit)",
    "group_size": "docs per group for the grouped scheme (0: the engine's default)",
    "doc_special_tokens": "docs only (an alias of --special-tokens for the docs): parse or text",
    "special_tokens": "text: special-token strings in the prompt, instruction and docs stay plain text"
    " (a caller cannot inject control tokens); parse (the default): they become those tokens",
    "top_n": "print only the best N docs by score (0: every doc in input order)",
    "return_label_logprobs": "print each doc's label log-probs",
    "prefix_cache": "off: neither read nor write the prefix cache (default: use it)",
    "cache_salt": "calls with different salts never share cached prompt K/V",
}
REQUEST_CHOICES = {
    "score_mode": SCORE_MODES,
    "truncate": TRUNCATE_MODES,
    "doc_special_tokens": DOC_SPECIAL_TOKENS,
    "special_tokens": DOC_SPECIAL_TOKENS,
    "prefix_cache": PREFIX_CACHE_MODES,
}


def _scheme_names() -> tuple[str, ...]:
    from .planning import names

    return names()


def _template_names() -> tuple[str, ...]:
    from .request import TEMPLATES

    return tuple(TEMPLATES)


def _registered(names):
    """An argparse type for a value of a registry (schemes, templates) that lives beside torch:
    the registry is imported only when the flag is given, so a scheme registered before the
    arguments are parsed is accepted."""

    def check(value: str) -> str:
        if not value:  # the default: the engine's (a template) or every registered one (a scheme)
            return value
        known = names()
        if value not in known:
            raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(known)})")
        return value

    return check


REQUEST_REGISTRIES = {"scheme": _scheme_names, "template": _template_names}


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``ScoreOptions`` field."""
    hints = typing.get_type_hints(ScoreOptions)
    for f in fields(ScoreOptions):
        meta = {"help": REQUEST_HELP[f.name], "choices": REQUEST_CHOICES.get(f.name)}
        if f.name in REQUEST_REGISTRIES:
            meta |= {"type": _registered(REQUEST_REGISTRIES[f.name]), "metavar": "NAME"}
        _add(parser, f.name, meta, hints[f.name], "" if f.name == "template" else f.default)


def request_options(args: argparse.Namespace) -> ScoreOptions:
    values = {f.name: getattr(args, f.name) for f in fields(ScoreOptions)}
    return ScoreOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _add(parser: argparse.ArgumentParser, name: str, meta, hint, default) -> None:
    kw = {"default": default, "help": meta["help"].replace("%", "%%"), "dest": name}
    if meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    if meta.get("choices") is not None:
        kw["choices"] = meta["choices"]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: a flag of X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        del kw["default"]
        parser.add_argument(flag(name), action="store_true", **kw)
        return
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]: one or more X
        kw["nargs"] = "+"
        kw["type"] = typing.get_args(hint)[0]
    elif hint in (int, float):
        kw["type"] = hint
    if meta.get("type"):
        kw["type"] = meta["type"]
    parser.add_argument(flag(name), **kw)
