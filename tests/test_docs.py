"""The README and docs/: a README a user reads (its size, the two commands a fresh machine needs, links that resolve),
every command and option of the CLI documented where the README leads, and no development history in the text."""

import re
from pathlib import Path

import typer

from localspec.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 350
INSTALL_AND_RUN = ('bash .ci/install-llama-cpp && pip install . && localspec run "Write a Python function that checks '
                   'whether a number is prime."')
TEST_COMMAND = "python -m pytest tests"


def readme() -> str:
    return README.read_text(encoding="utf-8")


def linked_docs() -> list[Path]:
    return sorted({(ROOT / m).resolve() for m in re.findall(r"\]\((docs/[^)#\s]+)", readme())})


def documentation() -> str:
    return "\n".join([readme()] + [p.read_text(encoding="utf-8") for p in linked_docs()])


def commands():
    """(path, click command) for every command and subcommand, from typer's own tree."""
    def walk(cmd, path):
        subs = getattr(cmd, "commands", None)
        if subs:
            yield path, cmd  # a group's own options (`localspec --version`, `localspec config --json`)
            for name, sub in subs.items():
                yield from walk(sub, path + [name])
        else:
            yield path, cmd

    return list(walk(typer.main.get_command(app), []))


def test_readme_is_short_and_starts_with_the_two_commands():
    text = readme()
    assert len(text.splitlines()) <= README_MAX_LINES
    first = text[: text.index(TEST_COMMAND) + len(TEST_COMMAND)]  # both commands come before anything else's code
    assert INSTALL_AND_RUN in first
    assert first.count("```bash") == 2


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()


def test_readme_links_to_every_doc_and_the_links_resolve():
    linked = linked_docs()
    assert all(p.is_file() for p in linked), [str(p) for p in linked if not p.is_file()]
    assert {p.name for p in linked} == {p.name for p in DOCS.glob("*.md")}


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_docs_reach_a_file_and_a_heading():
    bad = []
    for page in [README, *DOCS.glob("*.md")]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", _without_code_blocks(page.read_text(encoding="utf-8"))):
            if target.startswith(("http://", "https://")):
                continue
            dest = (page.parent / target) if target else page
            if not dest.is_file():
                bad.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", _without_code_blocks(dest.read_text(encoding="utf-8")), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    bad.append(f"{page.name}: {target}#{anchor}")
    assert not bad, bad


def test_files_the_docs_name_exist():
    pattern = re.compile(r"(?<![\w./-])((?:tests|benchmarks|localspec|docs|\.ci)/[\w./-]*\w)")
    missing = [f"{page.name}: {path}" for page in [README, *DOCS.glob("*.md")]
               for path in pattern.findall(page.read_text(encoding="utf-8")) if not (ROOT / path).exists()]
    assert not missing, missing


def test_every_command_and_option_is_documented():
    text = documentation()
    missing = []
    for path, cmd in commands():
        if path and f"localspec {' '.join(path)}" not in text and f"`{' '.join(path)}`" not in text:
            missing.append("localspec " + " ".join(path))
        for p in cmd.params:
            if getattr(p, "param_type_name", "") != "option" or p.name == "help":
                continue
            names = [n for n in p.opts + p.secondary_opts if n.startswith("--")] or list(p.opts)
            if not any(re.search(re.escape(n) + r"(?![\w-])", text) for n in names):
                missing.append(f"localspec {' '.join(path)} {names[0]}")
    assert not missing, "undocumented: " + ", ".join(missing)


def test_every_chat_command_is_documented():
    from localspec.tui.commands import QUIT_COMMANDS, SLASH

    text = documentation()
    missing = [c for c in [c for c, _, _ in SLASH] + list(QUIT_COMMANDS) if not re.search(re.escape(c) + r"\b", text)]
    assert not missing, missing


def test_no_development_history_in_the_docs():
    pattern = re.compile(r"session [0-9]|round [0-9]|issue #?[0-9]|hardening|\breview", re.I)
    hits = [f"{p.name}: {m.group(0)}" for p in [README, *DOCS.glob("*.md")]
            for m in pattern.finditer(p.read_text(encoding="utf-8"))]
    assert not hits, hits
