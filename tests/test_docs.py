"""The documentation stays true: every command of the README's code blocks parses with the parser the
real command uses (nothing is launched), every repository path the README and docs/ name exists, and
docs/configuration.md is what the config's help texts render."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hybridpar.config import parse_args
from hybridpar.config.reference_doc import COMMAND, render
from hybridpar.pipeline.schedules.config_rules import validate_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# ---- the README's commands ----


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def commands(block: str) -> list[list[str]]:
    """The block's commands as argument lists: comments dropped, `\\` continuations and quoted newlines
    joined, `&&` split, a trailing `&` removed."""
    out: list[list[str]] = []
    pending = ""
    for line in block.splitlines():
        pending += line + "\n"
        if pending.rstrip().endswith("\\"):
            pending = pending.rstrip()[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        cmd: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", "&"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    assert not pending.strip(), f"unterminated command: {pending!r}"
    return out


def check_hybridpar(args: list[str]) -> None:
    """Parse `hybridpar SUB ARGS` the way cli.main hands it to each command, without running it."""
    sub, rest = args[0], args[1:]
    if "--help" in rest or "-h" in rest:
        assert sub in ("train", "serve", "export", "data", "report", "plan", "bench"), sub
        return
    if sub == "train":
        from hybridpar.cli import split_argv

        theirs, ours = split_argv(rest)
        cfg = parse_args(ours)
        if cfg.model.init_from is None:  # else the shape is the model directory's, read at launch
            nproc = next((int(v) for k, v in zip(theirs, theirs[1:]) if k == "--nproc-per-node"), None)
            validate_config(cfg, nproc or cfg.parallel.world_size)
    elif sub == "serve":
        from hybridpar.serve.config import parse_serve_args

        serve_cfg, model = parse_serve_args(rest)
        serve_cfg.validate(model)
    elif sub == "data":
        from hybridpar.data.prepare import parse_data_args

        parse_data_args(rest)
    elif sub == "export":
        from hybridpar.cli import parse_export_args

        parse_export_args(rest)
    elif sub == "report":
        from hybridpar.report.page import parser

        parser().parse(rest)
    else:
        raise AssertionError(f"no check for `hybridpar {sub}` yet: add one to tests/test_docs.py")


def check_request(path: str, body: dict[str, Any]) -> None:
    """A request body of the README as the server's own validation reads it."""
    from hybridpar.serve.api import parse_completion
    from hybridpar.serve.chat import parse_chat
    from hybridpar.serve.config import ServeConfig
    from hybridpar.serve.http import ROUTES

    assert path in ROUTES and "POST" in ROUTES[path], f"the server has no POST {path}"
    raw, name = json.dumps(body).encode(), ServeConfig().model_name
    tokenize = lambda p: list(p.encode()) if isinstance(p, str) else p  # noqa: E731  (bytes, as a 256-id model)
    if path == "/v1/chat/completions":
        parse_chat(raw, name, 1024, lambda msgs: "".join(m["content"] for m in msgs), tokenize)
    else:
        parse_completion(raw, name, 1024, 256, tokenize)


def check_curl(args: list[str]) -> None:
    url = next(a for a in args if a.startswith("http"))
    data = next((v for k, v in zip(args, args[1:]) if k in ("-d", "--data")), None)
    path = re.sub(r"^https?://[^/]+", "", url)
    if data is None:
        from hybridpar.serve.http import ROUTES

        assert "GET" in ROUTES.get(path, ()), f"the server has no GET {path}"
    else:
        check_request(path, json.loads(data))


def check_python(args: list[str]) -> None:
    """`python -c CODE` with the openai client: it compiles, talks to /v1, and each call it makes is a
    route the server has, with a body the server accepts."""
    if args[:2] == ["-m", "pytest"]:
        return
    assert args[0] == "-c", args
    code = args[1]
    compile(code, "<README>", "exec")
    assert re.search(r'base_url="http://127\.0\.0\.1:\d+/v1"', code), code
    for kind, call in re.findall(r"\.(chat\.completions|completions)\.create\(([^()]*(?:\([^()]*\)[^()]*)*)\)", code):
        body = eval(f"dict({call})")  # the keyword arguments are literals: model=..., messages=[...]
        check_request("/v1/chat/completions" if kind.startswith("chat") else "/v1/completions", body)


def check_command(cmd: list[str]) -> None:
    prog = cmd[0]
    if prog.endswith("/hybridpar"):
        check_hybridpar(cmd[1:])
    elif prog == "curl":
        check_curl(cmd[1:])
    elif prog.endswith("/python"):
        check_python(cmd[1:])
    elif prog.endswith("/pip"):
        extra = re.fullmatch(r"\.\[(\w+)\]", cmd[-1])
        assert cmd[1:3] == ["install", "-e"] and extra, cmd
        if sys.version_info >= (3, 11):
            import tomllib

            extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
            assert extra.group(1) in extras, f"pyproject.toml has no extra {extra.group(1)!r}"
    elif prog.endswith("/hf"):  # huggingface_hub's CLI: its own parser is not ours to run here
        assert cmd[1] == "download" and "--local-dir" in cmd, cmd
    elif prog == "bash":
        assert (ROOT / cmd[1]).is_file(), cmd
    else:
        raise AssertionError(f"no check for {prog!r}: add one to tests/test_docs.py")


