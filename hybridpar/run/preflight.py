"""The one pre-flight check of a training run, used by `hybridpar train` and `hybridpar.launch` before
any worker starts, and by every worker before it joins the process group (so plain torchrun gets it too).

Everything that would otherwise fail inside the workers, and fail the same way after every restart, is
found here and raised as one ValueError naming the key, the value and what would be right: the config
and its layout for the world size (`validate_config`: Config.validate, then the rules that ask the
schedule registry, which config/ sits below; with the elastic re-plan of a resumed run: the planner's
under parallel.auto, plan/launch.py), the emulation specs, the
corpus (missing, empty, too short for one window, an odd-length or out-of-vocabulary `.bin`), the run
and checkpoint directories (a file where a directory belongs), what a resume would load (a path that
is no hybridpar checkpoint, such as a Hugging Face model directory, or a checkpoint of another model) and
what model.init_from would load (config.json fields the model does not implement, a truncated
safetensors file, a missing tensor or one of another shape).
Nothing here writes: a run directory is created only once the launcher claims it (resilience/rundir.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

from hybridpar.config import Config
from hybridpar.config.keys import _known_keys, _owner
from hybridpar.pipeline.schedules.config_rules import validate_config
from hybridpar.report.sinks import missing_packages
from hybridpar.run.data_checks import check_corpus, check_tokens, use_init_tokenizer


def checkpoint_dir(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run_dir) / "checkpoints"


def preflight(
    cfg: Config, world: int | None, restart_count: int = 0, *, verify: bool = True, local_ranks: int | None = None
) -> tuple[Config, list[str]]:
    """The config a worker runs on `world` processes after `restart_count` restarts (re-planned if a
    resume changes the world size), and lines to print; ValueError for anything that cannot run.
    `world` None (unknown until the rendezvous, e.g. --nproc-per-node auto) checks the layout without it.
    `verify` False skips the checks a worker repeats anyway (reading the corpus, which the Trainer loads
    with the same errors; hashing a named checkpoint, which rank 0 verifies on resume). `local_ranks`: the
    processes this node starts, where known (NCCL needs a GPU for each)."""
    from hybridpar.emulate.faults import parse_faults
    from hybridpar.emulate.profiles import SHAPES, parse_shaped
    from hybridpar.emulate.slow_link import parse_slow_link
    from hybridpar.emulate.slowdown import SlowdownPlan
    from hybridpar.resilience.elastic import layout_for_world

    preflight_config(cfg)
    notes: list[str] = []
    if world is None:
        validate_config(cfg)
    else:
        if cfg.parallel.auto:  # the launch planned the layout; a re-plan asks the planner again
            from hybridpar.plan.launch import replan_with_planner

            cfg, note = layout_for_world(cfg, world, restart_count, replan_with_planner)
        else:
            cfg, note = layout_for_world(cfg, world, restart_count)
        validate_config(cfg, world_size=world)
        notes += [note] if note else []
        SlowdownPlan.from_config(cfg.emulate.slowdown, world)
        for shape in SHAPES:
            parse_shaped(shape, getattr(cfg.emulate, shape), world)
        parse_slow_link(cfg.emulate.slow_link, cfg.parallel.pp)
        parse_faults(cfg.emulate.fault, world)
    _check_dirs(cfg)
    check_tokens(cfg)
    _check_device(cfg, local_ranks)
    if (why := missing_packages(cfg.sinks)) is not None:
        raise ValueError(why)
    if verify:
        notes += check_corpus(cfg)
        _check_init_weights(cfg)
    notes += _check_resume(cfg, verify)
    return cfg, notes


def preflight_config(cfg: Config) -> None:
    """The checks that need neither the world size nor any file but model.init_from's config.json (the
    first, fastest part of `preflight`). Fills in the model's shape from that config.json."""
    resolve_init_from(cfg)
    _check_finite(cfg)
    validate_config(cfg)


