"""Unit tests for hybridpar.config: validation messages, strict dict loading, TOML files and CLI parsing."""

import ast
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

import hybridpar.config as config_module
from hybridpar.config import Config, TrainConfig, help_text, load_toml, parse_args
from hybridpar.pipeline.schedules import schedule_names, stage_count, stages_per_rank
from hybridpar.pipeline.schedules.config_rules import validate_config


def make(**dotted: Any) -> Config:
    """A default Config with `section__key=value` overrides set directly (bypassing from_dict's type checks)."""
    cfg = Config()
    for key, value in dotted.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def invalid(cfg: Config, message: str, world_size: int | None = None) -> None:
    """Assert the pre-flight's validation (Config.validate, then the schedule registry's rules) fails with a
    message containing `message` literally."""
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_config(cfg, world_size)


# ---- defaults and derived values -------------------------------------------------------------------------------


def test_defaults_validate_for_four_processes() -> None:
    cfg = Config()
    validate_config(cfg, world_size=4)
    validate_config(cfg)
    assert cfg.parallel.world_size == 4
    assert stage_count(cfg.parallel) == 2
    assert cfg.model.head_dim == 32
    assert cfg.model.kv_heads == 4
    assert make(model__n_kv_heads=2).model.kv_heads == 2
    assert stage_count(make(parallel__pp=3, parallel__virtual_stages=2).parallel) == 6


def test_sections_are_independent_and_mutable() -> None:
    a, b = Config(), Config()
    a.train.steps = 7
    assert b.train.steps == TrainConfig().steps != 7
    assert a.model is not b.model


def test_every_field_has_help() -> None:
    for section in ("model", "parallel", "train", "data"):
        for f in dataclasses.fields(getattr(Config(), section)):
            assert f.metadata["help"], f"{section}.{f.name} has no help"


def test_config_package_does_not_import_torch() -> None:
    files = sorted(Path(config_module.__file__).parent.glob("*.py"))
    assert len(files) > 1  # the package's modules, not only its __init__
    for path in files:
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "torch" not in imported, path.name


# ---- validate: ranges -------------------------------------------------------------------------------------------

COUNTS = [
    "model__vocab_size",
    "model__dim",
    "model__n_layers",
    "model__n_heads",
    "model__n_kv_heads",
    "model__n_positions",
    "model__ffn_dim",
    "parallel__tp",
    "parallel__pp",
    "parallel__dp",
    "parallel__virtual_stages",
    "train__steps",
    "train__global_batch",
    "train__microbatches",
    "train__seq_len",
    "train__val_batches",
    "data__max_tokens",
]


@pytest.mark.parametrize("key", COUNTS)
@pytest.mark.parametrize("bad", [0, -3])
def test_counts_must_be_positive(key: str, bad: int) -> None:
    # n_kv_heads and n_positions may also be None, and their message says so.
    pattern = re.escape(key.replace("__", ".")) + rf" must be a positive integer( or none)?, got {bad}"
    with pytest.raises(ValueError, match=pattern):
        validate_config(make(**{key: bad}))


def test_count_rejects_non_integers() -> None:
    invalid(make(train__steps=2.5), "train.steps must be a positive integer, got 2.5")
    invalid(make(parallel__tp=True), "parallel.tp must be a positive integer, got True")


@pytest.mark.parametrize(
    "key", ["train__warmup_steps", "train__val_every", "train__sample_tokens", "parallel__recv_lookahead"]
)
def test_non_negative_ints(key: str) -> None:
    invalid(make(**{key: -1}), f"{key.replace('__', '.')} must be a non-negative integer, got -1")
    validate_config(make(**{key: 0}), 4)  # zero is the documented "disable"/"no lookahead" value


@pytest.mark.parametrize(
    "key",
    [
        "train__lr",
        "train__eps",
        "parallel__timeout_s",
        "model__norm_eps",
        "model__init_std",
        "model__rope_theta",
        "sinks__peak_probe_s",
    ],
)
@pytest.mark.parametrize("bad", [0.0, -1.0])
def test_strictly_positive_floats(key: str, bad: float) -> None:
    invalid(make(**{key: bad}), f"{key.replace('__', '.')} must be > 0, got {bad}")


