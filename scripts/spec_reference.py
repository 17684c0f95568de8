"""Write docs/spec-reference.md, the job spec's field reference, from ``JobSpec``'s JSON schema.

    python -m scripts.spec_reference          # rewrite docs/spec-reference.md
    python -m scripts.spec_reference --check  # exit 1 when the file is not what the schema gives

The schema is the one the REST API publishes (``/openapi.json``), so the page cannot drift from
what the server and ``raytron run`` accept: tests/test_docs.py runs ``--check``.
"""

from __future__ import annotations

import json
import sys

from scripts.generated_page import ROOT, write_or_check

PAGE = ROOT / "docs" / "spec-reference.md"

HEADER = """# Job spec field reference

Generated from `JobSpec`'s JSON schema by `python -m scripts.spec_reference`; do not edit by hand.
The prose guide is [spec.md](spec.md). `auto` is accepted where the type says so (see
[auto-layout.md](auto-layout.md)). Every field is optional; a section left out takes every default.
"""


def _type(prop: dict, defs: dict) -> str:
    if "$ref" in prop:
        return prop["$ref"].rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " | ".join(_type(p, defs) for p in prop["anyOf"])
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    if "const" in prop:
        return json.dumps(prop["const"])
    t = prop.get("type", "any")
    if t == "array":
        return f"list[{_type(prop.get('items', {}), defs)}]"
    return t


def _bounds(prop: dict) -> str:
    out = []
    for p in [prop] + prop.get("anyOf", []):
        for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
            if key in p:
                out.append(f"{sign} {p[key]:g}" if isinstance(p[key], float) else f"{sign} {p[key]}")
    return ", ".join(dict.fromkeys(out))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(prop: dict) -> str | None:
    """The name of the section a top-level field holds, if it is one."""
    for p in [prop] + prop.get("anyOf", []):
        if "$ref" in p:
            return p["$ref"].rsplit("/", 1)[-1]
    return None


def _table(props: dict, defs: dict) -> list[str]:
    rows = ["| field | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, prop in props.items():
        default = "(section)" if _section(prop) else json.dumps(prop.get("default"))
        rows.append(f"| `{name}` | {_cell(_type(prop, defs))} | `{_cell(default)}` | {_bounds(prop)} | "
                    f"{_cell(prop.get('description', ''))} |")
    return rows


def render() -> str:
    from service.spec.spec import JobSpec

    schema = JobSpec.model_json_schema()
    defs = schema.get("$defs", {})
    lines = [HEADER, "## The top level", "", *_table(schema["properties"], defs)]
    for name, prop in schema["properties"].items():
        if not _section(prop):
            continue
        section = defs[_section(prop)]
        lines += ["", f"## `{name}`", ""]
        if section.get("description"):
            lines += [" ".join(section["description"].split()), ""]
        lines += _table(section["properties"], defs)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return write_or_check(argv, PAGE, render, "scripts.spec_reference", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