def resolve_init_from(cfg: Config) -> None:
    """With model.init_from, set the model's shape (every model key but init_from and init_std) from the
    directory's config.json, in place. A model key set to other than its default and than config.json
    says is refused: the shape is the checkpoint's. data.tokenizer left unset becomes the directory where
    it holds a tokenizer (data_checks.use_init_tokenizer)."""
    path = cfg.model.init_from
    if path is None:
        return
    from hybridpar.config import ModelConfig
    from hybridpar.model.registry import read_hf_config

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"model.init_from={path!r} is not a Hugging Face model directory: it has no config.json")
    hf, default = read_hf_config(path), ModelConfig()
    keys = [f.name for f in fields(ModelConfig) if f.name not in ("init_from", "init_std")]
    if clash := [
        f"model.{k}={getattr(cfg.model, k)!r} (config.json: {getattr(hf, k)!r})"
        for k in keys
        if getattr(cfg.model, k) not in (getattr(default, k), getattr(hf, k))
    ]:
        raise ValueError(
            f"model.init_from={path!r} gives the model's shape, which {', '.join(clash)} contradicts: leave "
            f"{'it' if len(clash) == 1 else 'them'} unset"
        )
    for k in keys:
        setattr(cfg.model, k, getattr(hf, k))
    use_init_tokenizer(cfg)


def _check_init_weights(cfg: Config) -> None:
    """model.init_from's tensors: every file readable (not truncated), every tensor there in its shape."""
    if cfg.model.init_from is None:
        return
    from hybridpar.model.hf import SafetensorsDir
    from hybridpar.model.registry import check_hf_tensors

    try:
        check_hf_tensors(cfg.model, SafetensorsDir(cfg.model.init_from))
    except ValueError as e:
        raise ValueError(f"model.init_from={cfg.model.init_from!r}: {e}") from None


def _check_device(cfg: Config, local_ranks: int | None = None) -> None:
    """What needs CUDA, refused where the run will not get it (the backend is chosen as the workers will);
    NCCL ranks beyond this node's GPUs (NCCL takes one GPU per rank), refused before any process starts."""
    import torch

    from hybridpar.topology.mesh import pick_backend

    _, device = pick_backend(cfg.parallel.backend)
    if cfg.profile.memory and device != "cuda":
        raise ValueError(
            "profile.memory snapshots the CUDA caching allocator, and this run is on CPU (no CUDA here, or "
            "parallel.backend=gloo): drop --profile.memory (the activation meter's figures are in metrics.jsonl)"
        )
    if device == "cuda" and local_ranks is not None and local_ranks > (gpus := torch.cuda.device_count()):
        raise ValueError(
            f"{local_ranks} ranks on this node over NCCL need {local_ranks} GPUs, one each, and it has {gpus}: "
            f"use a layout of at most {gpus} rank{'s' if gpus != 1 else ''} per node (tp x pp x dp; e.g. "
            "--parallel.tp 1 --parallel.pp 1 on one GPU), or --parallel.backend gloo to run on the CPU"
        )


def _check_finite(cfg: Config) -> None:
    # Validation compares numbers (lr > 0), which inf passes: a float key must be finite to mean anything.
    for key in _known_keys(Config):
        v = getattr(*_owner(cfg, key))
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{key} must be a finite number, got {v!r}")


def _check_dirs(cfg: Config) -> None:
    from hybridpar.resilience.rundir import check_path_is_dir, read_run

    check_path_is_dir("run_dir", Path(cfg.run_dir))
    check_path_is_dir("checkpoint.dir", checkpoint_dir(cfg))
    read_run(Path(cfg.run_dir))  # a damaged run record is refused here, not in every worker


def _saved_state(ckpt: Path) -> dict | None:
    try:
        state = json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))
        return state if isinstance(state["config"]["model"], dict) else None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return None  # unreadable: resume skips or refuses it itself, with the reason


