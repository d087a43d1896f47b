"""What configuration validation knows of each model family, as plain data.

A family's code (its modules, tensor-parallel plan, Hugging Face names and layouts) lives in
`hybridpar/model/`, which sits above `config/` in the layer order; validation must run before any
model is built, and without importing torch. So the few facts it needs are kept here, one
`FamilyRules` per family name, and `model/registry.py` has one implementation per name here (a test
checks that the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # sections.py imports this module; the name is needed for annotations only
    from hybridpar.config.sections import ModelConfig


@dataclass(frozen=True)
class FamilyOption:
    """A model option that only some families have."""

    what: str  # the feature it configures, for error messages
    unset: Callable[[ModelConfig], bool]  # True when the option is at its neutral value


# Options tied to one architecture: a family that does not use one refuses it unless left unset, so a
# setting never silently does nothing.
OPTIONS: dict[str, FamilyOption] = {
    "n_kv_heads": FamilyOption(
        "grouped-query attention (fewer key/value heads than query heads)",
        lambda m: m.n_kv_heads is None or m.n_kv_heads == m.n_heads,
    ),
    "rope_theta": FamilyOption("rotary position embeddings (RoPE)", lambda m: m.rope_theta == 10000.0),
    "n_positions": FamilyOption("learned absolute position embeddings", lambda m: m.n_positions is None),
    "rope_scaling": FamilyOption("rotary frequency scaling", lambda m: m.rope_scaling == "none"),
}


@dataclass(frozen=True)
class FamilyRules:
    about: str  # one line for help texts
    tied: bool  # model.tie_embeddings when left unset
    options: tuple[str, ...]  # the OPTIONS this family has
    tp_splits: tuple[str, ...]  # ModelConfig sizes that tensor parallelism splits evenly over tp ranks
    rotary: bool  # rotary embeddings rotate pairs of a head's dimensions: head_dim must be even
    default_positions: int | None = None  # learned positions when model.n_positions is unset


FAMILIES: dict[str, FamilyRules] = {
    "llama": FamilyRules(
        "Llama: RMSNorm, rotary positions, SwiGLU MLP, optional grouped-query attention, no biases",
        tied=False,
        options=("n_kv_heads", "rope_theta", "rope_scaling"),
        tp_splits=("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"),
        rotary=True,
    ),
    # GPT-2 ties its head to the token embedding (GPT2LMHeadModel._tied_weights_keys) and reads at most
    # n_positions = 1024 tokens (GPT2Config defaults).
    "gpt2": FamilyRules(
        "GPT-2: LayerNorm, learned positions, GELU MLP, biases, tied embeddings",
        tied=True,
        options=("n_positions",),
        tp_splits=("n_heads", "ffn_dim", "vocab_size"),
        rotary=False,
        default_positions=1024,
    ),
}


def rules(m: ModelConfig) -> FamilyRules:
    """The rules of `m.family`; ValueError naming the field when there is no such family."""
    if m.family not in FAMILIES:
        raise ValueError(f"model.family={m.family!r} is not one of {', '.join(FAMILIES)}")
    return FAMILIES[m.family]


def tp_split_sizes(m: ModelConfig) -> dict[str, int]:
    """{field: size} of every size tensor parallelism must divide, for `m`'s family."""
    return {k: m.kv_heads if k == "n_kv_heads" else getattr(m, k) for k in rules(m).tp_splits}
