"""The README and docs/ link only to pages and headings that exist, and every `skyrl-grpc`
command they show parses with today's flags (pages were merged and renamed, flags added and
renamed; a stale link or command is the first thing a newcomer trips on)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", page.read_text()))


def test_every_local_link_names_a_page_and_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        for link in links(page):
            if re.match(r"[a-z]+://", link) or link.startswith("mailto:"):
                continue
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_slug_rule_matches_githubs_for_the_headings_linked_here() -> None:
    assert slug("Measured: rollouts and the edge") == "measured-rollouts-and-the-edge"
    assert (
        slug("Soaks: mixed traffic, and kill -9 under a training loop")
        == "soaks-mixed-traffic-and-kill--9-under-a-training-loop"
    )
    assert (
        slug("Measured at 0.3B parameters, end to end (`python -m scripts.bench_weight_sync`)")
        == "measured-at-03b-parameters-end-to-end-python--m-scriptsbench_weight_sync"
    )


# A command, not a message quoting one ("skyrl-grpc up: stopped ...").
COMMAND = re.compile(r"(?:\.venv/bin/)?skyrl-grpc ((?:serve|route|up|scale|demo)(?![\w:])[^`\n]*)")


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every ``skyrl-grpc`` command line in the docs (code blocks and inline code), without
    its comment; those with placeholders (``...``, ``<path>``) left out."""
    found = []
    for page in PAGES:
        for match in COMMAND.finditer(page.read_text().replace("\\\n", " ")):
            line = match.group(1).split(" #")[0].strip()
            if "..." in line or "<" in line:
                continue
            found.append((f"{page.name}: skyrl-grpc {line}", shlex.split(line)))
    return found


@pytest.mark.parametrize(("where", "argv"), documented_commands(), ids=lambda x: str(x)[:60])
def test_every_documented_command_parses_with_todays_flags(where: str, argv: list[str]) -> None:
    from servers import cli
    from trainer_client import demo

    try:
        args, rest = cli.parse(argv)
        if args.command == "demo":  # the rest goes to the trainer, with the fleet's addresses
            demo.build_parser().parse_args(["--router", "r:1", "--servers", "s:1", *rest])
    except SystemExit as error:
        pytest.fail(f"{where}: does not parse ({error})")


def test_the_docs_show_commands_of_every_kind() -> None:
    kinds = {argv[0] for _, argv in documented_commands()}
    assert kinds == {"serve", "route", "up", "scale", "demo"}, kinds
