"""What autograd saves for backward, per decoder layer, embedding and head+loss, derived from the ops each
family runs, and each rank's peak of it over its action list: the activations term of the memory model
(plan/memory_model.py), in the activation meter's quantity (pipeline/activation_meter.py).
"""

from __future__ import annotations

from itertools import accumulate

from hybridpar.config import Config
from hybridpar.pipeline.schedules import Op, schedule_spec, stages_per_rank
from hybridpar.plan.messages import buffered, in_place, message_bytes
from hybridpar.plan.trace import Trace, activation_trace

F32, I64 = 4, 8


def table_casts(cfg: Config, has_layers: bool) -> int:
    """Under working copies, a stage's forward casts the rotary tables to the residual stream's bf16 once per
    microbatch (llama.py's forward), and its layers' rotations save that cast (autocast saves the fp32 tables
    themselves, once per step: step_saved)."""
    m = cfg.model
    on = cfg.train.working_copies and has_layers and m.family == "llama" and cfg.parallel.cp == 1
    return 2 * seq_len(cfg) * m.head_dim * 2 if on else 0


def seq_len(cfg: Config) -> int:
    """Tokens of one sample on one rank: the sequence, or under context parallelism its 1/cp (every
    per-token term below scales with it)."""
    return cfg.train.seq_len // cfg.parallel.cp


def ring_attention_saved(cfg: Config, bt: int, b: int) -> int:
    """What ring attention (parallel.cp > 1, model/ring_attention.py) saves instead of the fused kernel's:
    its q, and k, v of the kv heads only (the rank's own block), its fp32 output and log-sum-exp, and the
    output projection's input: the output itself in fp32 (laid out tokens-major, so the projection's
    input is a view of it), its bf16 cast under bf16. Llama's q and k come out of the rotary product
    with fp32 tables, so they are fp32 under autocast too (the ring computes in fp32); under working copies
    the tables' rows are cast to bf16 first, and q and k stay bf16."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    hq, hk, hd = m.n_heads // tp, m.kv_heads // tp, m.head_dim
    c = 2 if t.precision == "bf16" else F32
    qk = F32 if m.family == "llama" and not cfg.train.working_copies else c
    out = bt * hq * hd * F32 + b * hq * seq_len(cfg) * F32
    return bt * (hq + hk) * hd * qk + bt * hk * hd * c + out + (bt * hq * hd * c if c != F32 else 0)


def seq_shards(cfg: Config) -> int:
    """The sequence's slices under sequence parallelism (model/tp.py): tp with it, else 1. The norms'
    own tensors, a layer's input and the messages between stages hold 1/seq_shards of the tokens; what
    the tp-sharded matmuls save (their gathered inputs, their outputs) holds all of them."""
    p = cfg.parallel
    return p.tp if p.sequence_parallel and p.tp > 1 else 1


def regathers(cfg: Config, mode: str) -> bool:
    """Whether a layer's column-parallel projections keep only the 1/tp slice of their gathered input
    (parallel.sp_backward = "regather", model/regather.py): under sequence parallelism, where the layer is not
    recomputed or compiled and no zero-bubble W keeps the input anyway."""
    p = cfg.parallel
    split = schedule_spec(p.schedule).splits_backward
    return (
        seq_shards(cfg) > 1 and p.sp_backward == "regather" and mode == "none" and not split and not cfg.train.compile
    )


def rebuilds(cfg: Config, mode: str) -> bool:
    """Whether a layer's blocks rebuild cheap saved tensors in the backward (train.rebuild_saved,
    model/regather.py): where the layer is not recomputed or compiled and no zero-bubble W keeps the inputs
    anyway (as `regathers`)."""
    split = schedule_spec(cfg.parallel.schedule).splits_backward
    t = cfg.train
    return t.rebuild_saved and mode == "none" and not split and not t.compile


def layer_saved(cfg: Config, b: int, mode: str) -> int:
    """Bytes autograd saves for one decoder layer's backward, microbatch of b samples (tp rank's share).
    Counted per op from what each backward reads; checked against the meter by tests/test_memory_model.py."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    bt, d, hd = b * seq_len(cfg), m.dim, m.head_dim
    bs = bt // seq_shards(cfg)  # tokens of the sequence-sharded regions (all of them without SP)
    bg = bs if regathers(cfg, mode) else bt  # tokens of the projections' gathered inputs as kept
    hq, hk, f = m.n_heads // tp, m.kv_heads // tp, m.ffn_dim // tp
    low, copies = t.precision == "bf16", cfg.train.working_copies
    c = 2 if low else F32  # bytes of what the matmuls produce (autocast's dtype)
    r = 2 if copies else F32  # the residual stream's (bf16 under working copies)
    x = bs * d * r  # the layer's input: all that full recomputation keeps
    if mode == "full":
        return x
    llama = m.family == "llama"
    rb = rebuilds(cfg, mode)
    ins = 0 if rb and bg == bs else bg  # tokens of the projections' inputs kept (not rebuilt from the norm)
    if mode == "selective":  # the input and every matmul output
        outs = (hq + 2 * hk) * hd + 2 * d + (2 * f if llama else f)
        return x + bt * outs * c
    attn = 4 * bt * hq * hd * c + b * hq * seq_len(cfg) * F32  # attention's q, k, v, output; log-sum-exp (fp32)
    attn = ring_attention_saved(cfg, bt, b) if cfg.parallel.cp > 1 else attn
    if llama:
        # RMSNorm keeps its input and 1/rms (fp32; llama._RMSNorm); the projections keep their
        # input: the norm's output itself in fp32, under autocast its bf16 cast, one shared by q, k, v and
        # one by gate, up (llama.shared_casts; the weights' casts: weight_casts). SwiGLU keeps gate and up
        # (llama._SwiGLU recomputes silu(gate)), the down projection the product. Under working copies the
        # norm's input is bf16 and its output, bf16 too, is what the projections keep (the casts' bytes).
        # Rebuilt instead (model/regather.py): the projections' inputs (not a gathered whole kept as it is: SP,
        # sp_backward saved), the product, and of k, v repeated to the query heads all but one head of each group.
        norms = 2 * (bs * d * r + bs * F32 + (0 if low else ins * d * F32))
        casts = 2 * ins * d * 2 if low else 0
        if rb and cfg.parallel.cp == 1:
            attn -= 2 * bt * (hq - hk) * hd * c
        return norms + casts + attn + (2 if rb else 3) * bt * f * c
    # GPT-2: LayerNorm keeps input, mean and 1/std; q, k, v share the fused projection's output. The inputs of
    # the fused qkv and the first MLP projection (the norms' outputs, gathered) and the second's (gelu's output)
    # are kept, or rebuilt from the norms' inputs and the first's output (model/regather.py). Under working
    # copies the norms' input, mean and 1/std are bf16 (the residual stream's dtype: torch's CPU LayerNorm keeps
    # its statistics in the input's dtype where the weights share it; CUDA's keep them fp32, 4 bytes more a token).
    norms = 2 * (bs * d + 2 * bs) * r
    attn = bt * 3 * hq * hd * c + b * hq * seq_len(cfg) * F32 + bt * hq * hd * c
    attn = ring_attention_saved(cfg, bt, b) if cfg.parallel.cp > 1 else attn
    return norms + 2 * ins * d * c + attn + (1 if rb else 2) * bt * f * c


