"""The ``qwen4exp`` command line: one dispatcher, one module per subcommand (argument parsing and
printing only; the work is library code in parity.harness / parity.bench / parity.generate / reference).

Each subcommand module ``parity/cli/<name>.py`` defines ``register(subparsers)`` (cheap: no heavy
imports at module level) which adds its parser and sets ``func`` to a callable taking the parsed
args and returning the exit code. Exit codes (one contract for every verb): see
:data:`reference.errors.EXIT_CODES`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand modules, in the order they appear in --help
_MODULES = ["info", "logits", "taps", "kl", "parity", "generate", "bench", "slice"]


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


def exit_code_help() -> str:
    """The exit-code contract as printed by ``qwen4exp -h`` (from :data:`reference.errors.EXIT_CODES`)."""
    from reference.errors import EXIT_CODES
    return "exit codes (every command):\n" + "\n".join(f"  {k}  {v}" for k, v in EXIT_CODES.items()) + \
        ("\n  130 / 143 / 129  interrupted by SIGINT / SIGTERM / SIGHUP (outputs: the old ones or none, never a mix)"
         "\n  134              an outside engine in the process aborted it (SIGABRT; docs/outside-engines.md)"
         "\n  other            a backend in the process ended it without a Python exception (os._exit(N) exits N);"
         " outputs: the old ones or none")


class SubcommandParser(argparse.ArgumentParser):
    """The parser class of every subcommand (nested ones included): an argument it does not know is refused
    by the subcommand itself, so the error shows that subcommand's usage (``qwen4exp taps record: error:
    unrecognized arguments: --idz``, exit 2) rather than the top-level one. argparse's default hands a
    subcommand's unknown arguments up to the top-level parser, whose usage does not list them."""

    def parse_known_args(self, args=None, namespace=None):
        """Parse like ArgumentParser.parse_known_args; leftover arguments are an error of this parser."""
        self._args_seen = list(sys.argv[1:] if args is None else args)
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self._refuse_unknown(extras)
        return namespace, extras

    def _refuse_unknown(self, extras) -> None:
        import difflib
        options = sorted(o for o in self._option_string_actions if o.startswith("--"))
        hints = []
        for a in extras:
            name = a.split("=", 1)[0]
            if a.startswith("--") and name in getattr(self, "option_hints", {}):   # a verb's own word for it
                hints.append(f"{name}: {self.option_hints[name]}")
                continue
            # names compared without their '--' (shared by every option, it made '--bogus' read as '--out')
            close = difflib.get_close_matches(name[2:], [o[2:] for o in options], n=1) if a.startswith("--") else []
            if close:
                hints.append(f"{name}: did you mean --{close[0]}?")
        self.error(f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else ""))

    def _unknown_options(self) -> list[str]:
        """The ``--name`` arguments this parser does not know (nor as a unique abbreviation), up to ``--``."""
        if self._subparsers is not None:   # a parser with subcommands hands its options on
            return []
        out = []
        for a in getattr(self, "_args_seen", []):
            if a == "--":
                break
            if a.startswith("--"):
                name = a.split("=", 1)[0]
                hits = [o for o in self._option_string_actions if o == name or o.startswith(name)]
                if name not in self._option_string_actions and len(hits) != 1:
                    out.append(a)
        return out

    def error(self, message):
        """argparse's error; a missing required argument is reported after an unknown option, not in its place
        (``logits --modle X`` would otherwise say only that ``--ids`` is missing)."""
        if message.startswith("the following arguments are required"):
            unknown = self._unknown_options()
            if unknown:   # _refuse_unknown's own error is no "required" message: no recursion
                self._refuse_unknown(unknown)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    """The ``qwen4exp`` argument parser with every available ``parity.cli.*`` subcommand registered (a
    missing command module is skipped; other import errors propagate)."""
    from parity.cli.common import add_traceback
    p = argparse.ArgumentParser(prog="qwen4exp", description="qwen4exp parity tools: reference, engine, "
                                "tap-diff, logit-KL and scenario suites for the Qwen3.8-Flash-Next architecture",
                                epilog=exit_code_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    add_traceback(p, top=True)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubcommandParser)
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


