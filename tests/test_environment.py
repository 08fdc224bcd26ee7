"""Every environment variable kvmem reads is in one table (kvmem.environment.VARIABLES), read through
one function, and the ones set during a scan are recorded in the atlas's manifest."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import kvmem
from kvmem import environment

PACKAGE = Path(__file__).resolve().parent.parent / "kvmem"
NAME = re.compile(r"\bKVMEM_[A-Z0-9_]+\b")


def _sources() -> dict[Path, str]:
    return {path: path.read_text() for path in PACKAGE.rglob("*.py")}


def test_every_kvmem_variable_named_in_the_package_is_in_the_table_and_each_there_is_read():
    named = {name for text in _sources().values() for name in NAME.findall(text)}
    assert named == set(environment.VARIABLES)
    read = set()  # names passed to environment.read, directly or through a module constant
    for text in _sources().values():
        constants = {target.id: node.value.value for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                     for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "read"
                    and getattr(node.func.value, "id", "") == "environment" and node.args):
                argument = node.args[0]
                read.add(argument.value if isinstance(argument, ast.Constant) else constants.get(argument.id))
    assert read == set(environment.VARIABLES)


def test_no_module_reads_a_kvmem_variable_from_os_environ_itself():
    for path, text in _sources().items():
        if path.name == "environment.py":
            continue
        for line in text.splitlines():
            if "os.environ" in line or "getenv" in line:
                assert not NAME.search(line), f"{path}: {line.strip()}"


def test_a_scan_records_the_variables_set_while_it_ran(gpt2_model, tmp_path, monkeypatch):
    for name in environment.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVMEM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVMEM_PREFETCH", " 0 ")
    docs = ["The cat sat on the mat. " * 10]
    atlas = kvmem.scan(gpt2_model, docs, out=tmp_path / "a", max_tokens=100, progress=False)
    assert atlas.manifest.environment["variables"] == {"KVMEM_CACHE": str(tmp_path / "cache"), "KVMEM_PREFETCH": "0"}
    monkeypatch.delenv("KVMEM_PREFETCH")
    atlas = kvmem.scan(gpt2_model, docs, out=tmp_path / "b", max_tokens=100, progress=False)
    assert kvmem.open(tmp_path / "b").manifest.environment["variables"] == {"KVMEM_CACHE": str(tmp_path / "cache")}


def test_reading_a_name_outside_the_table_is_a_programming_error():
    with pytest.raises(ValueError, match="KVMEM_NOPE is not one of kvmem's environment variables"):
        environment.read("KVMEM_NOPE")