def weight_casts(cfg: Config, layers: int, last: bool) -> int:
    """autocast's bf16 copies of the linear weights a stage's matmuls save (`layers` decoder layers, the head
    on the last stage; tp rank's shards): made once per step where the rank's step spans autocast's cache
    (pipeline/runtime.py's step_casts: no stage of the rank recomputes), else once per microbatch."""
    m, tp = cfg.model, cfg.parallel.tp
    if cfg.train.precision != "bf16" or cfg.train.working_copies:  # working copies: the weights are bf16, no casts
        return 0
    d, hd, hq, hk, f = m.dim, m.head_dim, m.n_heads // tp, m.kv_heads // tp, m.ffn_dim // tp
    if m.family == "llama":  # q, k, v; o; gate, up, down
        per_layer = (hq + 2 * hk) * hd * d + hq * hd * d + 3 * d * f
    else:  # the fused qkv; the output projection; the MLP's two
        per_layer = 3 * hq * hd * d + hq * hd * d + 2 * d * f
    return 2 * (layers * per_layer + ((m.vocab_size // tp) * d if last else 0))


def ends_saved(cfg: Config, b: int, first: bool, last: bool) -> int:
    """Per microbatch, what the embedding (first stage) and the final norm, head and loss (last) save."""
    m, t = cfg.model, cfg.train
    bt, d, low = b * seq_len(cfg), m.dim, t.precision == "bf16"
    out = embedding_saved(cfg, b) if first else 0
    if cfg.parallel.cp > 1 and m.family == "llama":  # each microbatch's rows of the rotary tables (cos, sin)
        out += 2 * bt * m.head_dim * (2 if cfg.train.working_copies else F32)  # working copies: their bf16 cast
    if last:
        # The final norm as in the layers, the head's input (its cast under autocast; the weight's cast:
        # weight_casts), the fp32 log-softmax over the whole vocabulary, the loss's total weight.
        bs = bt // seq_shards(cfg)  # the final norm runs on the rank's slice of the sequence
        r = 2 if cfg.train.working_copies else F32  # the residual stream's bytes
        norm = bs * d * r + (bs * F32 if m.family == "llama" else 2 * bs * r)
        head_in = bt * d * 2 if low else bt * d * F32
        out += norm + head_in + bt * m.vocab_size * F32 + F32
    return out


def embedding_saved(cfg: Config, b: int) -> int:
    """Per microbatch of b samples, what the first stage's embedding saves: under a vocabulary-parallel lookup
    the shifted ids and the outside-the-shard mask (one rank: the ids themselves, a view of the replica's
    batch, counted once per step in `step_saved`); GPT-2's positions looked up."""
    bt = b * seq_len(cfg)
    return (bt * (I64 + 1) if cfg.parallel.tp > 1 else 0) + (seq_len(cfg) * I64 if cfg.model.family == "gpt2" else 0)


def held_through_b(cfg: Config, b: int, first: bool, has_layers: bool) -> int:
    """Recomputing, what of a microbatch's saved bytes its B frees only at its end, past its high point (the
    rerun of the stage's first layer): what the embedding saves, which its backward, B's last, frees; under
    working copies the rotary tables' bf16 cast, an input of every layer's rerun, freed with the first's."""
    return (embedding_saved(cfg, b) if first else 0) + table_casts(cfg, has_layers)


def step_saved(cfg: Config, first: bool, last: bool, replica: int) -> int:
    """Saved once per stage while any of its microbatches is held: the rotary tables (one storage per
    stage), the replica's token ids (first stage, one rank) and targets (last stage)."""
    m = cfg.model
    rope = 2 * seq_len(cfg) * m.head_dim * F32 if m.family == "llama" and cfg.parallel.cp == 1 else 0
    rope = 0 if cfg.train.working_copies else rope  # their bf16 casts, per microbatch: table_casts
    ids = replica * seq_len(cfg) * I64
    return rope + (ids if first and cfg.parallel.tp == 1 else 0) + (ids if last else 0)


def weight_held(cfg: Config, b: int, layers: int, last: bool) -> int:
    """What a zero-bubble split keeps from B until W for one microbatch (split_backward.py): each linear
    layer's input and output gradient — per decoder layer the two norm outputs (fp32), the attention
    output and the MLP's last input, the projections' output gradients; on the last stage the head's
    input and its (vocabulary shard of the) logits' gradient. The same whatever the recomputation: a
    recomputed layer's rerun in B hands over the same tensors."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    bt, d, hd, f = b * seq_len(cfg), m.dim, m.head_dim, m.ffn_dim // tp
    hq, hk = m.n_heads // tp, m.kv_heads // tp
    c = 2 if t.precision == "bf16" else F32
    # llama's projections read the norms' shared bf16 cast; GPT-2's the norm's output, fp32 under autocast
    # and bf16 under working copies
    shared = c if m.family == "llama" or cfg.train.working_copies else F32
    inputs = 2 * bt * d * shared + bt * hq * hd * c + bt * f * c
    grads = bt * (hq + 2 * hk) * hd * c + 2 * bt * d * c + (2 if m.family == "llama" else 1) * bt * f * c
    head = bt * d * (2 if cfg.train.working_copies else F32) + bt * (m.vocab_size // tp) * c if last else 0
    return layers * (inputs + grads) + head


def activation_peaks(
    cfg: Config, parts: list[range], sizes: list[int], actions: list[list], trace: Trace | None = None
) -> list[int]:
    """Per rank, the most saved bytes alive at once: a forward adds its microbatch's, its backward (B)
    frees them, the per-stage constants count while any microbatch of the stage is held. Where B and W
    are split, B trades the saved tensors for what W needs (weight_held), held until W; inside B the
    first output gradient is held before anything is freed (no recomputation), or every hold is
    in place while the stage's first layer input is still saved (recomputation: the rerun makes them), with
    what B frees only at its end (held_through_b), the last stage's targets gone (the loss's backward runs first).
    `trace`: the lists' `activation_trace` for these sizes, where the caller keeps it."""
    trace = trace or activation_trace(sizes, actions)
    n, replica = len(parts), sum(sizes)
    modes = cfg.train.recompute_modes(n)
    split = trace.split
    ranks = schedule_spec(cfg.parallel.schedule).stage_ranks(cfg.parallel.pp, stages_per_rank(cfg.parallel))
    spans = [all(modes[o] == "none" for o in range(n) if ranks[o] == ranks[s]) for s in range(n)]
    c = 2 if cfg.train.precision == "bf16" else F32
    own = in_place(cfg) and buffered(cfg, split)  # received messages read where they landed, in the rank's buffers
    terms: dict[tuple[int, int], tuple[int, int, int, int, int]] = {}

    def term(s: int, b: int) -> tuple[int, int, int, int, int]:
        """(saved per microbatch, per-stage constant, kept from B to W, B's own high point above `live`, what of
        the constant a B that frees it frees before that point) of stage s, microbatch of b samples: the same
        for every action of the pair, so counted once."""
        first, last = s == 0, s == n - 1
        one = len(parts[s]) * layer_saved(cfg, b, modes[s]) + ends_saved(cfg, b, first, last)
        one += table_casts(cfg, bool(parts[s]))
        const = step_saved(cfg, first, last, replica)
        # A recomputed layer saves no weight casts (its rerun makes them); the head is never recomputed.
        casts = weight_casts(cfg, len(parts[s]) if modes[s] == "none" else 0, last)  # per step or microbatch
        one, const = (one, const + casts) if spans[s] else (one + casts, const)
        kept = weight_held(cfg, b, len(parts[s]), last) if split else 0
        # W's inputs are held from F on (a recomputed layer's from B); under autocast GPT-2's linear
        # layers' fp32 inputs (the norms' outputs) are not what autograd saves (their bf16 casts), so
        # they come on top: two per layer, and the head's (never recomputed); llama's layers read the
        # saved shared cast (llama.shared_casts), so only its head's.
        per_layer = 2 * (modes[s] == "none") * (cfg.model.family != "llama")
        norms = per_layer * len(parts[s]) + last
        widened = split and c == 2 and not cfg.train.working_copies  # working copies: W holds what autograd saves
        one += norms * b * seq_len(cfg) * cfg.model.dim * F32 if widened else 0
        bt_d = b * seq_len(cfg) * cfg.model.dim // seq_shards(cfg)  # a stage's input and output
        # Recomputing, B holds all W needs while the stage's input (the residual stream's dtype) is still saved.
        r = 2 if cfg.train.working_copies else F32
        rerun = kept - one + bt_d * r + held_through_b(cfg, b, first, bool(parts[s]))
        inside = (0 if last else bt_d * c) if modes[s] == "none" else rerun
        # ... while the loss's backward, B's first, has freed the targets (one storage per step) where B frees it.
        targets = replica * seq_len(cfg) * I64 if last and modes[s] != "none" else 0
        # A message read in place from a receive buffer is the buffer itself, which `buffers` counts
        # (plan/messages.py): the stage input its first layer saves, and under a split the output gradient
        # W keeps (B's first hold, the gradient the residual stream hands through unchanged).
        recv = message_bytes(cfg, b) if own and s > 0 and ranks[s - 1] != ranks[s] else 0
        grad = message_bytes(cfg, b) if own and split and not last and ranks[s + 1] != ranks[s] else 0
        return one - recv, const, kept - grad, inside - grad, targets

    # Per distinct step: what it adds to `live`, and (B, split) how far above `live` after it B peaks inside.
    delta, above = [], []
    for op, s, b, edge in trace.steps:
        key = (s, b)
        one, const, kept, inside, early = terms[key] if key in terms else terms.setdefault(key, term(*key))
        if op == Op.FORWARD:
            d = one + (const if edge else 0)
        elif op == Op.BACKWARD:
            d = kept - one - (const if edge else 0)
        else:
            d = -kept
        delta.append(d)
        above.append(inside - d - (early if op == Op.BACKWARD and edge else 0))  # B's peak: live before it + inside
    peaks = []
    for seq, bpos in zip(trace.ranks, trace.backwards):
        live = list(accumulate(map(delta.__getitem__, seq)))
        peak = max(live, default=0)
        if split:
            peak = max([peak] + [live[i] + above[seq[i]] for i in bpos])
        peaks.append(max(peak, 0))
    return peaks