def test_nan_learning_rate_is_rejected() -> None:
    invalid(make(train__lr=math.nan), "train.lr must be > 0, got nan")


@pytest.mark.parametrize(
    ("dotted", "message"),
    [
        ({"train__min_lr": -1e-4}, "train.min_lr must be between 0 and train.lr=0.003, got -0.0001"),
        ({"train__min_lr": 0.01}, "train.min_lr must be between 0 and train.lr=0.003, got 0.01"),
        ({"train__grad_clip": -0.5}, "train.grad_clip must be >= 0 (0 disables clipping), got -0.5"),
        ({"train__beta1": 1.0}, "train.beta1 must be in [0, 1), got 1.0"),
        ({"train__beta2": -0.1}, "train.beta2 must be in [0, 1), got -0.1"),
        ({"data__val_fraction": 0.0}, "data.val_fraction must be in (0, 0.5), got 0.0"),
        ({"data__val_fraction": 0.5}, "data.val_fraction must be in (0, 0.5), got 0.5"),
    ],
)
def test_float_ranges(dotted: dict[str, Any], message: str) -> None:
    invalid(make(**dotted), message)


def test_range_edges_that_are_allowed() -> None:
    validate_config(make(train__min_lr=0.0, train__grad_clip=0.0, train__beta1=0.0), 4)
    validate_config(make(train__min_lr=3e-3), 4)  # min_lr == lr: a constant schedule


# ---- validate: choices and world size ---------------------------------------------------------------------------


def test_unknown_schedule_suggests_the_closest() -> None:
    # Every registered name, in the registry's order (a schedule added there joins the list).
    names = ", ".join(schedule_names())
    assert names.startswith("gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-v")
    invalid(make(parallel__schedule="1f1"), f"parallel.schedule='1f1' is not one of {names} (did you mean '1f1b'?)")


def test_schedule_rules_run_above_config() -> None:
    # config/ sits below the schedule registry: Config.validate leaves the schedule to validate_config,
    # which the pre-flight check runs before any process starts.
    cfg = make(parallel__schedule="1f1", parallel__pp=4, train__microbatches=2)
    cfg.validate(8)
    invalid(cfg, "parallel.schedule='1f1' is not one of", 8)
    make(parallel__pp=4, train__microbatches=2).validate(8)
    invalid(make(parallel__pp=4, train__microbatches=2), "parallel.schedule=1f1b needs train.microbatches", 8)


def test_unknown_partition_and_backend() -> None:
    invalid(
        make(parallel__partition="costs"),
        "parallel.partition='costs' is not one of uniform, params, cost, layers " "(did you mean 'cost'?)",
    )
    with pytest.raises(ValueError, match=r"parallel.backend='mpi' is not one of auto, gloo, nccl$"):
        validate_config(make(parallel__backend="mpi"))


def test_p2p_transport_is_a_choice_and_shared_memory_needs_cpu() -> None:
    invalid(make(parallel__p2p="shm"), "parallel.p2p='shm' is not one of auto, process_group, shared_memory")
    invalid(
        make(parallel__p2p="shared_memory", parallel__backend="nccl"),
        "parallel.p2p=shared_memory carries CPU tensors, but parallel.backend=nccl runs on GPUs: "
        "use parallel.p2p=auto or process_group",
    )
    validate_config(make(parallel__p2p="shared_memory", parallel__backend="gloo"), 4)


def test_world_size_mismatch_names_the_layout() -> None:
    invalid(
        Config(),
        "parallel.tp × parallel.pp × parallel.dp = 2 × 2 × 1 = 4, but 3 processes were started: "
        "start 4 processes or change the layout",
        world_size=3,
    )
    validate_config(make(parallel__dp=2), world_size=8)