README_COMMANDS = [c for block in bash_blocks((ROOT / "README.md").read_text()) for c in commands(block)]


@pytest.mark.parametrize("cmd", README_COMMANDS, ids=lambda c: " ".join(c)[:60])
def test_readme_commands_parse(cmd: list[str]) -> None:
    check_command(cmd)


def test_readme_quickstart_is_short() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250 and "bench/results" not in text
    blocks = bash_blocks(text)
    assert blocks[0].splitlines() == [
        "bash scripts/setup.sh && .venv/bin/hybridpar train",
        "bash scripts/setup.sh test && .venv/bin/python -m pytest",
    ]
    quickstart = bash_blocks(text.split("## Quickstart", 1)[1].split("\n## ", 1)[0])
    assert len(quickstart) == 5 and all(len(b.splitlines()) <= 6 for b in quickstart)


def doc_commands(doc: Path) -> list[list[str]]:
    """The commands of a docs page: its bash blocks, and its unlabelled blocks of `hybridpar` lines."""
    text = doc.read_text(encoding="utf-8")
    plain = [b for b in re.findall(r"^```\n(.*?)^```", text, re.S | re.M) if b.startswith(("hybridpar ", ".venv/"))]
    return [c for block in [*bash_blocks(text), *plain] for c in commands(block)]


def check_doc_command(cmd: list[str]) -> None:
    """A docs page's command names a program, subcommand, benchmark or script that exists, with options it
    takes and values they accept. Unlike a README command's, its layout is checked on its own world size,
    not on --nproc-per-node's (a page shows a resume on fewer processes), and a placeholder config file
    (`--config my_run.toml`) is the reader's to write."""
    from hybridpar.bench import BENCHES

    prog, rest = cmd[0].removeprefix(".venv/bin/"), cmd[1:]
    if prog == "python" and rest[:1] == ["-m"] and rest[1].startswith("hybridpar.bench."):
        assert rest[1].removeprefix("hybridpar.bench.") in BENCHES, f"no benchmark {rest[1]}"
    elif prog != "hybridpar" or rest[0] in ("serve", "data", "export", "report") or "--help" in rest:
        check_command(cmd)
    elif rest[0] == "bench":
        assert rest[1] in BENCHES, f"no benchmark {rest[1]!r}"
    elif rest[0] == "plan":
        from hybridpar.plan.main import _parser

        parse_args(_parser().parse_known_args(rest[1:])[1])
    else:
        from hybridpar.cli import split_argv

        assert rest[0] == "train", cmd
        ours = split_argv(rest[1:])[1]
        at = ours.index("--config") if "--config" in ours else None
        if at is not None and not (ROOT / ours[at + 1]).exists():
            del ours[at : at + 2]
        validate_config(parse_args(ours))  # the values, and the layout on its own world size


DOC_COMMANDS = [(doc, c) for doc in DOCS[1:] for c in doc_commands(doc) if not re.match(r"for |\w+=", " ".join(c))]


@pytest.mark.parametrize("doc,cmd", DOC_COMMANDS, ids=lambda x: x.name if isinstance(x, Path) else " ".join(x)[:50])
def test_docs_commands_name_what_exists(doc: Path, cmd: list[str]) -> None:
    check_doc_command(cmd)


@pytest.mark.parametrize(
    "cmd",
    [
        ".venv/bin/hybridpar train --parallel.schedule zbv",
        "hybridpar train --train.microbatch 8",
        "hybridpar plan --hardware docs/hardware/dgx-h100.toml --model.n_layer 32",
        ".venv/bin/hybridpar bench compiled --json x.json",
        ".venv/bin/python -m hybridpar.bench.pipelines --pp 4",
    ],
)
def test_a_wrong_docs_command_is_caught(cmd: str) -> None:
    (parsed,) = commands(cmd)
    with pytest.raises((ValueError, AssertionError, SystemExit)):
        check_doc_command(parsed)


@pytest.mark.parametrize(
    "cmd",
    [
        ".venv/bin/hybridpar train --train.lr",  # a missing value
        ".venv/bin/hybridpar train --train.learning_rate 1e-5",  # a key that does not exist
        ".venv/bin/hybridpar train --parallel.tp 3",  # 3 does not divide the 4 heads
        ".venv/bin/hybridpar serve --source runs/latest --tensor-parallel 2",
        ".venv/bin/hybridpar data prepare --out x.bin",  # no --tokenizer
        ".venv/bin/hybridpar export runs/latest --step last --out x",
        'curl -s http://127.0.0.1:8000/v1/complete -d \'{"model": "hybridpar", "prompt": "x"}\'',
        'curl -s http://127.0.0.1:8000/v1/completions -d \'{"model": "gpt-4", "prompt": "x"}\'',
        '.venv/bin/python -c \'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1")\n'
        'c.chat.completions.create(model="hybridpar", messages=[])\'',
    ],
)
def test_a_wrong_command_is_caught(cmd: str) -> None:
    from hybridpar.serve.api import ApiError

    (parsed,) = commands(cmd)
    with pytest.raises((ValueError, AssertionError, SystemExit, ApiError)):
        check_command(parsed)


