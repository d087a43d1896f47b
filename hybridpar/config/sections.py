"""The sections of a run configuration: one dataclass per TOML table ([model], [parallel], ...).

Fields only declare their type, default and help here; the rules that relate fields (tp divides
n_heads, ...) are in validate.py, and those that ask the schedule registry (enough microbatches for the
schedule, ...) in hybridpar/pipeline/schedules/config_rules.py.
"""

# No `from __future__ import annotations`: keys.py and the parsers read each field's `type` as a real
# type (int | None, list[float]), not as a string.
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hybridpar.config.families import FAMILIES, rules

CPU_BINDINGS = ("none", "cores")  # how topology/cpus.py places local ranks on cores
RECOMPUTE_MODES = ("none", "full", "selective")  # model/recompute.py


def _f(default: Any, help: str, **meta: Any) -> Any:
    """A field carrying its help text (and optional `choices`) in metadata, so help and validation
    read one source. A class default becomes a default_factory: each Config owns its sections."""
    metadata = {"help": help, **meta}
    if isinstance(default, type):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    family: str = _f(
        "llama", "model family: " + "; ".join(f"{k} = {r.about}" for k, r in FAMILIES.items()), choices=tuple(FAMILIES)
    )
    vocab_size: int = _f(256, "vocabulary size (256 = raw bytes)")
    dim: int = _f(128, "hidden size")
    n_layers: int = _f(4, "number of transformer blocks")
    n_heads: int = _f(4, "attention (query) heads")
    n_kv_heads: int | None = _f(None, "llama: key/value heads (none = n_heads; fewer = grouped-query attention)")
    ffn_dim: int = _f(352, "feed-forward inner size (llama: SwiGLU width; gpt2: n_inner, 4 x dim in GPT-2)")
    rope_theta: float = _f(10000.0, "llama: rotary embedding base")
    # Llama 3.1's long-context rotary frequencies (Hugging Face rope_type "llama3"): wavelengths longer than
    # original_max_positions / low_freq_factor are stretched by factor, shorter than original_max_positions /
    # high_freq_factor kept, those between interpolated.
    rope_scaling: str = _f(
        "none", "llama: rotary frequency scaling ('llama3' = Llama 3.1's)", choices=("none", "llama3")
    )
    rope_factor: float = _f(8.0, "llama3 rope scaling: how much long wavelengths are stretched")
    rope_low_freq_factor: float = _f(1.0, "llama3 rope scaling: low_freq_factor")
    rope_high_freq_factor: float = _f(4.0, "llama3 rope scaling: high_freq_factor")
    rope_original_max_positions: int = _f(8192, "llama3 rope scaling: original_max_position_embeddings")
    n_positions: int | None = _f(
        None, "gpt2: learned absolute positions, the longest sequence the model reads " "(none = 1024)"
    )
    norm_eps: float = _f(1e-5, "epsilon of the normalisation (llama: RMSNorm; gpt2: LayerNorm)")
    tie_embeddings: bool | None = _f(
        None, "share the input embedding with the output projection (none = the " "family's rule: llama no, gpt2 yes)"
    )
    init_std: float = _f(0.02, "standard deviation of the normal weight init")
    init_from: str | None = _f(
        None,
        "start from a Hugging Face model directory (config.json + *.safetensors): its config.json gives the "
        "shape (leave the other model.* keys unset) and each rank reads only its stages' tensors",
    )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def tied(self) -> bool:
        """Whether the head is the embedding: model.tie_embeddings, else the family's rule."""
        return rules(self).tied if self.tie_embeddings is None else self.tie_embeddings

    @property
    def max_positions(self) -> int | None:
        """Learned positions of the family (None: it has none, any length is read)."""
        return self.n_positions or rules(self).default_positions

    def resolved(self) -> dict[str, Any]:
        """The fields with unset family defaults filled in: two configs of the same model compare equal
        (a checkpoint written with tie_embeddings=false and a run leaving it unset, say)."""
        d = dataclasses.asdict(self)
        d.update(tie_embeddings=self.tied, n_positions=self.max_positions, n_kv_heads=self.kv_heads)
        return d

    def differences(self, saved: dict[str, Any]) -> list[str]:
        """'model.KEY=ours (checkpoint: theirs)' for each field in which the model saved as `saved` (the
        dict of a ModelConfig, perhaps written before some field existed) differs from this one."""
        known = {f.name for f in dataclasses.fields(self)}
        theirs, ours = ModelConfig(**{k: v for k, v in saved.items() if k in known}).resolved(), self.resolved()
        return [f"model.{k}={ours[k]!r} (checkpoint: {theirs[k]!r})" for k in ours if ours[k] != theirs[k]] + [
            f"model.{k} (checkpoint: {v!r}) is unknown" for k, v in saved.items() if k not in known
        ]


