"""MkDocs hooks: reference pages generated from the code, so they cannot drift from it.

A page marks where a generated part goes with an HTML comment on a line of its own:

- ``<!-- m2flow:cli -->``: ``m2flow --help`` and the help of every command (the installed CLI,
  entry-point commands included);
- ``<!-- m2flow:config grpo -->``: every config key of a built-in workflow, with its default
  (from the workflow's ``Config`` dataclasses, as ``--show-config`` prints it) and the comment
  next to the field in the source.

``mkdocs.yml`` names this file under ``hooks:``; ``mkdocs build --strict`` fails on a marker
that names an unknown workflow.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from functools import cache

MARKER = re.compile(r"^<!-- m2flow:(cli|config)(?: ([\w.-]+))? -->$", re.MULTILINE)


#: a Sphinx role of a docstring as mkdocstrings renders it: :class:<code>~m2flow.x.Y</code>
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):<code>(~?)([\w.]+)</code>")


def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: _generate(m.group(1), m.group(2)), markdown)


def on_page_content(html: str, page, config, files) -> str:
    """Docstrings name objects with Sphinx roles (``:class:`~m2flow.core.group.WorkerGroup```);
    show them as code, the ``~`` form by its last name, as Sphinx would."""

    def code(m: re.Match) -> str:
        name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
        return f"<code>{name}</code>"

    return SPHINX_ROLE.sub(code, html)


def _generate(kind: str, arg: str | None) -> str:
    if kind == "cli":
        return cli_reference()
    if not arg:
        raise ValueError("<!-- m2flow:config --> needs a workflow name, e.g. grpo")
    return config_reference(arg)


# ---------------------------------------------------------------------------------------- CLI


@cache
def cli_reference() -> str:
    """``--help`` of ``m2flow`` and of each of its commands, as text blocks."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from m2flow.run.cli import app

    runner = CliRunner()
    group = get_command(app)
    parts = ["## `m2flow`", "", "```text", _help(runner, app, []), "```", ""]
    for name in sorted(group.commands):
        parts += [f"## `m2flow {name}`", "", "```text", _help(runner, app, [name]), "```", ""]
    return "\n".join(parts)


def _help(runner, app, args: list[str]) -> str:
    env = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}  # set during the call only
    result = runner.invoke(app, [*args, "--help"], prog_name="m2flow", env=env)
    if result.exit_code != 0:
        raise RuntimeError(f"m2flow {' '.join(args)} --help failed: {result.output}")
    lines = [line.rstrip() for line in result.output.splitlines()]
    return "\n".join(lines).strip("\n")


# ------------------------------------------------------------------------------------- config


def config_reference(workflow: str) -> str:
    """A table per top-level section of ``workflow``'s config: key, default, meaning."""
    from omegaconf import OmegaConf

    from m2flow.run.program import load_workflow, resolve_workflow

    module = load_workflow(resolve_workflow(workflow))
    defaults = OmegaConf.to_container(OmegaConf.structured(module.Config), resolve=True)
    sections: set[str] = set()
    notes = _field_notes(module.Config, "", sections)
    out, loose = [], []
    for key, value in defaults.items():
        if key in sections:
            rows = list(_rows(value, f"{key}.", notes, sections))
            out += [f"### `{key}`", "", "| key | default | meaning |", "|---|---|---|", *rows, ""]
        else:
            loose.append(_row(key, value, notes.get(key, "")))
    if loose:
        head = ["### top level", "", "| key | default | meaning |", "|---|---|---|"]
        out = [*head, *loose, ""] + out
    return "\n".join(out)


def _rows(section: dict, prefix: str, notes: dict[str, str], sections: set[str]):
    for key, value in section.items():
        name = f"{prefix}{key}"
        if name in sections:  # a nested dataclass section (rollout.spot), not a dict field
            yield from _rows(value, f"{name}.", notes, sections)
        else:
            yield _row(name, value, notes.get(name, ""))


def _row(name: str, value, note: str) -> str:
    shown = "unset" if value is None else f"`{_plain(value)}`"
    return f"| `{name}` | {shown} | {_escape(note)} |"


def _plain(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, dict) and not value:
        return "{}"
    return str(value)


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _dataclass_of(cls: type, key: str) -> type | None:
    hints = {f.name: f for f in dataclasses.fields(cls)}
    field = hints.get(key)
    if field is None:
        return None
    default = None
    if field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    elif field.default is not dataclasses.MISSING:
        default = field.default
    return type(default) if dataclasses.is_dataclass(default) else None


def _field_notes(cls: type, prefix: str, sections: set[str]) -> dict[str, str]:
    """``{dotted key: comment}`` for every field of ``cls`` and its nested sections (whose
    dotted names are added to ``sections``): the comment lines right above the field and the
    comment at the end of its line."""
    notes: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's comment wins over its base's
        if dataclasses.is_dataclass(klass):
            notes.update({f"{prefix}{k}": v for k, v in _class_comments(klass).items()})
    for field in dataclasses.fields(cls):
        sub = _dataclass_of(cls, field.name)
        if sub is not None:
            sections.add(f"{prefix}{field.name}")
            notes.update(_field_notes(sub, f"{prefix}{field.name}.", sections))
    return notes


@cache
def _class_comments(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    import ast

    body = ast.parse(source).body[0]
    out: dict[str, str] = {}
    for node in getattr(body, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        above, n = [], node.lineno - 1
        while n in comments and n not in code_lines:
            above.insert(0, comments[n])
            n -= 1
        text = " ".join(above + trailing)
        text = re.sub(r"\s+", " ", text).strip()
        if text:
            out[node.target.id] = text
    return out