def _check_argv(argv: list[str]) -> None:
    """Every command-line argument must be text: bytes that are not UTF-8 (handed over by Python as
    surrogate escapes) or lone surrogates are refused naming the argument and the byte offset.

    Raises:
        InputError: naming the option the value belongs to (``--prompt``), or the argument's position.
    """
    from reference.textio import check_text
    for i, a in enumerate(argv):
        if a.startswith("-") and len(a) > 1:  # an option (its own name, or --opt=value)
            what = f"option {a.split('=', 1)[0]!r}" if "=" not in a else a.split("=", 1)[0]
            check_text(what if "=" in a else a, f"argument {i + 1}")
        elif i and argv[i - 1].startswith("-") and len(argv[i - 1]) > 1:
            what = argv[i - 1]  # the value of the option before it
        else:
            what = f"argument {i + 1}"
        check_text(a, what)


def _command_of(argv: list[str]) -> str:
    """`` generate`` / `` taps record``: the command named in ``argv`` (read before parsing, for an error
    prefix), or '' when none is recognised."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] not in (*_MODULES, "tap-diff"):
        return ""
    if words[0] == "taps" and len(words) > 1 and words[1] in ("list", "record", "diff"):
        return f" taps {words[1]}"
    return f" {words[0]}"


def _check_empty_model(args) -> None:
    """An empty MODEL ('') would resolve to the current directory and be reported as '.'; refuse it as typed.

    Raises:
        InputError: a MODEL / --model argument that is the empty string.
    """
    from reference.errors import InputError
    if "" in (getattr(args, "model", None), getattr(args, "model_pos", None)):
        raise InputError("MODEL '': expected a checkpoint directory or a bundled fixture name, found an empty string")


def _print_traceback(e: BaseException) -> None:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)


def _outside_backend_raised(args, e: BaseException) -> str | None:
    """The spec of the ``module:Class`` backend (any ``--backend`` / ``--a`` / ``--b`` ... option of ``args``)
    whose own code the traceback of ``e`` passes through, or None (then the failure is not the backend's)."""
    import inspect
    files = {}
    # a list value: `parity --backend` given more than once
    vals = [v for val in vars(args).values() for v in (val if isinstance(val, list) else [val])]
    for val in vals:
        if not isinstance(val, str) or ":" not in val or "=" in val.split(":", 2)[1]:
            continue
        mod_name, _, rest = val.partition(":")
        mod = sys.modules.get(mod_name)
        cls = getattr(mod, rest.split(":", 1)[0], None) if mod is not None else None
        if not isinstance(cls, type):
            continue
        for c in cls.__mro__:  # the outside classes only: an inherited method of ours is not their code
            if c.__module__.split(".")[0] in ("parity", "reference", "engine", "taps", "builtins"):
                continue
            try:
                files[inspect.getsourcefile(c)] = val
            except (TypeError, OSError):
                pass
    tb = e.__traceback__
    found = None
    while tb is not None:  # the innermost outside frame decides
        f = tb.tb_frame.f_code.co_filename
        if f in files:
            found = files[f]
        tb = tb.tb_next
    return found


def main(argv: list[str] | None = None) -> int:
    """Run the ``qwen4exp`` command line.

    Returns:
        The command's exit code (:data:`reference.errors.EXIT_CODES`): a UserError is printed as one line
        ``qwen4exp <command>: error: ...`` and gives its ``exit_code`` (2 bad input; 4 output that could not
        be written); a write that failed for a full, read-only or failing disk, or memory exhausted, is 4;
        any other exception (a crash of qwen4exp, or a SystemExit raised by a plugin) is printed with its
        traceback and gives 4 -- never 0 or 1, which a CI gate would read as a verdict; 0 when stdout's
        reader went away (BrokenPipeError); 128 + signal number when interrupted (SIGINT 130, SIGTERM 143,
        SIGHUP 129: every output is then the old one or none). ``--traceback`` adds the stack to any error.
    """
    from reference.errors import EXIT_ENVIRONMENT, UserError
    argv = list(sys.argv[1:] if argv is None else argv)
    try:   # Ctrl-C while the command modules import (Numba, llvmlite: up to a second) is an interrupt, not a crash
        parser = build_parser()
    except KeyboardInterrupt:
        print(f"qwen4exp{_command_of(argv)}: interrupted", file=sys.stderr)
        return 130
    try:
        _check_argv(argv)
    except UserError as e:
        print(f"qwen4exp{_command_of(argv)}: error: {e}", file=sys.stderr)
        return e.exit_code
    args = parser.parse_args(argv)
    args.argv = list(argv)  # the command line as given (report.json ``reproduce``)
    show_tb = bool(getattr(args, "traceback", False))
    from parity.bench.runner import terminate_on_signals
    try:
        with terminate_on_signals():  # SIGTERM / SIGHUP unwind like Ctrl-C: temp outputs are removed
            _check_empty_model(args)
            rc = args.func(args)
    except BrokenPipeError:  # e.g. `qwen4exp taps list --json | head`: the reader went away, not an error
        _silence_stdout()
        return 0
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", None)  # parity.bench.runner.Terminated (SIGTERM, SIGHUP) carries its signal
        from reference.atomic import real_interrupt
        spec = None if signum is not None or real_interrupt() else _outside_backend_raised(args, e)
        if spec is not None:  # raised by the backend's code, no signal behind it: "backend raised", exit 1
            from parity.backends import BackendRaised
            err = BackendRaised(spec, e, "(no signal was received)")
            print(f"qwen4exp {args.command}: ERROR: {err}", file=sys.stderr)
            if show_tb:
                print(err.traceback, file=sys.stderr, end="")
            return err.exit_code
        what = "interrupted" if signum is None else f"terminated (signal {signum})"
        print(f"qwen4exp {args.command}: {what}", file=sys.stderr)
        return 128 + signum if signum else 130
    except BaseException as e:  # noqa: BLE001 - the boundary: every failure gets a documented code
        from parity.backends import BackendRaised
        from reference.atomic import WRITE_ERRNOS
        if not isinstance(e, (UserError, BrokenPipeError)):
            spec = _outside_backend_raised(args, e)
            if spec is not None:  # the outside backend's own code raised: the documented "backend raised" outcome
                e = BackendRaised(spec, e)
        if isinstance(e, BackendRaised):  # exit 1, one ERROR line; the backend's stack only with --traceback
            print(f"qwen4exp {args.command}: ERROR: {e}" + ("" if show_tb else " (--traceback prints its stack)"),
                  file=sys.stderr)
            if show_tb:
                print(e.traceback, file=sys.stderr, end="")
            return e.exit_code
        if isinstance(e, UserError):  # bad input (exit 2), or output that could not be written (exit 4)
            if show_tb:
                _print_traceback(e)
            print(f"qwen4exp {args.command}: error: {e}", file=sys.stderr)
            return e.exit_code
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:  # the environment, not a bug (`> /dev/full`)
            where = f" ({e.filename})" if e.filename else ""
            print(f"qwen4exp {args.command}: error: could not write output{where}: {e.strerror or e}",
                  file=sys.stderr)
            _silence_stdout()
            return EXIT_ENVIRONMENT
        if isinstance(e, MemoryError):
            print(f"qwen4exp {args.command}: error: out of memory ({e or 'MemoryError'})", file=sys.stderr)
            return EXIT_ENVIRONMENT
        if isinstance(e, SystemExit):  # argparse exits before this block: this one came from a backend / plugin
            print(f"qwen4exp {args.command}: error: something called sys.exit({e.code!r}) while the command ran "
                  f"(a backend or plugin?); the run did not complete", file=sys.stderr)
            if show_tb:
                _print_traceback(e)
            return EXIT_ENVIRONMENT
        _print_traceback(e)
        print(f"qwen4exp {args.command}: internal error: {type(e).__name__}: {e} (a bug of qwen4exp: the "
              f"traceback is above; exit {EXIT_ENVIRONMENT})", file=sys.stderr)
        return EXIT_ENVIRONMENT
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
    except OSError as e:  # e.g. stdout is /dev/full: the output did not reach its destination
        print(f"qwen4exp {args.command}: error: could not write output: {e.strerror or e}", file=sys.stderr)
        _silence_stdout()
        return EXIT_ENVIRONMENT
    return int(rc or 0)


def console_main() -> int:
    """The ``qwen4exp`` console script and ``python -m parity.cli``: :func:`main` in a process of its own.

    Once a signal has interrupted the command, an exception raised in a finalizer (``__del__``, reported through
    :data:`sys.unraisablehook`) is not printed. The signal's exception can land inside a constructor of a
    library's object (llvmlite's, while Numba compiles) and leave it half-built; its finalizer then fails when
    the unwound stack is freed -- after the one-line "terminated" message, as a traceback that says nothing about
    the run (exit code and outputs are right). Without a delivered signal, and for an interrupt's own exception
    (KeyboardInterrupt, Terminated) swallowed where it could not propagate, the previous hook reports as before.
    The hook stays installed until the process ends; callers of :func:`main` in-process keep theirs.

    Returns:
        :func:`main`'s exit code.
    """
    from reference.atomic import signal_delivered
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if signal_delivered() and not isinstance(unraisable.exc_value, KeyboardInterrupt):
            return  # a consequence of the interrupt, already reported as such
        previous(unraisable)
    sys.unraisablehook = hook
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
