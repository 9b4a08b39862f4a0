"""User-facing error types shared by every package (each message names the thing, what was
expected and what was found)."""


class UserError(Exception):
    """Base of every error caused by bad input rather than a bug. ``exit_code``: what the CLI exits with
    after printing it as one line (2: bad input; 1 for output that could not be written)."""

    exit_code = 2


class CheckpointError(UserError, ValueError):
    """Missing, mis-shaped, truncated or otherwise unreadable checkpoint data."""


class InputError(UserError, ValueError):
    """Bad token ids, prompts, files or arguments."""
