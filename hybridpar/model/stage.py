"""`Stage`: what every model family's module is, and all that code outside `model/` may use of it.

A stage is any contiguous slice of a decoder-only model: the embedding (first slice), a run of
decoder layers and the final norm + head (last slice). The whole model is simply the slice holding
everything, so single-device training, every pipeline stage, serving and the reference in the tests
run one code path. Layers are kept in a `ModuleDict` keyed by their global index so that parameter
names are the Hugging Face names whatever the split.

Initialisation is seeded per parameter *name* (not by construction order), so a stage built alone
holds bit-for-bit the same values as the same layers inside the full model: the same seed gives the
same full model under every (tp, pp, dp) layout.

A family subclasses `Stage`, names its embedding, head and layer container (class attributes), gives
its tensor-parallel plan and init rule, and implements `forward(x, kv)` and `kv_heads()`; its forward
runs each decoder layer through `run_layer`, which applies the stage's activation recomputation.
"""

from __future__ import annotations

import zlib
from typing import Callable, ClassVar, Sequence

import torch
from torch import nn

from hybridpar.config import ModelConfig
from hybridpar.model.kvcache import KVCache, KVStep
from hybridpar.model.recompute import run_layer


class Stage(nn.Module):
    """Layers `layers` of the model, plus the embedding if `first` and the final norm and head if `last`.

    Input: token ids (B, T) on the first stage, hidden states (B, T, d) elsewhere.
    Output: logits (B, T, vocab) on the last stage, hidden states (B, T, d) elsewhere.
    """

    EMBED: ClassVar[str]  # full-model name of the token embedding's weight
    HEAD: ClassVar[str]  # full-model name of the output projection's weight
    LAYERS: ClassVar[str]  # module path of the ModuleDict of decoder layers
    TP_PLAN: ClassVar[dict[str, str]]  # module-name pattern -> style (model/tp.py)

    def __init__(self, cfg: ModelConfig, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.first, self.last = first, last
        self.layer_ids = list(layers)
        self.recompute = "none"  # train.recompute for this stage (model/recompute.py)
        self.recompute_phase: str | None = None  # "forward" / "recompute" while a layer is recomputed
        # train.compile: compiled(layer, *args) runs a layer in training (model/compiled.py), None = eager.
        self.compiled: Callable[..., torch.Tensor] | None = None
        # Sequence parallelism (model/tp.py): hidden states here are slice `seq_rank` of `seq_shards`
        # equal slices of the sequence, (B, T/seq_shards, d); set by apply_tp.
        self.seq_rank, self.seq_shards = 0, 1
        # train.rebuild_saved: blocks rebuild cheap saved tensors in the backward (model/regather.py);
        # `rebuild_now`: in force (the runtime turns it off where a zero-bubble W keeps the inputs anyway).
        self.rebuild_saved = self.rebuild_now = True

    def seq_slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of `t` along its sequence dimension `dim` (all of it without sequence parallelism)."""
        n = t.shape[dim] // self.seq_shards
        return t.narrow(dim, self.seq_rank * n, n)

    def run_layer(self, layer: nn.Module, *args: object) -> torch.Tensor:
        """One decoder layer's forward, under this stage's activation recomputation mode."""
        return run_layer(self, layer, *args)

    # -- structure ----------------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleDict:
        """The decoder layers this stage holds, keyed by global index ('7'), in order."""
        return self.get_submodule(self.LAYERS)

    def set_layers(self, layers: dict[str, nn.Module]) -> None:
        """Hold exactly `layers` (global index -> layer), e.g. after a live re-partition moved some."""
        parent, _, attr = self.LAYERS.rpartition(".")
        setattr(self.get_submodule(parent), attr, nn.ModuleDict(layers))
        self.layer_ids = [int(i) for i in layers]

    @property
    def holds_tied_copy(self) -> bool:
        """True when this stage's head is a separate copy of the embedding tied across pipeline stages
        (its gradient must be summed with the first stage's)."""
        return self.cfg.tied and self.last and not self.first

    def stored_name(self, name: str) -> str:
        """The full-model name under which parameter `name` is stored and counted: a tied head is the
        embedding (HF files often omit lm_head.weight then; checkpoints save it once)."""
        return self.EMBED if name == self.HEAD and self.cfg.tied else name

    def tie_(self) -> None:
        """Make the head use the embedding's tensor when this stage holds both (after building, after
        materialising from the meta device and after sharding, each of which may replace tensors)."""
        if self.cfg.tied and self.first and self.last:
            head, embed = (self.get_submodule(n.rpartition(".")[0]) for n in (self.HEAD, self.EMBED))
            head.weight = embed.weight

    # -- initialisation ------------------------------------------------------------------------------
    def init_rule(self, name: str) -> tuple[str, float]:
        """("fill", value) or ("normal", std) for the full-model parameter `name`."""
        raise NotImplementedError

    def init_(self, seed: int) -> None:
        """Initialise every parameter from (seed, name) on the CPU, then copy to its device, so values do
        not depend on the layout, the device or the order modules were built in."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                kind, value = self.init_rule(name)
                if kind == "fill":
                    p.fill_(value)
                    continue
                # A head tied across stages starts as an exact copy of the embedding.
                g = torch.Generator().manual_seed(init_seed(seed, self.stored_name(name)))
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, value, generator=g))

    # -- serving -------------------------------------------------------------------------------------
    def kv_heads(self) -> int:
        """Key/value heads of one layer held by this rank (n_kv_heads / tp)."""
        raise NotImplementedError

    def new_cache(self, n_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype) -> KVCache:
        """This stage's paged KV pools: n_blocks blocks of block_size tokens per layer (model/kvcache.py)."""
        return KVCache(self.layers.keys(), self.kv_heads(), self.cfg.head_dim, n_blocks, block_size, device, dtype)

    @torch.no_grad()
    def forward_cached(
        self, x: torch.Tensor, cache: KVCache, pos: torch.Tensor, n_valid: torch.Tensor, tables: torch.Tensor
    ) -> torch.Tensor:
        """R sequences' new tokens packed into one row: x ids (1, N) on the first stage, hidden (1, N, d)
        elsewhere; pos (R,): position of each sequence's first token here; n_valid (R,): its tokens here
        (they sum to N); tables (R, NB): its KV blocks. Returns hidden (1, N, d), or on the last stage the
        logits at each sequence's last token (R, V)."""
        out = self(x, KVStep(cache, pos, n_valid, tables))
        return out[:, 0].float() if self.last else out

    def forward(self, x: torch.Tensor, kv: KVStep | None = None) -> torch.Tensor:
        raise NotImplementedError


def init_seed(seed: int, name: str) -> int:
    """Seed of one parameter: depends only on the run seed and the parameter's global name."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def generate(
    model: Stage, prompt: list[int], n_tokens: int, temperature: float = 0.8, top_k: int = 0, seed: int = 0
) -> list[int]:
    """Sample `n_tokens` after `prompt` with the full model (no KV cache: this is the end-of-training
    demo and the serving tests' reference). Greedy when temperature == 0. A family with learned
    positions reads only the last `max_positions` tokens (as nanoGPT's sample does)."""
    device = next(model.parameters()).device
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    window = model.cfg.max_positions or ids.shape[1] + n_tokens
    out: list[int] = []
    for _ in range(n_tokens):
        logits = model(ids[:, -window:])[0, -1].float().cpu()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return out
