"""User-facing error types shared by every package (each message names the thing, what was
expected and what was found), and the one exit-code contract of every ``qwen4exp`` command."""

# The exit codes of every qwen4exp command (README "Exit codes", `qwen4exp -h`). Defined once here, the
# ground floor, so the harness verdicts, the file writers and the CLI all use the same numbers.
EXIT_OK = 0            # success / agreement: every check passed
EXIT_DIVERGENCE = 1    # the backend disagrees with the reference, a control failed, or the backend raised in a case
EXIT_USAGE = 2         # usage or input error: bad arguments, model, prompts, a backend that cannot be opened
EXIT_INCONCLUSIVE = 3  # the run completed but its evidence does not support a verdict either way
EXIT_ENVIRONMENT = 4   # the run could not complete: disk full, device lost, out of memory, or a crash of qwen4exp

EXIT_CODES = {
    EXIT_OK: "pass / success",
    EXIT_DIVERGENCE: "divergence: a backend disagrees, a control failed, or the backend raised inside a case "
                     "(ERROR row)",
    EXIT_USAGE: "usage or input error (bad arguments, model, prompts, a backend that cannot be opened, an --out "
                "that cannot be written to), checked before the run; nothing is written",
    EXIT_INCONCLUSIVE: "inconclusive: the evidence supports no verdict",
    EXIT_ENVIRONMENT: "environment failure: output could not be written once the run had its results (disk "
                      "full, a location that became read-only), device lost, out of memory, or an internal error "
                      "(traceback printed)",
}


class UserError(Exception):
    """Base of every error caused by bad input rather than a bug. ``exit_code``: what the CLI exits with
    after printing it as one line (:data:`EXIT_USAGE`; :data:`EXIT_ENVIRONMENT` for output that could not be
    written)."""

    exit_code = EXIT_USAGE


class CheckpointError(UserError, ValueError):
    """Missing, mis-shaped, truncated or otherwise unreadable checkpoint data."""


class InputError(UserError, ValueError):
    """Bad token ids, prompts, files or arguments."""


class EnvironmentFailure(UserError, RuntimeError):
    """The machine, not the input: a device lost, memory exhausted. Printed as one line, exit
    :data:`EXIT_ENVIRONMENT`."""

    exit_code = EXIT_ENVIRONMENT


class InconclusiveError(UserError):
    """The run cannot reach a verdict because its evidence is invalid (the truth itself -- the reference's
    logits -- is NaN or infinite). Printed as one line, exit :data:`EXIT_INCONCLUSIVE`."""

    exit_code = EXIT_INCONCLUSIVE


def first_nonfinite(x):
    """``(position, value)`` of the first row of ``x`` (``[T, V]`` or ``[V]``) holding a NaN or an infinity, or
    None when every value is finite. ``value``: the first non-finite value of that row (nan, inf or -inf)."""
    import numpy as np
    a = np.asarray(x)
    if a.size == 0 or not np.issubdtype(a.dtype, np.floating):
        return None
    a2 = a.reshape(1, -1) if a.ndim == 1 else a.reshape(a.shape[0], -1)
    bad = ~np.isfinite(a2)
    if not bad.any():
        return None
    row = int(np.argmax(bad.any(axis=1)))
    return row, float(a2[row][bad[row]][0])
