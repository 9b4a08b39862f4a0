"""User-facing error types shared by every package (each message names the thing, what was
expected and what was found)."""


class UserError(Exception):
    """Base of every error caused by bad input rather than a bug."""


class CheckpointError(UserError, ValueError):
    """Missing, mis-shaped, truncated or otherwise unreadable checkpoint data."""


class InputError(UserError, ValueError):
    """Bad token ids, prompts, files or arguments."""