# ---- validate: model shape --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dotted", "message"),
    [
        ({"model__dim": 130}, "model.dim=130 is not divisible by model.n_heads=4"),
        ({"model__dim": 12}, "model.head_dim = model.dim // model.n_heads = 12 // 4 = 3 must be even"),
        (
            {"model__n_kv_heads": 3},
            "model.n_heads=4 is not divisible by model.n_kv_heads=3: model.n_kv_heads is one of 1, 2, 4",
        ),
        ({"model__n_kv_heads": 8}, "model.n_heads=4 is not divisible by model.n_kv_heads=8"),
        (
            {"parallel__tp": 3, "model__n_heads": 8},
            "parallel.tp=3 does not divide model.n_heads=8: parallel.tp of this model is one of 1, 2, 4",
        ),
        ({"model__n_kv_heads": 1}, "parallel.tp=2 does not divide model.n_kv_heads=1"),
        ({"model__ffn_dim": 353}, "parallel.tp=2 does not divide model.ffn_dim=353"),
        ({"model__vocab_size": 255}, "parallel.tp=2 does not divide model.vocab_size=255"),
    ],
)
def test_model_shape_rules(dotted: dict[str, Any], message: str) -> None:
    invalid(make(**dotted), message)


@pytest.mark.parametrize(
    ("dotted", "message"),
    [
        ({"model__family": "bert"}, "model.family='bert' is not one of llama, gpt2"),
        (
            {"model__family": "gpt2", "model__n_kv_heads": 2},
            "model.n_kv_heads=2 configures grouped-query attention "
            "(fewer key/value heads than query heads), which model.family=gpt2 does not have:"
            " leave model.n_kv_heads unset",
        ),
        (
            {"model__family": "gpt2", "model__rope_theta": 5e5},
            "model.rope_theta=500000.0 configures rotary position "
            "embeddings (RoPE), which model.family=gpt2 does not have",
        ),
        (
            {"model__n_positions": 512},
            "model.n_positions=512 configures learned absolute position embeddings, which "
            "model.family=llama does not have",
        ),
        (
            {"model__family": "gpt2", "model__n_positions": 64},
            "train.seq_len=128 exceeds the 64 learned positions of " "model.family=gpt2: raise model.n_positions",
        ),
        ({"model__family": "gpt2", "model__ffn_dim": 353}, "parallel.tp=2 does not divide model.ffn_dim=353"),
        ({"model__family": "gpt2", "model__tie_embeddings": "yes"}, "model.tie_embeddings must be true, false or none"),
    ],
)
def test_family_rules(dotted: dict[str, Any], message: str) -> None:
    invalid(make(**dotted), message)


def test_family_defaults() -> None:
    gpt2 = make(
        model__family="gpt2",
        model__n_heads=6,
        model__dim=198,
        model__ffn_dim=792,
        model__vocab_size=258,
        parallel__tp=3,
    )
    validate_config(gpt2, 6)  # no rotary embeddings, so an odd head size (33) is fine
    assert gpt2.model.tied and gpt2.model.max_positions == 1024 and not Config().model.tied
    assert Config().model.max_positions is None
    assert make(model__family="gpt2", model__tie_embeddings=False).model.tied is False
    validate_config(make(model__family="gpt2", model__n_kv_heads=4), 4)  # n_kv_heads = n_heads is no GQA: accepted


def test_grouped_query_attention_and_tied_embeddings_are_fine() -> None:
    validate_config(make(model__n_kv_heads=2, model__tie_embeddings=True), 4)
    validate_config(make(model__tie_embeddings=True, parallel__pp=4, parallel__tp=1), 4)


# ---- validate: pipeline stages and schedules --------------------------------------------------------------------


def test_too_few_layers_for_the_stages() -> None:
    invalid(
        make(model__n_layers=2, parallel__virtual_stages=2, parallel__schedule="interleaved-1f1b"),
        "model.n_layers=2 is fewer than parallel.pp × parallel.virtual_stages = 2 × 2 = 4 stages",
    )


