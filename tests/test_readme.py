"""The README and docs/ stay true to the code: every command of the README's "Try next" block parses, every docs/
link it gives exists, every config key is on docs/configuration.md, and no page cites what a reader cannot open."""
from __future__ import annotations

import dataclasses
import re
import shlex

import pytest
from click.testing import CliRunner

from mpitrain.cli import main
from mpitrain.config import Config
from mpitrain.config_moe import MoeSettings
from tests.mpi_helpers import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"


def try_next_commands() -> list[str]:
    """The `mpitrain ...` lines of the bash blocks between `<!-- try-next -->` and `<!-- end try-next -->`."""
    text = README.read_text()
    found = re.search(r"<!-- try-next -->(.*?)<!-- end try-next -->", text, re.S)
    assert found, "README.md has no <!-- try-next --> ... <!-- end try-next --> block"
    blocks = re.findall(r"```bash\n(.*?)```", found.group(1), re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("mpitrain ")]


def test_the_try_next_block_has_five_commands():
    assert len(try_next_commands()) == 5, try_next_commands()


@pytest.mark.parametrize("line", try_next_commands())
def test_try_next_command_parses(line):
    """The command with --help appended: click resolves the subcommand and rejects an unknown option before it
    prints the help, so a renamed command or option fails here, without running anything."""
    words = shlex.split(line)[1:]
    result = CliRunner().invoke(main, [*words, "--help"])
    assert result.exit_code == 0, f"{line!r}: {result.output}"
    assert f" {words[0]} " in result.output.splitlines()[0] + " ", result.output


def test_readme_links_to_docs_exist():
    text = README.read_text()
    links = set(re.findall(r"\]\((docs/[^)#\s]+)", text)) | set(re.findall(r"`(docs/[\w./-]+)`", text))
    assert links, "README.md links to no docs/ page"
    missing = sorted(link for link in links if not (REPO_ROOT / link).exists())
    assert not missing, f"README.md links to missing files: {missing}"


def anchors(page) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_docs_links_between_pages_exist():
    """Relative links in docs/ pages resolve from docs/ (a link written `docs/x.md` there would not), and so do
    their #anchors."""
    for page in DOCS.glob("*.md"):
        for link, anchor in re.findall(r"\]\(([^)#\s:]*)(?:#([^)]*))?\)", page.read_text()):
            target = DOCS / link if link else page
            assert target.exists(), f"{page.name} links to missing {link}"
            if anchor:
                assert anchor in anchors(target), f"{page.name} links to {link}#{anchor}: no such heading"


def config_keys() -> list[str]:
    """Every key a config file may set, read from the dataclasses (a trailing underscore only dodges a keyword)."""
    keys, defaults = [], Config()
    for section in dataclasses.fields(Config):
        keys += [f"{section.name}.{item.name.rstrip('_')}"
                 for item in dataclasses.fields(getattr(defaults, section.name))]
    keys += [f"model.moe.{item.name}" for item in dataclasses.fields(MoeSettings)]
    return keys


def test_every_config_key_is_documented():
    page = (DOCS / "configuration.md").read_text()
    keys = config_keys()
    assert "train.steps" in keys and "checkpoint.async" in keys and "model.moe.top_k" in keys
    missing = [key for key in keys if f"`{key}`" not in page]
    assert not missing, f"docs/configuration.md lacks {missing}: run python docs/make_configuration.py"


@pytest.mark.parametrize("pattern", [r"issue \d+", r"\.\./shared", r"design\.md"])
def test_no_page_cites_what_a_reader_cannot_open(pattern):
    pages = [README, *sorted(DOCS.glob("*.md"))]
    hits = [f"{page.relative_to(REPO_ROOT)}: {match.group(0)!r}" for page in pages
            for match in re.finditer(pattern, page.read_text(), re.I)]
    assert not hits, hits