# ---- paths ----


def _top_entries() -> set[str]:
    """The repository's top-level entries: what git tracks, so that a user's `runs/` or `data/` (ignored,
    made by the README's own commands) does not make the docs' example paths look like missing files."""
    try:
        tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):  # no git: an unpacked copy holds no runs of its own
        return {p.name for p in ROOT.iterdir() if not p.name.startswith(".git")}
    return {line.split("/")[0] for line in tracked.stdout.splitlines()}


TOP = _top_entries()
PACKAGE = {p.name for p in (ROOT / "hybridpar").iterdir()}
SKIP = re.compile(r"[<>*{}$ ]|\.\.\.|…|^/")


def named_paths(doc: Path) -> list[str]:
    """Repository paths a page names: backticked words that begin with a top-level entry of the
    repository or of the package (`serve/main.py` is hybridpar/serve/main.py), bare `name.py`, and the
    targets of relative markdown links."""
    text = doc.read_text(encoding="utf-8")
    found = []
    for word in re.findall(r"`([^`\n]+)`", text):
        word = word.split("::")[0].rstrip(".,;:")
        first = word.split("/")[0]
        if SKIP.search(word) or "=" in word:
            continue
        if ("/" in word and (first in TOP or first in PACKAGE)) or re.fullmatch(r"[\w.-]+\.(py|md|sh)", word):
            found.append(word)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            found.append("./" + target.split("#")[0])  # relative to the page
    return found


def exists(word: str, doc: Path) -> bool:
    if word.startswith("./"):
        rel = (doc.parent / word[2:]).resolve().relative_to(ROOT).as_posix()
        return (ROOT / rel).exists()
    if "/" not in word:  # a bare file name: somewhere in the repository
        return any(ROOT.glob(f"[!.]*/**/{word}")) or (ROOT / word).exists() or (doc.parent / word).exists()
    return any((base / word).exists() for base in (ROOT, ROOT / "hybridpar", doc.parent, ROOT / "bench/results"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_path_exists(doc: Path) -> None:
    missing = sorted({w for w in named_paths(doc) if not exists(w, doc)})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_a_missing_path_is_caught(tmp_path: Path) -> None:
    page = ROOT / "docs" / "page.md"  # not written: only its folder matters to `exists`
    assert exists("serve/main.py", page) and exists("docs/planner.md", page) and exists("./planner.md", page)
    assert not exists("serve/kvcache.py", page) and not exists("hybridpar/nowhere.py", page)
    assert not exists("./nowhere.md", page) and not exists("nowhere.py", page)


def anchors(page: Path) -> set[str]:
    """The fragments a link to `page` may name: its headings as GitHub writes their ids (lower case,
    punctuation but `-` and `_` dropped, spaces to `-`, a repeated heading numbered), code blocks skipped."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    out: set[str] = set()
    for heading in re.findall(r"^#+ +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = sum(1 for a in out if a == slug or re.fullmatch(re.escape(slug) + r"-\d+", a))
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_anchors(doc: Path) -> list[str]:
    """Relative links of `doc` whose #fragment is no heading of the page they point to."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.S | re.M)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path, _, fragment = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        if fragment and not re.match(r"[a-z]+:", target) and page.suffix == ".md" and page.is_file():
            bad += [] if fragment in anchors(page) else [target]
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_anchor_exists(doc: Path) -> None:
    bad = broken_anchors(doc)
    assert not bad, f"{doc.relative_to(ROOT)} links to headings that do not exist: {bad}"


def test_a_missing_anchor_is_caught(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "# Top\n## The cost model (`hybridpar/plan/cost.py`)\n## Notes\n## Notes\n```bash\n# not a heading\n```\n"
    )
    assert anchors(tmp_path / "a.md") == {"top", "the-cost-model-hybridparplancostpy", "notes", "notes-1"}
    links = "[a](a.md#notes-1) [b](a.md#top) [c](#here)\n# Here\n[d](a.md#not-a-heading) [e](a.md#note)"
    (tmp_path / "b.md").write_text(links)
    assert broken_anchors(tmp_path / "b.md") == ["a.md#not-a-heading", "a.md#note"]


# ---- the configuration reference ----


def test_configuration_reference_is_current() -> None:
    path = ROOT / "docs" / "configuration.md"
    assert path.read_text(encoding="utf-8") == render(), f"docs/configuration.md is stale: run {COMMAND}"
