"""The ``kvmem`` command: ``main(argv)`` so tests call it directly.

Each subcommand lives in its own module of this package with two functions:
``add_arguments(parser)`` and ``run(args) -> int``. User errors (:class:`KvmemError`) print
one line ``kvmem: error: ...`` and exit with status 2, and so do operating-system errors (a full
disk while the atlas is written: :func:`kvmem.cli.printing.os_error_line`); ``--debug`` shows the
traceback. Output cut short by its reader (``| head``) ends quietly with status 141, as SIGPIPE
would. The command leaves the process as Python runs it: no garbage-collector or allocator settings,
and the interpreter's usual exit (profilers, coverage and ``atexit`` handlers see its end).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib import import_module

from kvmem import __version__
from kvmem.cli.printing import os_error_line
from kvmem.errors import KvmemError

__all__ = ["main", "run", "COMMANDS", "BROKEN_PIPE"]

BROKEN_PIPE = 141  # the status of a command that SIGPIPE ended (128 + 13), as a shell reports it

# command -> (module in kvmem.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "anatomy": ("anatomy_cmd", "per-layer FFN parameter counts of a model beside the formula"),
    "scan": ("scan_cmd", "scan a corpus into a memory atlas"),
    "merge": ("scan_cmd", "merge shard atlases into one"),
    "project": ("scan_cmd", "write an atlas's value and key projection tables (a lazy scan computes them on demand)"),
    "info": ("query_cmd", "summarise an atlas"),
    "top": ("query_cmd", "memories that promote a token, or fire right before it"),
    "neuron": ("query_cmd", "one memory: statistics, triggers, value and key projections"),
    "report": ("report_cmd", "export neuron reports (html, md, json) with an index page"),
    "export": ("export_cmd", "export an atlas for explanation tools (formats: kvmem.export.FORMATS)"),
    "taxonomy": ("taxonomy_cmd", "the neuron taxonomy (prediction, suppression, entropy, dead, ...) of an atlas or a model"),
    "explain": ("explain_cmd", "explain neuron sides in words and token rules"),
    "score": ("explain_cmd", "score explanations on held-out examples, with intervals and baselines"),
    "experiment": ("experiment_cmd", "run a Geva et al. measurement on an atlas"),
    "trace": ("trace_cmd", "which memories build a prediction, layer by layer"),
    "generate": ("trace_cmd", "generate with memory coefficients set, beside the unchanged model"),
    "serve": ("serve_cmd", "explore an atlas in the browser: neuron pages, search, live traces and edits"),
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command's parser. Without ``argv``, every command gets its arguments; with ``argv``, only the
    command it names does, and the others are listed with their help but their modules are not
    imported (the explain command's arguments import the explanation package: about 0.1 s, and pandas)."""

    chosen = _named_command(argv) if argv is not None else None
    parser = argparse.ArgumentParser(prog="kvmem", description="Read a transformer's FFN layers as key-value memories.")
    parser.add_argument("--version", action="version", version=f"kvmem {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if argv is not None and name != chosen:
            subparsers.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            module = import_module(f"kvmem.cli.{module_name}")
        except ModuleNotFoundError as error:
            if error.name != f"kvmem.cli.{module_name}":
                raise
            continue
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
        module.add_arguments(sub, name)
        sub.set_defaults(_run=module.run)
    return parser


def _named_command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the top-level options take no
    value), or None."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KvmemError as error:
        if args.debug:
            raise
        print(f"kvmem: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (kvmem top ... | head): nobody to tell
        _stdout_to_devnull()
        return BROKEN_PIPE
    except OSError as error:
        if args.debug:
            raise

        print(f"kvmem: error: {os_error_line(error, out=getattr(args, 'out', None))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        notes = "".join(f"; {note}" for note in getattr(interrupt, "__notes__", ()))
        print(f"kvmem: interrupted{notes}", file=sys.stderr)
        return 130


def run() -> None:
    """The ``kvmem`` console script and ``python -m kvmem``: :func:`main`, its status as the exit status.
    What stdout still buffers is flushed here, so that a reader who left (``| head``) ends the command
    quietly with :data:`BROKEN_PIPE` instead of an error at the interpreter's exit."""
    code = main()
    try:
        sys.stdout.flush()  # what a pipe's buffer still holds
    except BrokenPipeError:
        _stdout_to_devnull()
        code = BROKEN_PIPE
    except (OSError, ValueError):  # stdout closed: nothing more to deliver
        pass
    sys.exit(code)


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null, so that what its buffer still holds is dropped quietly."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    run()