def test_virtual_stages_need_interleaving() -> None:
    invalid(
        make(parallel__virtual_stages=2),
        "parallel.schedule=1f1b runs 1 stage per pipeline rank, got "
        "parallel.virtual_stages=2: set parallel.virtual_stages=1 (the default) or "
        "parallel.schedule=interleaved-1f1b",
    )
    validate_config(make(parallel__virtual_stages=2, parallel__schedule="interleaved-1f1b"), 4)


def test_virtual_stages_default_to_the_schedules_own() -> None:
    assert make().parallel.virtual_stages is None and stage_count(make().parallel) == 2  # 1F1B: one per rank
    interleaved = make(parallel__schedule="interleaved-1f1b")
    assert stages_per_rank(interleaved.parallel) == 2 and stage_count(interleaved.parallel) == 4
    validate_config(interleaved, 4)
    assert stage_count(make(parallel__schedule="interleaved-1f1b", parallel__virtual_stages=3).parallel) == 6


def test_interleaving_needs_two_pipeline_ranks() -> None:
    invalid(
        make(parallel__pp=1, parallel__schedule="interleaved-1f1b"),
        "parallel.schedule=interleaved-1f1b needs parallel.pp >= 2, got 1",
    )


def test_1f1b_needs_a_microbatch_per_pipeline_rank() -> None:
    invalid(
        make(parallel__pp=4, train__microbatches=2),
        "parallel.schedule=1f1b needs train.microbatches ≥ parallel.pp=4, got 2",
    )
    invalid(
        make(parallel__pp=4, train__microbatches=2, parallel__schedule="interleaved-1f1b", parallel__virtual_stages=1),
        "parallel.schedule=interleaved-1f1b needs train.microbatches ≥ parallel.pp=4, got 2",
    )
    validate_config(make(parallel__pp=4, train__microbatches=1, parallel__schedule="gpipe"), 8)


def test_interleaving_needs_microbatches_divisible_by_pp() -> None:
    invalid(
        make(parallel__schedule="interleaved-1f1b", train__microbatches=3),
        "parallel.schedule=interleaved-1f1b needs train.microbatches divisible by parallel.pp=2, got 3 " "(3 % 2 = 1)",
    )


# ---- validate: batch split ----------------------------------------------------------------------------------------


def test_every_replica_needs_a_sample() -> None:
    invalid(make(train__global_batch=1, parallel__dp=2), "train.global_batch=1 is smaller than parallel.dp=2")


def test_microbatches_cannot_exceed_the_replica_batch() -> None:
    invalid(
        make(train__global_batch=10, parallel__dp=2, train__microbatches=8),
        "train.microbatches=8 exceeds the 5 samples per data-parallel replica "
        "(train.global_batch=10 over parallel.dp=2)",
    )
    validate_config(make(train__global_batch=11, parallel__dp=2, train__microbatches=5), 8)  # replicas get 6 and 5


@pytest.mark.parametrize(
    ("dotted", "message"),
    [
        (
            {"train__global_batch": 11, "parallel__dp": 2, "train__microbatch_sizes": [2, 2, 1, 1]},
            "train.microbatch_sizes needs train.global_batch=11 divisible by parallel.dp=2",
        ),
        ({"train__microbatch_sizes": [8, 4, 4]}, "train.microbatch_sizes has 3 entries but train.microbatches=4"),
        ({"train__microbatch_sizes": [8, 4, 4, 0]}, "train.microbatch_sizes[3]=0 must be a positive integer"),
        (
            {"train__microbatch_sizes": [4, 4, 4, 3]},
            "train.microbatch_sizes sums to 15, but each data-parallel replica has 16 samples "
            "(train.global_batch=16 over parallel.dp=1)",
        ),
    ],
)
def test_explicit_microbatch_sizes(dotted: dict[str, Any], message: str) -> None:
    invalid(make(**dotted), message)


