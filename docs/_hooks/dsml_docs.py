"""MkDocs hooks of the dsml site (not part of the package; mkdocs.yml names this file).

Markers in a page are replaced while the site builds:

- `<!-- dsml:cli -->`: the help of `dsml` and of every command, from the real argparse
  parser, so the CLI reference cannot drift from the code;
- `<!-- dsml:api -->`: a mkdocstrings block per public module that exists (dsml, dsml.elastic,
  dsml.blocking, dsml.torch, dsml.testing, ...), so a module merged later appears by itself;
- `<!-- dsml:readme TITLE -->`: the README section whose heading starts with TITLE.

Links from docs/ pages to files outside docs/ (../README.md, ../benchmarks/x.py) cannot
resolve on the site; they are shown as the file's path in code style instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: public modules, in the order the API reference shows them
API_MODULES = (
    ("dsml", "Top level: dsml.init, dsml.open_registry, the communicator, errors"),
    ("dsml.elastic", "Elastic training"),
    ("dsml.blocking", "Blocking API"),
    ("dsml.torch", "torch.distributed backend"),
    ("dsml.ps", "Parameter servers"),
    ("dsml.train", "Training strategies and compression"),
    ("dsml.log", "Logging"),
    ("dsml.testing", "Testing helpers"),
)
#: members of the top-level `dsml` page, shown with their own members
TOP_LEVEL_CLASSES = ("Communicator", "CollectiveHandle", "Engine", "Registry", "Client")

_OUTSIDE_LINK = re.compile(r"\[([^\]]+)\]\((\.\./)+([^)#\s]+)(#[^)]*)?\)")
_README = re.compile(r"<!-- dsml:readme (.+?) -->")
_README_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- dsml:cli -->" in markdown:
        markdown = markdown.replace("<!-- dsml:cli -->", cli_reference())
    if "<!-- dsml:api -->" in markdown:
        markdown = markdown.replace("<!-- dsml:api -->", api_reference())
    markdown = _README.sub(lambda m: readme_section(m[1]), markdown)
    return _OUTSIDE_LINK.sub(_outside_link, markdown)


def _outside_link(match: re.Match[str]) -> str:
    text, path = match[1], match[3]
    if path.startswith("docs/"):  # README-style links that point back into docs/
        return match[0]
    return text if text.strip("`") == path else f"{text} (`{path}`)"


def cli_reference() -> str:
    """Every command's --help, as `dsml COMMAND --help` prints it."""
    from dsml.cli import build_parser

    parser = build_parser({})
    parts = ["## dsml", "", "```text", _help(parser), "```", ""]
    for name, command in _commands(parser, "dsml"):
        parts += [f"## {name}", "", "```text", _help(command), "```", ""]
    return "\n".join(parts)


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, Any]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.append((f"{prefix} {name}", child))
                found += _commands(child, f"{prefix} {name}")
    return found


def _help(parser: argparse.ArgumentParser) -> str:
    import os

    os.environ["COLUMNS"] = "100"  # the same wrapping on every machine
    return parser.format_help().rstrip()


def api_reference() -> str:
    parts = []
    for module, title in API_MODULES:
        if importlib.util.find_spec(module) is None:
            continue  # not merged yet: it appears once it exists
        parts += [f"## {title}", ""]
        if module == "dsml":
            parts += _top_level()
        else:
            parts += [f"::: {module}", "    options:", "      show_root_heading: false"]
        parts.append("")
    return "\n".join(parts)


def _top_level() -> list[str]:
    """dsml's functions, each from where it is defined, then its other public names.

    `dsml.init` is the function `dsml.communicator.init.init`, and griffe resolves the alias
    to the module of the same name; so functions get a block of their own under an anchor
    `dsml.NAME`, as the other names have.
    """
    import inspect

    import dsml

    names = _public_names("dsml")
    functions = [n for n in names if inspect.isfunction(getattr(dsml, n))]
    parts = []
    for name in functions:
        target = getattr(dsml, name)
        parts += [
            f"### `dsml.{name}` {{ #dsml.{name} }}",
            "",
            f"::: {target.__module__}.{target.__qualname__}",
            "    options:",
            "      show_root_heading: false",
            "",
        ]
    parts += ["::: dsml", "    options:", "      show_root_heading: false"]
    parts += ["      show_submodules: false", "      members:"]
    parts += [f"        - {name}" for name in names if name not in functions]
    return parts


def _public_names(module: str) -> list[str]:
    namespace: dict[str, Any] = {}
    source = (ROOT / "dsml" / "__init__.py").read_text()
    match = re.search(r"__all__ = \[(.*?)\]", source, re.S)
    assert match, "dsml/__init__.py has no __all__"
    exec(f"names = [{match[1]}]", namespace)
    return [n for n in namespace["names"] if not n.startswith("_") and n != "elastic"]


def readme_section(title: str) -> str:
    """The README section (## heading starting with `title`) with its headings demoted."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"## {title}")), None)
    if start is None:
        return f'*(The README has no section "{title}" yet.)*'
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = "\n".join(
        "#" + line if line.startswith("#") else line for line in lines[start + 1 : end]
    )
    return _README_LINK.sub(_readme_link, body)


def _readme_link(match: re.Match[str]) -> str:
    """A README link, seen from docs/: docs/X becomes X; other files become their path."""
    text, target = match[1], match[2]
    if target.startswith(("http://", "https://", "#", "mailto:")):
        return match[0]
    if target.startswith("docs/"):
        return f"[{text}]({target[len('docs/') :]})"
    path = target.split("#", 1)[0]
    return text if text.strip("`") == path else f"{text} (`{path}`)"
