"""`hybridpar serve` configuration: one validated dataclass (fields carry their help, as in
hybridpar/config/sections.py), parsed from `--key value` flags; the model shape for sources without a config
of its own (init:SEED) comes from the training flags `--model.*`."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from hybridpar.config import ModelConfig, parse_args
from hybridpar.config.families import tp_split_sizes
from hybridpar.config.parse import one_of
from hybridpar.config.sections import _f
from hybridpar.config.validate import check_model
from hybridpar.serve.router import STRATEGIES, RouterConfig

SERVE_DTYPES = ("fp32", "bf16")  # what a serving stage computes in (serve/worker.py casts to it)
SECONDS = ("request_timeout_s", "timeout_s", "client_timeout_s")
MAX_SECONDS = 7 * 24 * 3600


@dataclass
class ServeConfig:
    source: str = _f(
        "runs/latest",
        "model: a Hugging Face Llama or GPT-2 model dir (config.json + *.safetensors, such as a run's "
        "final/), a hybridpar run dir (its newest model) or checkpoint dir, or init:SEED (random init)",
    )
    served_model_name: str = _f(
        "",
        "model id clients ask for (/v1/models, a request's model); empty = --source as given (as vLLM names a "
        "model by its path or Hugging Face name)",
    )
    api_key: str = _f(
        "",
        "when set, every /v1 request must carry 'Authorization: Bearer KEY' (401 otherwise); /health and /metrics "
        "stay open",
    )
    tokenizer: str = _f(
        "",
        "tokenizer directory (tokenizer.json) for text prompts and answers; empty = the model's own (its "
        "directory's, or its training run's data.tokenizer), else UTF-8 bytes for a 256-id model",
    )
    tp: int = _f(1, "tensor-parallel degree of each replica")
    pp: int = _f(1, "pipeline stages of each replica")
    dp: int = _f(1, "replicas")
    host: str = _f("127.0.0.1", "address to bind (loopback by default)")
    port: int = _f(8000, "port to bind (0 = any free port)")
    strategy: str = _f("hybrid", "request placement over replicas", choices=STRATEGIES)
    memory_pressure: float = _f(0.8, "hybrid: KV-cache use above this -> memory_aware")
    performance_pressure: float = _f(0.8, "hybrid: replica utilisation above this -> performance_optimized")
    imbalance: float = _f(0.5, "hybrid: outstanding-token imbalance above this -> load_balanced")
    cache_slack: int = _f(
        4,
        "cache_aware: a request goes to the replica holding the longest cached prefix of its prompt unless that "
        "one has this many more requests outstanding than the least loaded (then hybrid decides)",
    )
    max_batch: int = _f(
        8,
        "sequences per step (one micro-batch); requests join and leave it between steps (continuous batching)",
    )
    max_groups: int = _f(
        4,
        "micro-batches per replica, up to pp of them in the pipeline at once: at most max_batch x max_groups "
        "sequences run at once, the rest wait",
    )
    kv_tokens: int = _f(
        16384,
        "KV-cache budget per replica, in tokens (kv_tokens // block_size blocks on every stage); when it runs "
        "out the youngest running request is preempted and recomputed later",
    )
    block_size: int = _f(16, "tokens per KV-cache block (the paged cache's unit of allocation)")
    prefix_caching: bool = _f(
        True,
        "share the KV blocks of a prompt's whole leading blocks that a replica computed already (true/false; "
        "false only to measure what it saves)",
    )
    max_step_tokens: int = _f(
        2048,
        "tokens one step feeds at most: prompts longer than what the step's decodes leave are prefilled in "
        "chunks over several steps (chunked prefill); 0 = no limit; else more than max_batch",
    )
    max_seq_len: int = _f(1024, "longest prompt + completion, in tokens")
    max_outstanding: int = _f(32, "requests placed on one replica before it counts as busy")
    max_pending: int = _f(64, "requests waiting for a replica before new ones get 429")
    request_timeout_s: float = _f(300.0, "a request not finished after this gets 503")
    timeout_s: float = _f(120.0, "bound on every collective and point-to-point wait between ranks")
    client_timeout_s: float = _f(
        10.0,
        "a client's request head must arrive within this of its connection (or of "
        "the previous answer), its body within as long again; else it is closed "
        "(408 if a request had begun)",
    )
    backend: str = _f("auto", "torch.distributed backend", choices=("auto", "gloo", "nccl"))
    dtype: str = _f(
        "fp32",
        "weights, KV cache and the activations between pipeline stages: fp32, or bf16 (the source's fp32 "
        "weights cast after loading: half the memory and KV-cache bytes; logits widened to fp32 before sampling)",
        choices=SERVE_DTYPES,
    )
    emulate_slowdown: str = _f(
        "",
        "BENCHMARK/TEST MODE, off by default: 'REPLICA:FACTOR,...' makes a replica's "
        "ranks sleep (FACTOR-1) x their measured compute, e.g. '1:2.0'",
    )

    @property
    def model_name(self) -> str:
        """The served name: --served-model-name, else the source as given (a trailing / dropped)."""
        return self.served_model_name or self.source.rstrip("/") or self.source

    @property
    def request_tokens(self) -> int:
        """The longest prompt + completion a request may ask for: max_seq_len, or the KV-cache budget in whole
        blocks where that is less (a replica refuses what its cache cannot hold, as a failure)."""
        return min(self.max_seq_len, self.kv_tokens // self.block_size * self.block_size)

    def slowdowns(self) -> list[float]:
        out = [1.0] * self.dp
        for part in filter(None, (p.strip() for p in self.emulate_slowdown.split(","))):
            rep, _, fac = part.partition(":")
            try:
                r, f = int(rep), float(fac)
            except ValueError:
                raise ValueError(f"emulate_slowdown entry {part!r} must look like REPLICA:FACTOR, e.g. 1:2.0") from None
            if not 0 <= r < self.dp or not (math.isfinite(f) and f >= 1.0):
                raise ValueError(
                    f"emulate_slowdown entry {part!r}: replica must be in 0..{self.dp - 1} " f"and factor a number >= 1"
                )
            out[r] = f
        return out

    def router(self) -> RouterConfig:
        return RouterConfig(
            self.strategy,
            self.memory_pressure,
            self.performance_pressure,
            self.imbalance,
            self.max_outstanding,
            self.max_pending,
            cache_slack=self.cache_slack,
            block_size=self.block_size,
        )

    def validate(self, model: ModelConfig | None = None) -> None:
        for name in (
            "tp",
            "pp",
            "dp",
            "max_batch",
            "max_groups",
            "kv_tokens",
            "block_size",
            "max_seq_len",
            "max_outstanding",
            "max_pending",
            "cache_slack",
        ):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValueError(f"serve {name} must be a positive integer, got {v!r}")
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ValueError(f"serve port must be in 0..65535, got {self.port!r}")
        for name in SECONDS:
            v = getattr(self, name)
            # Bounded above as well: a wait of 1e300 s overflows (OverflowError inside a running server,
            # where `inf` made every completion a 500). Written so that NaN, false in every comparison, fails.
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_SECONDS):
                raise ValueError(f"serve {name}={v!r} must be a number of seconds in (0, {MAX_SECONDS}] (one week)")
        for f in fields(self):
            if (ch := f.metadata.get("choices")) and getattr(self, f.name) not in ch:
                raise ValueError(f"serve {f.name}={getattr(self, f.name)!r} is not one of {', '.join(ch)}")
        if not (
            isinstance(self.max_step_tokens, int)
            and (self.max_step_tokens == 0 or self.max_step_tokens > self.max_batch)
        ):
            raise ValueError(
                f"serve max_step_tokens={self.max_step_tokens!r} must be 0 (no limit) or more than "
                f"max_batch={self.max_batch} (room for every decode and a prefill chunk)"
            )
        if self.kv_tokens < self.block_size:
            raise ValueError(
                f"serve kv_tokens={self.kv_tokens} must hold at least one block (block_size={self.block_size})"
            )
        self.router().validate()
        self.slowdowns()
        if model is not None:
            check_model(model)
            for key, v in tp_split_sizes(model).items():
                if v % self.tp:
                    raise ValueError(f"serve tp={self.tp} does not divide model {key}={v}")
            if model.max_positions is not None and self.max_seq_len > model.max_positions:
                raise ValueError(
                    f"serve max_seq_len={self.max_seq_len} exceeds the model's {model.max_positions} "
                    f"learned positions ({model.family} n_positions): use --max-seq-len "
                    f"{model.max_positions} or less"
                )
            if model.n_layers < self.pp:
                raise ValueError(f"serve pp={self.pp} exceeds the model's n_layers={model.n_layers}")


def boolean(text: str) -> bool:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.strip().lower() not in words:
        raise ValueError(f"expects true or false, got {text!r}")
    return words[text.strip().lower()]


def parse_serve_args(argv: list[str]) -> tuple[ServeConfig, ModelConfig]:
    """`--key value` (or --key=value) for ServeConfig fields; `--model.*` flags give the model shape."""
    from hybridpar.config.args import ArgParser, integer, number

    model_args, rest, i = [], [], 0
    while i < len(argv):  # --model.KEY VALUE: the training flags, read by the config's own parser
        name = argv[i].split("=")[0]
        if name.startswith("--model."):
            take = 1 if "=" in argv[i] else 2
            model_args += argv[i : i + take]
            i += take
        else:
            rest.append(argv[i])
            i += 1
    ap = ArgParser(prog="hybridpar serve", add_help=False)
    cfg = ServeConfig()
    for f in fields(ServeConfig):
        kind = type(getattr(cfg, f.name))
        typ = {int: integer, float: number, bool: boolean}.get(kind, kind)
        dashed = "--" + f.name.replace("_", "-")
        names = [dashed] + (["--" + f.name] if "_" in f.name else [])
        ap.add_argument(*names, dest=f.name, type=typ, default=getattr(cfg, f.name))
    for key, value in vars(ap.parse(rest)).items():
        setattr(cfg, key, value)
    return cfg, parse_args(model_args).model


def help_text() -> str:
    rows = [
        f"  --{f.name.replace('_', '-'):<22} {f.metadata['help']} (default {f.default!r}{one_of(f.metadata)})"
        for f in fields(ServeConfig)
    ]
    return "\n".join(
        rows
        + [
            "  --model.KEY VALUE        model family and shape for init:SEED sources "
            "(as in `hybridpar train --help`, e.g. --model.family gpt2)"
        ]
    )