def test_unequal_microbatch_sizes_are_allowed() -> None:
    validate_config(make(train__microbatch_sizes=[7, 5, 3, 1]), 4)
    validate_config(make(parallel__dp=2, train__microbatch_sizes=[3, 2, 2, 1]), 8)


# ---- validate: partition ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dotted", "message"),
    [
        ({"parallel__partition": "cost"}, "parallel.partition='cost' needs parallel.layer_costs"),
        (
            {"parallel__partition": "cost", "parallel__layer_costs": [1.0, 1.0, 1.0]},
            "parallel.layer_costs has 3 entries but model.n_layers=4",
        ),
        (
            {"parallel__partition": "cost", "parallel__layer_costs": [1.0, 0.0, 1.0, 1.0]},
            "parallel.layer_costs[1]=0.0 must be > 0",
        ),
        (
            {"parallel__layer_costs": [1.0, 1.0, 1.0, 1.0]},
            "parallel.layer_costs is set but parallel.partition='params': set parallel.partition=\"cost\"",
        ),
    ],
)
def test_cost_partition_rules(dotted: dict[str, Any], message: str) -> None:
    invalid(make(**dotted), message)


def test_cost_partition_with_costs_validates() -> None:
    validate_config(make(parallel__partition="cost", parallel__layer_costs=[3.0, 3.0, 2.0, 2.0]), 4)


# ---- to_dict / from_dict ------------------------------------------------------------------------------------------


def custom() -> Config:
    cfg = make(
        model__n_kv_heads=2,
        model__tie_embeddings=True,
        parallel__partition="cost",
        parallel__layer_costs=[3.0, 3.0, 2.0, 2.0],
        train__microbatch_sizes=[7, 5, 3, 1],
        train__lr=1e-3,
        data__path="corpus.txt",
    )
    cfg.run_dir = "runs/custom"
    return cfg


def test_dict_round_trip_through_json() -> None:
    cfg = custom()
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["parallel"]["layer_costs"] == [3.0, 3.0, 2.0, 2.0]
    assert d["run_dir"] == "runs/custom"
    back = Config.from_dict(d)
    assert back == cfg
    assert back != Config()


def test_to_dict_is_a_copy() -> None:
    cfg = custom()
    cfg.to_dict()["parallel"]["layer_costs"].append(9.0)
    assert cfg.parallel.layer_costs == [3.0, 3.0, 2.0, 2.0]


def test_from_dict_partial_keeps_defaults() -> None:
    cfg = Config.from_dict({"parallel": {"tp": 1}, "run_dir": "x"})
    assert cfg.parallel.tp == 1 and cfg.parallel.pp == 2 and cfg.run_dir == "x"
    assert Config.from_dict({}) == Config()


def test_from_dict_unknown_key_suggests() -> None:
    with pytest.raises(ValueError, match=re.escape("unknown config key 'parallel.tpp' (did you mean 'parallel.tp'?)")):
        Config.from_dict({"parallel": {"tpp": 4}})
    with pytest.raises(ValueError, match=re.escape("unknown config key 'paralel' (did you mean 'parallel'?)")):
        Config.from_dict({"paralel": {"tp": 4}})
    with pytest.raises(ValueError, match=re.escape("unknown config key 'rundir' (did you mean 'run_dir'?)")):
        Config.from_dict({"rundir": "x"})


