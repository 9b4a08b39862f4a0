"""The ``qwen4exp`` command line: one dispatcher, one module per subcommand.

Each subcommand module ``parity/cli/<name>.py`` defines ``register(subparsers)`` (cheap: no heavy
imports at module level) which adds its parser and sets ``func`` to a callable taking the parsed
args and returning the exit code. Exit codes: 0 success / agreement, 1 divergence or failed check,
2 usage or input error.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand modules, in the order they appear in --help
_MODULES = ["info", "logits", "taps", "kl", "parity", "generate", "bench", "slice"]


class CLIError(Exception):
    """A user-facing error: printed as one line on stderr, exit code 2."""


def package_version() -> str:
    """The installed ``qwen4exp-parity`` version (importlib.metadata), or pyproject's when not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("qwen4exp-parity")
    except PackageNotFoundError:
        import re
        from pathlib import Path
        try:
            text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
            m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
            return m.group(1) if m else "unknown"
        except OSError:
            return "unknown"


def _silence_stdout() -> None:
    """After a broken pipe: point stdout at /dev/null so the interpreter's final flush cannot fail."""
    import os
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def build_parser() -> argparse.ArgumentParser:
    """The ``qwen4exp`` argument parser with every available ``parity.cli.*`` subcommand registered (a
    missing command module is skipped; other import errors propagate)."""
    p = argparse.ArgumentParser(prog="qwen4exp", description="qwen4exp parity tools: reference, engine, "
                                "tap-diff, logit-KL and scenario suites for the Qwen3.8-Flash-Next architecture")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _MODULES:
        try:
            mod = importlib.import_module(f"parity.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"parity.cli.{name}":
                continue
            raise
        mod.register(sub)
    return p


def _check_empty_model(args) -> None:
    """An empty MODEL ('') would resolve to the current directory and be reported as '.'; refuse it as typed.

    Raises:
        InputError: a MODEL / --model argument that is the empty string.
    """
    from reference.errors import InputError
    if "" in (getattr(args, "model", None), getattr(args, "model_pos", None)):
        raise InputError("MODEL '': expected a checkpoint directory or a bundled fixture name, found an empty string")


def main(argv: list[str] | None = None) -> int:
    """Run the ``qwen4exp`` command line.

    Returns:
        The command's exit code; for a CLIError or a UserError (printed as ``qwen4exp <command>: error: ...``)
        2, or the error's ``exit_code`` (1 for output that could not be written, e.g. OutputWriteError);
        1 with one line for any other write that failed for a full, read-only or failing disk;
        0 when stdout's reader went away (BrokenPipeError); 128 + signal number (130 for Ctrl-C) when interrupted.
        Other exceptions propagate.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_empty_model(args)
        rc = args.func(args)
    except CLIError as e:
        print(f"qwen4exp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `qwen4exp taps list --json | head`: the reader went away, not an error
        _silence_stdout()
        return 0
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", None)  # parity.bench.runner.Terminated (SIGTERM) carries its signal
        what = "interrupted" if signum is None else f"terminated (signal {signum})"
        print(f"qwen4exp {args.command}: {what}", file=sys.stderr)
        return 128 + signum if signum else 130
    except Exception as e:
        from reference.atomic import WRITE_ERRNOS
        from reference.errors import UserError
        if isinstance(e, UserError):  # bad input (exit 2), or output that could not be written (exit 1)
            print(f"qwen4exp {args.command}: error: {e}", file=sys.stderr)
            return e.exit_code
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:  # the environment, not a bug (`> /dev/full`)
            where = f" ({e.filename})" if e.filename else ""
            print(f"qwen4exp {args.command}: error: could not write output{where}: {e.strerror or e}",
                  file=sys.stderr)
            _silence_stdout()
            return 1
        raise
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    except OSError as e:  # e.g. stdout is /dev/full: the output did not reach its destination
        print(f"qwen4exp {args.command}: error: could not write output: {e.strerror or e}", file=sys.stderr)
        _silence_stdout()
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
