"""mkdocs hooks: pages that are generated from the code, so that they cannot drift from it.

``<!-- kvmem:columns -->`` in a page becomes one table per atlas table with every column of
:data:`kvmem.schema.COLUMNS`; ``<!-- kvmem:conventions -->`` the projection conventions of
:data:`kvmem.conventions.CONVENTIONS` with their recorded formulas; ``<!-- kvmem:architectures -->``
the architecture table of :data:`kvmem.architectures.ARCHITECTURES`.
"""

from __future__ import annotations


def _cell(text: str) -> str:
    """Table-cell text: pipes and brackets escaped (``[x]['y']`` would read as a Markdown reference)."""
    return text.replace("|", "&#124;").replace("[", "&#91;").replace("]", "&#93;")


def _columns() -> str:
    from kvmem.scanning.statistics import STATISTICS
    from kvmem.schema import COLUMNS, FORMAT_VERSION

    parts = [f"Atlas format version {FORMAT_VERSION}. Generated from `kvmem.schema.COLUMNS` and the tables the "
             f"optional statistics define (`kvmem.scanning.statistics.STATISTICS`).\n"]
    own = {name: columns for cls in STATISTICS.values() for name, columns in cls.table_columns.items()}
    for table, columns in {**COLUMNS, **own}.items():
        parts.append(f"### `{table}.parquet`\n\n| column | type and meaning |\n|---|---|")
        parts += [f"| `{name}` | {_cell(text)} |" for name, text in columns.items()]
        parts.append("")
    return "\n".join(parts)


def _conventions() -> str:
    from kvmem.conventions import CONVENTIONS, DEFAULT_CONVENTION

    rows = ["| name | formula recorded beside every number |", "|---|---|"]
    rows += [f"| `{c.name}`{' (default)' if c.name == DEFAULT_CONVENTION else ''} | {_cell(c.formula)} |"
             for c in CONVENTIONS.values()]
    return "\n".join(rows)


def _architectures() -> str:
    from kvmem.architectures import ARCHITECTURES

    rows = ["| `model_type` | family | FFN |", "|---|---|---|"]
    rows += [f"| `{name}` | {spec.family} | {spec.ffn_kind} |" for name, spec in ARCHITECTURES.items()]
    return "\n".join(rows)


GENERATED = {"<!-- kvmem:columns -->": _columns, "<!-- kvmem:conventions -->": _conventions,
             "<!-- kvmem:architectures -->": _architectures}


def on_page_markdown(markdown: str, page, config, files) -> str:
    for marker, build in GENERATED.items():
        if marker in markdown:
            markdown = markdown.replace(marker, build())
    return markdown


class _DoctestFences:
    """A Markdown preprocessor: a run of ``>>>`` lines (and their output) in a docstring becomes a python code
    block, so examples in docstrings render as code in the API reference."""

    @staticmethod
    def extension():
        import re

        from markdown.extensions import Extension
        from markdown.preprocessors import Preprocessor

        role = re.compile(r":(?:py:)?(?:func|class|meth|data|mod|attr|obj|exc):`~?([^`]+)`")
        field = re.compile(r"^(\s*)([A-Za-z_]\w*(?: / [A-Za-z_]\w*)*):( +)(\S.*)$")  # "window:     tokens per window"

        class Fence(Preprocessor):
            def run(self, lines: list[str]) -> list[str]:
                lines = [role.sub(r"`\1`", line) for line in lines]  # reST roles in docstrings -> code
                lines = self.fields(lines)
                out: list[str] = []
                inside = False
                fenced = False
                for line in lines:
                    if line.lstrip().startswith("```"):
                        fenced = not fenced
                    starts = not fenced and line.lstrip().startswith(">>>")
                    if starts and not inside:
                        out += ["", "```python"]
                        inside = True
                    elif inside and not line.strip():
                        out += ["```", ""]
                        inside = False
                    out.append(line)
                if inside:
                    out.append("```")
                return out

            @staticmethod
            def fields(lines: list[str]) -> list[str]:
                """An aligned field list (``name:   text`` lines, continuations indented under the text) becomes a
                bullet list, so a dataclass's documented fields do not run together into one paragraph. A block
                is two or more such lines in a row at one indentation."""
                matches = [field.match(line) for line in lines]
                out: list[str] = []
                column = None
                for i, (line, found) in enumerate(zip(lines, matches)):
                    neighbour = any(m is not None and m.group(1) == (found.group(1) if found else None)
                                    for m in (matches[i - 1] if i else None, matches[i + 1] if i + 1 < len(lines) else None)
                                    if m is not None)
                    if found and (neighbour or column is not None) and not line.lstrip().startswith(("```", ">>>")):
                        if column is None and out and out[-1].strip():
                            out.append("")
                        column = len(found.group(1))  # the field name's indentation; continuations sit deeper
                        out.append(f"- `{found.group(2)}`: {found.group(4)}")
                    elif column is not None and line.strip() and len(line) - len(line.lstrip()) > column:
                        out.append("  " + line.strip())
                    else:
                        if column is not None:
                            out.append("")
                        column = None
                        out.append(line)
                return out


        class DoctestExtension(Extension):
            def extendMarkdown(self, md):  # noqa: N802 - Markdown's API
                md.preprocessors.register(Fence(md), "kvmem_doctest", 40)

        return DoctestExtension()


def on_config(config):
    config["markdown_extensions"].append(_DoctestFences.extension())
    return config