@dataclass
class ParallelConfig:
    tp: int = _f(2, "tensor-parallel degree")
    pp: int = _f(2, "pipeline-parallel degree (pipeline ranks)")
    dp: int = _f(1, "data-parallel degree (replicas)")
    cp: int = _f(
        1,
        "context-parallel degree: each sample's sequence split over cp ranks, attention by ring attention "
        "(keys and values passed around the ranks; each rank holds sequence chunks i and 2cp-1-i, which "
        "balances the causal work); train.seq_len must split into 2 cp chunks (docs/context-parallel.md)",
    )
    schedule: str = _f(
        "1f1b",
        "pipeline schedule, by name: one of the registry's (hybridpar/pipeline/schedules/registry.py), "
        "which `hybridpar train --help` lists at its end and docs/pipeline.md describes",
    )
    virtual_stages: int | None = _f(
        None,
        "model chunks (stages) per pipeline rank; none = the schedule's own; other values only with a "
        "schedule that runs them (`hybridpar train --help` lists each schedule's)",
    )
    partition: str = _f(
        "params",
        "how layers are split into stages (layers = parallel.stage_layers)",
        choices=("uniform", "params", "cost", "layers"),
    )
    layer_costs: list[float] | None = _f(None, "per-layer cost, comma-separated (required iff partition=cost)")
    stage_layers: list[int] | None = _f(
        None,
        "decoder layers of each stage, first to last, comma-separated (required iff partition=layers; the "
        "planner sets it for devices of unequal speed)",
    )
    replica_batch: list[int] | None = _f(
        None,
        "samples of each data-parallel replica per step, comma-separated, summing to train.global_batch (none = "
        "even; the planner sets it for devices of unequal speed)",
    )
    auto: bool = _f(
        False,
        "plan the layout for the world the launch gets (hybridpar train, hybridpar.launch): tp, pp, dp, schedule, "
        "virtual stages, partition, microbatches, ZeRO, recomputation; keys given explicitly stay as given; "
        "prints the choice and writes <run_dir>/plan.json",
    )
    hardware: str | None = _f(
        None, "with parallel.auto: hardware description (TOML, docs/hardware/) (none = probe this machine)"
    )
    auto_precision: bool = _f(
        False, "with parallel.auto: let the planner choose train.precision too (off: keep train.precision)"
    )
    timeout_s: float = _f(120.0, "bound in seconds on every collective and point-to-point wait")
    backend: str = _f("auto", "torch.distributed backend", choices=("auto", "gloo", "nccl"))
    recv_lookahead: int = _f(1, "compute actions ahead of use that receives are posted (>=0)")
    p2p: str = _f(
        "auto",
        "pipeline message transport: auto = shared memory between CPU ranks on one host "
        "(x86-64 Linux), else the process group (gloo/NCCL)",
        choices=("auto", "process_group", "shared_memory"),
    )
    zero: int = _f(
        0,
        "ZeRO stage over the data-parallel axis: 0 = every replica holds the whole optimizer state; "
        "1 = each dp rank holds the AdamW state of 1/dp of every parameter; 2 = that, and after the step's "
        "reduce-scatter each dp rank keeps only its 1/dp slice of every gradient (the whole gradients still "
        "accumulate during the backward); 3 = that, and each dp rank keeps only its 1/dp slice of every "
        "parameter at rest, all-gathering a layer's parameters just before the layer runs (the next layer's "
        "gather prefetched) and freeing them after (parallel.zero3_regather says when); with dp = 1 there is "
        "nothing to shard and 1, 2 and 3 act as 0",
        choices=(0, 1, 2, 3),
    )
    zero3_regather: str = _f(
        "microbatch",
        "with parallel.zero=3, when gathered parameters are freed: microbatch = after each layer's forward and "
        "again after its backward, so every microbatch gathers them anew (least memory, most traffic); step = "
        "kept from their first use in the step until its backward is done (one gather per layer per step, "
        "a stage's whole parameters held during the step)",
        choices=("microbatch", "step"),
    )
    grad_sum: str = _f(
        "overlapped",
        "how gradients are summed over microbatches and replicas: overlapped = accumulated in order and "
        "all-reduced in buckets during the backward; tree = one fixed binary tree over the step's microbatches, "
        "the same at every power-of-two dp, so a run resumed at another dp (dp × train.microbatches kept) trains "
        "bit for bit the uninterrupted run's model (no overlap; docs/checkpoints.md)",
        choices=("overlapped", "tree"),
    )
    sequence_parallel: bool = _f(
        False,
        "sequence parallelism (needs tp > 1): the norms, residual stream, embedding output and pipeline "
        "messages hold 1/tp of the sequence on each tp rank; the tp all-reduces become an all-gather before "
        "and a reduce-scatter after the sharded matmuls (the same bytes); train.seq_len must split over tp "
        "(with parallel.cp > 1: into 2 cp tp slices, each cp rank's chunks cut over tp)",
    )
    sp_backward: str = _f(
        "regather",
        "with sequence parallelism, what a column-parallel layer keeps for its weight gradient: regather = "
        "this rank's 1/tp slice of its gathered input, all-gathered again in the backward (Megatron-LM's way: "
        "the layer's largest activation / tp, one more all-gather per block and microbatch); saved = the "
        "gathered input itself (no zero-bubble schedule re-gathers: their W keeps the input anyway)",
        choices=("saved", "regather"),
    )
    cpu_bind: str = _f(
        "none",
        "CPU cores of each local rank: none = the OS schedules; cores = each rank on its "
        "own share of the cores, the ranks of one pipeline stage on different cores (more ranks than "
        "cores: round robin over the ranks in pipeline, data-parallel, tensor-parallel order)",
        choices=CPU_BINDINGS,
    )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-3 in effect: each dp rank holds 1/dp of every parameter at rest (with dp = 1, nothing)."""
        return self.zero == 3 and self.dp > 1

    @property
    def layout(self) -> tuple[int, int, int]:
        """(dp, pp, tp): the mesh's axes in rank order (topology/mesh.py), cp aside (it is 1 wherever this
        is read: CPU binding refuses cp > 1)."""
        return (self.dp, self.pp, self.tp)

    # Stages per rank (virtual_stages, or the schedule's own where unset) and the stage count are asked
    # of the schedule registry, above config/: pipeline.schedules.stages_per_rank and stage_count.


@dataclass
class TrainConfig:
    steps: int = _f(250, "optimizer steps")
    global_batch: int = _f(16, "sequences per step, summed over data-parallel replicas")
    microbatches: int = _f(4, "microbatches per data-parallel replica per step")
    microbatch_sizes: list[int] | None = _f(None, "explicit, possibly unequal split of each replica's batch")
    precision: str = _f(
        "fp32",
        "fp32, or bf16: compute in bfloat16 (autocast) with fp32 master weights, optimizer state and "
        "gradient reductions; pipeline messages in bfloat16",
        choices=("fp32", "bf16"),
    )
    bf16_weights: str = _f(
        "autocast",
        "with train.precision bf16: autocast (fp32 parameters, matmuls cast to bf16, the residual stream and norms "
        "fp32) or copies (Megatron's recipe: the stages' parameters are bf16 working copies, so the residual "
        "stream, norms and messages are bf16; each microbatch's weight gradient is summed into an fp32 gradient; "
        "AdamW steps fp32 masters, each dp rank its 1/dp slice as under ZeRO-1 (at parallel.zero 0 too; under "
        "ZeRO-3 the rank keeps its slice of the parameter in bf16 at rest); docs/precision.md)",
        choices=("autocast", "copies"),
    )
    compile: bool = _f(
        False,
        "torch.compile each decoder layer's training forward and backward (one compiled callable per process, "
        "shared by its layers: a handful of graphs whatever the depth; the run log counts them), with every "
        "schedule, recomputation mode and layout; the zero-bubble split's linear layers, ZeRO-3's gathers and "
        "ring attention stay eager between compiled regions; validation, sampling and serving run eager "
        "(docs/compile.md)",
    )
    compile_backend: str = _f(
        "inductor",
        "with train.compile: inductor (generated kernels: C++ on CPU, Triton on CUDA), or aot_eager (the same "
        "captured graphs and backward run with eager kernels, bit-identical to eager: a composition check)",
        choices=("inductor", "aot_eager"),
    )
    seq_len: int = _f(128, "tokens per sequence")
    lr: float = _f(3e-3, "peak learning rate")
    min_lr: float = _f(3e-4, "learning rate at the end of cosine decay")
    warmup_steps: int = _f(20, "linear warmup steps")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    fused_adamw: str = _f(
        "auto",
        "AdamW's kernel: on = torch's fused AdamW (one kernel updates every parameter), off = torch's default "
        "path (multi-tensor foreach on CUDA, a loop over parameters on CPU), auto = fused on CUDA, the default "
        "elsewhere (docs/compile.md); the same update either way, to rounding",
        choices=("auto", "on", "off"),
    )
    grad_clip: float = _f(1.0, "global gradient-norm clip (0 disables)")
    recompute: str = _f(
        "none",
        "activation recomputation of decoder layers in backward: none; full (keep each layer's input, "
        "rerun its forward); selective (keep the matmul outputs, rerun norms, rotary, attention core, "
        "activations); one mode for every stage, or one per pipeline stage, comma-separated",
    )
    rebuild_saved: bool = _f(
        True,
        "rebuild cheap saved tensors in the backward instead of keeping them, bit for bit the same gradients "
        "(llama: the projections' inputs from the norm's input and 1/rms, the down projection's from gate and "
        "up, k and v repeated to the query heads from one head of each group; gpt2: the projections' inputs "
        "from the LayerNorm's input, the second MLP projection's from the first's output; docs/memory.md); "
        "off where a "
        "layer is recomputed or compiled and under zero-bubble schedules (their W keeps the inputs anyway)",
    )
    seed: int = _f(0, "random seed")
    val_every: int = _f(50, "validate every N steps (0 disables)")
    monitor_every: int = _f(
        10,
        "every N steps, gather each rank's measured memory, stage times and "
        "link counters into metrics.jsonl (0 disables)",
    )
    val_batches: int = _f(4, "batches per validation")
    progress_every: int = _f(
        25, "print the progress line every N steps when the output is not a terminal (a terminal redraws it)"
    )
    sample_tokens: int = _f(200, "tokens generated at the end (0 disables)")
    sample_prompt: str = _f("def ", "prompt for the final sample")

    @property
    def working_copies(self) -> bool:
        """bf16 working copies in effect (train.precision bf16 with bf16_weights copies)."""
        return self.precision == "bf16" and self.bf16_weights == "copies"

    def recompute_modes(self, n_stages: int) -> list[str]:
        """The recomputation mode of each of `n_stages` stages (validate checks the entries)."""
        modes = [m.strip() for m in self.recompute.split(",")]
        return modes * n_stages if len(modes) == 1 else modes


@dataclass
class DataConfig:
    path: str | None = _f(
        None,
        "text file, folder of text files, token file of `hybridpar data prepare` (.bin with its .json) or "
        "nanoGPT uint16 .bin (none = stdlib .py files); or a weighted mixture of them, 'WEIGHT:PATH,...' "
        "(e.g. '0.7:web.bin,0.3:code.bin': each sample's source a function of seed and index)",
    )
    tokenizer: str | None = _f(
        None,
        "tokenizer directory (tokenizer.json, e.g. from `hybridpar data train-tokenizer`); data.path is then a "
        "token file prepared with it, and final/ carries it (none = model.init_from's own where it has one, else "
        "bytes)",
    )
    val_fraction: float = _f(0.05, "fraction of the corpus held out for validation")
    document_mask: bool = _f(
        False,
        "attention stays inside each document of a training window (causal within it, never across the "
        "boundaries of the token file's document index) and positions restart at 0 in each document; needs "
        "token files of `hybridpar data prepare`",
    )
    max_tokens: int | None = _f(
        None,
        "train on the first N tokens of the corpus only (a byte is a token of byte-level text); the run says "
        "how many of how many it uses (none = all of it)",
    )


@dataclass
class CheckpointConfig:
    every: int = _f(0, "save a checkpoint every N steps (0 = off)")
    keep: int = _f(3, "committed checkpoints kept; older ones are deleted after each new commit")
    dir: str | None = _f(None, "checkpoint directory (none = <run_dir>/checkpoints)")
    resume: str = _f(
        "off",
        "'off', 'auto' (the newest checkpoint in checkpoint.dir that verifies) or the path "
        "of one checkpoint directory; also --resume",
    )
    async_save: bool = _f(
        False,
        "snapshot to host memory and write in the background while training goes on " "(committed only once complete)",
    )


@dataclass
class ResilienceConfig:
    hang_timeout_s: float = _f(
        60.0,
        "a rank that stops beating, or a run where no rank progresses, for this long "
        "is named and the run aborted (0 disables the watchdog)",
    )
    slow_phase_timeout_s: float = _f(
        600.0,
        "allowance for phases that may legitimately take long without progress "
        "(checkpoint write, validation, train.compile's first step); a frozen rank is still named after "
        "hang_timeout_s",
    )
    heartbeat_s: float = _f(1.0, "seconds between heartbeats (and watchdog checks)")
    max_restarts: int = _f(
        3,
        "restarts of all workers by the elastic agent after a failure (hybridpar train "
        "and launch(); torchrun's --max-restarts overrides)",
    )
    resume_on_restart: bool = _f(
        True,
        "after a restart by the elastic agent, resume as with checkpoint.resume=auto (on several nodes: once the "
        "job has restarted, so a node that joins a running job resumes with it)",
    )
    replan: str = _f(
        "auto",
        "when resuming with a world size other than tp*pp*dp: 'auto' picks a new layout "
        "(with parallel.auto the planner's; else keep tp, then pp; dp takes the rest), 'off' refuses",
        choices=("auto", "off"),
    )


@dataclass
class BatchingConfig:
    policy: str = _f(
        "fixed",
        "how each replica's batch is cut into microbatches: 'fixed' (train.microbatches "
        "or batching.microbatch_size) or 'adaptive' (measured throughput under a memory "
        "budget, re-planned at run time)",
        choices=("fixed", "adaptive"),
    )
    microbatch_size: int | None = _f(
        None,
        "fixed policy: the fewest balanced microbatches of at most this many " "samples, instead of train.microbatches",
    )
    memory_budget: float | None = _f(
        None,
        "adaptive policy: activation memory per rank, in bytes (> 1) or as a "
        "fraction of the device's memory (<= 1) minus what is resident anyway",
    )
    steps_per_candidate: int = _f(3, "adaptive: measured steps per candidate split")
    warmup_steps: int = _f(1, "adaptive: unmeasured steps after each change of split")
    switch_margin: float = _f(
        0.03,
        "adaptive: splits within this fraction count as equal (a race ends once all left are shown "
        "within it of the leader; an incumbent is kept against a smaller gain)",
    )
    drift_margin: float = _f(
        0.10,
        "adaptive: race every split again when throughput falls by more than this fraction (or three "
        "standard errors of the noise the race measured, if more) in two windows of 8 steps in a row",
    )
    cooldown_steps: int = _f(50, "adaptive: at least this many steps between re-scans")
    try_recompute: bool = _f(
        False,
        "adaptive: also scan every split with full activation recomputation (larger microbatches fit "
        "the memory budget) and keep it where measured faster (train.recompute must be none)",
    )


@dataclass
class EmulateConfig:
    slowdown: str = _f(
        "",
        "TESTING/BENCHMARK MODE, off by default: stretch ranks' compute, e.g. "
        "'rank=2:2.0@step=10,rank=2:1.0@step=50' (rank 2 twice as slow for steps 10-49)",
    )
    drift: str = _f(
        "",
        "TESTING/BENCHMARK MODE, off by default: a rank slowing gradually and recovering, e.g. "
        "'rank=1:2.5@step=50+300' (1x at step 50, 2.5x at 200, 1x again at 350; see hybridpar/emulate/profiles.py)",
    )
    spike: str = _f(
        "",
        "TESTING/BENCHMARK MODE, off by default: a short one-off slowdown, e.g. "
        "'rank=1:5.0@step=40+3' (rank 1 5x slow for steps 40-42 only)",
    )
    slow_link: str = _f(
        "",
        "TESTING/BENCHMARK MODE, off by default: one pipeline boundary slower than the others, e.g. '1:10' "
        "(messages between pipeline ranks 1 and 2 each take 9 x emulate.link_ms longer; "
        "see hybridpar/emulate/slow_link.py)",
    )
    link_ms: float = _f(1.0, "the emulated time of one message on a normal link, used by emulate.slow_link only")
    fault: str = _f(
        "",
        "TESTING MODE, off by default: inject faults, each once per run_dir, e.g. "
        "'rank=1:kill@step=3:phase=forward' (see hybridpar/emulate/faults.py)",
    )
    layer_ms: float = _f(
        0.0,
        "BENCHMARK MODE, off by default (0): every compute action lasts this many ms per decoder layer "
        "and sample (backward twice that), the real compute inside it, so compute is a fixed duration",
    )
    layer_timing: str = _f(
        "measured",
        "TESTING MODE, with emulate.layer_ms: what the monitor and the balancer read as each compute action's "
        "time: 'measured' (the emulated cost plus whatever a loaded machine adds beyond it) or 'emulated' "
        "(the emulated cost alone, stretched by the slowdowns: the policy sees the emulated speeds exactly)",
        choices=("measured", "emulated"),
    )
    memory_limit: int | None = _f(
        None,
        "TESTING MODE, off by default: raise an out-of-memory error when a rank's "
        "activations held for backward would exceed this many bytes",
    )


@dataclass
class BalanceConfig:
    mode: str = _f(
        "off",
        "dynamic load balancing: 'off'; 'detect' (log decisions, change nothing); 'auto' "
        "(re-partition stages live and re-split the batch among replicas)",
        choices=("off", "detect", "auto"),
    )
    interval: int = _f(20, "never decide a rebalance more often than every N steps")
    min_gain: float = _f(0.05, "act only if the predicted step time falls by at least this fraction")
    threshold: float = _f(1.25, "straggler: smoothed time per unit of work above this x the others' median")
    skip_steps: int = _f(2, "first steps of a run not measured (allocation and lazy-init warm-up)")
    window: int = _f(
        7,
        "measurements in each rank's smoothing median and in each window a move is judged by (a slowdown "
        "of fewer than window - 1 steps, a spike, never moves layers)",
    )
    patience: int = _f(
        3, "consecutive measurements beyond the threshold before a straggler (or its " "recovery) counts"
    )
    persist: int = _f(
        2,
        "disjoint windows of balance.window measurements a move must pay off in (the latest and the ones "
        "before it, each read by its quietest steps and step by step against the other positions): an "
        "imbalance shorter than that (a spike, a burst of the machine's load) never moves layers; 1 = the "
        "latest window only",
    )
    weight_memory: float = _f(0.4, "load-score weight of memory pressure")
    weight_compute: float = _f(0.4, "load-score weight of compute time per unit of work")
    weight_network: float = _f(0.2, "load-score weight of communication wait")


@dataclass
class SinksConfig:
    tensorboard: str = _f(
        "auto",
        "TensorBoard event files under <run_dir>/tb: 'auto' = when the tensorboard package is installed "
        "(the tensorboard extra), 'on' = required, 'off'",
        choices=("auto", "on", "off"),
    )
    wandb: bool = _f(False, "also log each step to Weights & Biases (needs the wandb package; off unless asked)")
    step_details: bool = _f(
        True,
        "per-rank summaries, measured bubble and MFU in every step record, one step's timeline in "
        "<run_dir>/step_timeline.json (off only to measure what they cost: hybridpar bench records_cost)",
    )
    peak_probe_s: float = _f(
        0.2,
        "seconds each rank multiplies 512 x 512 matrices to measure the device's matmul peak for MFU where no "
        "data sheet lists it (once per run, kept in <run_dir>/device_peak.json); shorter is noisier: the "
        "tests' tiny runs, which read no MFU, use a few products",
    )
    wandb_project: str = _f("hybridpar", "the W&B project, when sinks.wandb is on")


@dataclass
class ProfileConfig:
    steps: str = _f(
        "",
        "run torch.profiler on these steps on every rank, e.g. '5-7' or '3' (empty = off); Chrome traces "
        "<run_dir>/profile/rank<r>.json with a range per pipeline action",
    )
    trace_steps: str = _f(
        "1-3", "the steps --trace FILE records, e.g. '1-3' (the default: past the first step's warm-up)"
    )
    memory: bool = _f(
        False,
        "CUDA only: also record the caching allocator's history over profile.steps and write each rank's "
        "snapshot (every allocation and free, with stack traces) to <run_dir>/profile/memory_rank<r>.json",
    )