def test_from_dict_section_must_be_a_table() -> None:
    with pytest.raises(ValueError, match="config section 'model' must be a table"):
        Config.from_dict({"model": 3})
    with pytest.raises(ValueError, match="config must be a dict"):
        Config.from_dict([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("d", "message"),
    [
        ({"parallel": {"tp": 2.5}}, "config key 'parallel.tp' expects int, got 2.5 (float)"),
        ({"parallel": {"tp": "x"}}, "config key 'parallel.tp' expects int, got 'x' (str)"),
        ({"parallel": {"tp": True}}, "config key 'parallel.tp' expects int, got True (bool)"),
        ({"parallel": {"tp": None}}, "config key 'parallel.tp' expects int, got None"),
        ({"model": {"tie_embeddings": 1}}, "config key 'model.tie_embeddings' expects bool or none, got 1 (int)"),
        ({"train": {"lr": "0.1"}}, "config key 'train.lr' expects float, got '0.1' (str)"),
        ({"parallel": {"layer_costs": "1,2"}}, "config key 'parallel.layer_costs' expects list[float] or none"),
        ({"train": {"microbatch_sizes": [1, 2.0]}}, "config key 'train.microbatch_sizes[1]' expects int, got 2.0"),
        ({"run_dir": 5}, "config key 'run_dir' expects str, got 5 (int)"),
    ],
)
def test_from_dict_is_type_strict(d: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Config.from_dict(d)


def test_from_dict_widens_ints_to_floats_and_accepts_none() -> None:
    cfg = Config.from_dict(
        {
            "train": {"lr": 1},
            "parallel": {"layer_costs": [1, 2.5]},
            "model": {"n_kv_heads": None},
            "data": {"path": None},
        }
    )
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float
    assert cfg.parallel.layer_costs == [1.0, 2.5] and all(type(c) is float for c in cfg.parallel.layer_costs)
    assert cfg.model.n_kv_heads is None and cfg.data.path is None


# ---- TOML -----------------------------------------------------------------------------------------------------------

TOML = """
run_dir = "runs/toml"

[model]
n_layers = 8
n_kv_heads = 2
tie_embeddings = true

[parallel]
tp = 1
pp = 4
partition = "cost"
layer_costs = [3, 3, 2, 2, 1, 1, 1, 1]

[train]
lr = 1e-3
microbatch_sizes = [4, 4, 4, 4]
sample_prompt = "import "

[data]
path = "corpus.bin"
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_toml_file_loads_into_config(tmp_path: Path) -> None:
    cfg = Config.from_dict(load_toml(write(tmp_path, TOML)))
    assert cfg.run_dir == "runs/toml"
    assert (cfg.model.n_layers, cfg.model.n_kv_heads, cfg.model.tie_embeddings) == (8, 2, True)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.partition) == (1, 4, "cost")
    assert cfg.parallel.layer_costs == [3.0, 3.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    assert cfg.train.lr == 1e-3 and cfg.train.microbatch_sizes == [4, 4, 4, 4]
    assert cfg.train.sample_prompt == "import " and cfg.data.path == "corpus.bin"
    validate_config(cfg, world_size=4)


def test_toml_missing_and_malformed_files_name_the_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ValueError, match=re.escape(repr(missing))):
        load_toml(missing)
    bad = write(tmp_path, "[model\nn_layers = 2\n")
    with pytest.raises(ValueError, match=re.escape(f"config file {bad!r} is not valid TOML")):
        load_toml(bad)


def test_toml_unknown_key_is_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "[train]\nglobal_bach = 8\n")
    with pytest.raises(ValueError, match=re.escape("did you mean 'train.global_batch'?")):
        parse_args(["--config", path])


# ---- parse_args -----------------------------------------------------------------------------------------------------


def test_no_arguments_gives_defaults() -> None:
    assert parse_args([]) == Config()


def test_overrides_apply_after_the_file_in_order(tmp_path: Path) -> None:
    path = write(tmp_path, TOML)
    # The override comes before --config on the command line but must still win over the file.
    cfg = parse_args(["--parallel.pp=2", "--config", path, "--train.lr", "0.01", "--train.lr", "0.02"])
    assert cfg.parallel.pp == 2  # override beat the file's 4
    assert cfg.parallel.tp == 1 and cfg.model.n_layers == 8  # the rest of the file still applies
    assert cfg.train.lr == 0.02  # the later override wins


def test_config_given_twice_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, TOML)
    with pytest.raises(ValueError, match="--config given twice"):
        parse_args(["--config", path, f"--config={path}"])


def test_run_dir_and_hyphenated_keys() -> None:
    cfg = parse_args(["--run-dir", "out/a", "--train.global-batch", "8", "--parallel.virtual-stages=2"])
    assert cfg.run_dir == "out/a" and cfg.train.global_batch == 8 and cfg.parallel.virtual_stages == 2
    assert parse_args(["--run_dir=out/b"]).run_dir == "out/b"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("True", True), ("1", True), ("YES", True), ("false", False), ("0", False), ("No", False)],
)
def test_bool_parsing(text: str, expected: bool) -> None:
    default_flip = make(model__tie_embeddings=not expected)
    assert default_flip.model.tie_embeddings is not expected
    assert parse_args(["--model.tie_embeddings", text]).model.tie_embeddings is expected


def test_list_parsing() -> None:
    cfg = parse_args(["--parallel.layer_costs", "3,3,2,2", "--train.microbatch_sizes=7, 5,3,1"])
    assert cfg.parallel.layer_costs == [3.0, 3.0, 2.0, 2.0]
    assert cfg.train.microbatch_sizes == [7, 5, 3, 1]


@pytest.mark.parametrize("word", ["none", "null", "None", "NULL"])
def test_optional_fields_accept_none(word: str) -> None:
    cfg = parse_args(
        [
            "--model.n_kv_heads",
            "2",
            "--model.n_kv_heads",
            word,
            "--data.path",
            "x.txt",
            "--data.path",
            word,
            "--parallel.layer_costs",
            "1,2",
            "--parallel.layer_costs",
            word,
        ]
    )
    assert cfg.model.n_kv_heads is None and cfg.data.path is None and cfg.parallel.layer_costs is None


def test_scalar_parsing() -> None:
    cfg = parse_args(
        [
            "--train.lr",
            "1e-3",
            "--train.seed",
            "-1",
            "--train.sample_prompt=a = b",
            "--data.max_tokens",
            "1_000",
            "--parallel.schedule",
            "gpipe",
            "--model.n_kv_heads",
            "2",
        ]
    )
    assert cfg.train.lr == 1e-3 and cfg.train.seed == -1 and cfg.train.sample_prompt == "a = b"
    assert cfg.data.max_tokens == 1000 and cfg.parallel.schedule == "gpipe" and cfg.model.n_kv_heads == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--train.steps", "2.5"], "--train.steps expects int, got '2.5'"),
        (["--train.lr", "fast"], "--train.lr expects float, got 'fast'"),
        (["--model.tie_embeddings", "maybe"], "--model.tie_embeddings expects bool or none, got 'maybe'"),
        (["--train.microbatch_sizes", "4,x"], "--train.microbatch_sizes expects list[int] or none, got '4,x'"),
        (["--train.steps", "none"], "--train.steps expects int, got 'none'"),
    ],
)
def test_bad_values_name_the_flag_and_type(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_args(argv)


@pytest.mark.parametrize(
    ("flag", "suggestion"),
    [
        ("--parallel.tpp", "--parallel.tp"),
        ("--train.global_bach", "--train.global_batch"),
        ("--confg", "--config"),
        ("--run-dri", "--run-dir"),
    ],
)
def test_unknown_flag_suggests(flag: str, suggestion: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"unknown option {flag} (did you mean {suggestion}?)")):
        parse_args([flag, "1"])


def test_section_name_alone_is_not_a_flag() -> None:
    with pytest.raises(ValueError, match="unknown option --model"):
        parse_args(["--model", "1"])


@pytest.mark.parametrize("argv", [["--train.steps"], ["--train.steps", "--train.lr", "1"], ["--config"]])
def test_missing_value(argv: list[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"missing value for {argv[0]}")):
        parse_args(argv)


def test_positional_argument_is_rejected() -> None:
    with pytest.raises(ValueError, match="unexpected argument 'train.steps'"):
        parse_args(["train.steps", "3"])


def test_missing_config_file_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope.toml"):
        parse_args(["--config", str(tmp_path / "nope.toml")])


def test_parse_args_does_not_validate() -> None:
    cfg = parse_args(["--train.seq_len", "0"])
    assert cfg.train.seq_len == 0
    with pytest.raises(ValueError, match="train.seq_len must be a positive integer, got 0"):
        validate_config(cfg)


# ---- help ---------------------------------------------------------------------------------------------------------


def test_help_lists_every_flag_with_type_and_default() -> None:
    text = help_text()
    for section, values in Config().to_dict().items():
        if isinstance(values, dict):
            assert f"[{section}]" in text
            for key in values:
                assert f"--{section}.{key} <" in text
    assert "--config <file>" in text and "--run-dir <str>" in text
    line = next(ln for ln in text.splitlines() if "--parallel.schedule" in ln)
    # The names are the schedule registry's, above config/: `hybridpar train --help` lists them after
    # the flags (tests/test_cli.py).
    assert "<str>" in line and "default: '1f1b'" in line and "hybridpar/pipeline/schedules/registry.py" in line
    line = next(ln for ln in text.splitlines() if "--model.n_kv_heads" in ln)
    assert "<int or none>" in line and "default: none" in line and "grouped-query" in line
    line = next(ln for ln in text.splitlines() if "--parallel.layer_costs" in ln)
    assert "<list[float] or none>" in line


# ---- validate: microbatch policy ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dotted", "message"),
    [
        (
            {"batching__policy": "adaptiv"},
            "batching.policy='adaptiv' is not one of fixed, adaptive (did you mean 'adaptive'?)",
        ),
        (
            {"batching__memory_budget": 0.0},
            "batching.memory_budget must be > 0 (bytes if > 1, a fraction of device "
            "memory if <= 1) or none, got 0.0",
        ),
        (
            {"batching__memory_budget": 1e9},
            "batching.memory_budget=1000000000.0 is used by batching.policy=adaptive only",
        ),
        (
            {"batching__policy": "adaptive", "train__microbatch_sizes": [4, 4, 4, 4]},
            "train.microbatch_sizes fixes the split, but batching.policy=adaptive chooses it: drop one of them",
        ),
        ({"batching__microbatch_size": 0}, "batching.microbatch_size must be a positive integer or none, got 0"),
        ({"batching__microbatch_size": 4, "batching__policy": "adaptive"}, "batching.microbatch_size is a fixed split"),
        (
            {"batching__microbatch_size": 16},
            "batching.microbatch_size=16 cuts the 16 samples per replica "
            "(train.global_batch=16 over parallel.dp=1) into 1 microbatches; "
            "parallel.schedule=1f1b needs ≥ parallel.pp=2: use a size ≤ 8",
        ),
        (
            {"batching__microbatch_size": 1, "parallel__dp": 3, "parallel__tp": 1, "parallel__pp": 1},
            "into 6 microbatches, more than the smallest replica's 5 samples",
        ),
        (
            {"batching__microbatch_size": 6, "parallel__schedule": "interleaved-1f1b", "parallel__virtual_stages": 2},
            "into 3 microbatches; parallel.schedule=interleaved-1f1b needs a multiple of parallel.pp=2",
        ),
        ({"batching__steps_per_candidate": 0}, "batching.steps_per_candidate must be a positive integer, got 0"),
        ({"batching__switch_margin": 1.0}, "batching.switch_margin must be in [0, 1), got 1.0"),
        ({"batching__drift_margin": 0.0}, "batching.drift_margin must be in (0, 1), got 0.0"),
        ({"emulate__memory_limit": -5}, "emulate.memory_limit must be a positive integer or none, got -5"),
    ],
)
def test_batching_rules(dotted: dict[str, Any], message: str) -> None:
    invalid(make(**dotted), message)


def test_microbatch_size_gives_the_count() -> None:
    cfg = make(batching__microbatch_size=3)  # 16 samples by at most 3: 6 microbatches
    validate_config(cfg, 4)
    assert cfg.microbatch_count() == 6
    assert make(batching__policy="adaptive", batching__memory_budget=0.5).microbatch_count() is None