# The keys a step's samples are a function of (data/corpus.py, data/mixture.py: windows of train.seq_len
# tokens of the corpus, shuffled by train.seed, train.global_batch of them per step).
DATA_ORDER_KEYS = (
    ("train", "seed"),
    ("train", "global_batch"),
    ("train", "seq_len"),
    ("data", "path"),
    ("data", "max_tokens"),
    ("data", "val_fraction"),
)


def data_order_note(cfg: Config, state: dict) -> str | None:
    """The line a resume prints where the run reads its samples otherwise than the checkpoint's run did:
    the steps from the checkpoint on then read other samples than that run would have, and the sample
    ledger, kept by steps, cannot show it. Not refused: a longer train.seq_len or another corpus from a
    checkpoint is a choice (context extension, a new data phase), but it should not pass unseen."""
    saved = state.get("config", {})
    changed = [
        f"{sec}.{key}={getattr(getattr(cfg, sec), key)!r} (checkpoint: {saved[sec][key]!r})"
        for sec, key in DATA_ORDER_KEYS
        if key in saved.get(sec, {}) and saved[sec][key] != getattr(getattr(cfg, sec), key)
    ]
    if not changed:
        return None
    return (
        f"hybridpar: note: {', '.join(changed)}: a step's samples depend on {'these' if len(changed) > 1 else 'it'}, "
        f"so from step {state.get('step')} on the run reads other samples than the checkpoint's run would have "
        "(some it saw may come again, some never), which the sample ledger, kept by steps, does not show; "
        "resume with the checkpoint's values to continue its data order"
    )


def _check_not_a_run(which: str, path: Path) -> None:
    """A run directory, or its checkpoints/ folder, given where one checkpoint is asked for: name the
    newest checkpoint in it, and --resume auto, instead of its missing manifest.json."""
    from hybridpar.resilience.commits import committed

    if (path / "manifest.json").exists():
        return
    for what, folder in (("a run directory", path / "checkpoints"), ("a folder of checkpoints", path)):
        if found := committed(folder):
            run_dir = path if folder != path else path.parent
            raise ValueError(
                f"checkpoint.resume={which!r} is {what}, not one checkpoint: give one (the newest is "
                f"{found[0][1]}), or --resume auto --run-dir {run_dir} for the newest that verifies"
            )


def _check_resume(cfg: Config, verify: bool) -> list[str]:
    """A resume that cannot load is refused; one that reads its samples otherwise gets a note."""
    from hybridpar.resilience.commits import committed, verify_checkpoint
    from hybridpar.resilience.rundir import checkpoint_run_id, read_run

    which = cfg.checkpoint.resume
    if which == "off":
        return []
    if which == "auto":
        run = read_run(Path(cfg.run_dir))
        mine = [p for _, p in committed(checkpoint_dir(cfg)) if run and checkpoint_run_id(p) == run["run_id"]]
        candidates = [p for p in mine if _saved_state(p) is not None][:1]  # the one 'auto' would try first
    else:
        path = Path(which)
        if (path / "config.json").is_file() and not (path / "manifest.json").exists():
            raise ValueError(
                f"checkpoint.resume={which!r} is a Hugging Face model directory, not a hybridpar "
                f"checkpoint (a step-NNNNNN directory with manifest.json): resume takes checkpoints "
                f"written by hybridpar train"
            )
        _check_not_a_run(which, path)
        if verify and (why := verify_checkpoint(path)) is not None:
            raise ValueError(f"checkpoint.resume={which!r} cannot be used: {why}")
        candidates = [path]
    notes = []
    for ckpt in candidates:
        state = _saved_state(ckpt)
        saved = None if state is None else state["config"]["model"]
        if diff := ["its trainer_state.json records none"] if saved is None else cfg.model.differences(saved):
            raise ValueError(
                f"checkpoint {ckpt} holds another model: {', '.join(diff)}; resume with the model it "
                f"was trained with, or start a new run (another --run-dir)"
            )
        if state is not None and (note := data_order_note(cfg, state)):
            notes.append(note)
    return notes
