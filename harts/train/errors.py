"""The error a run that cannot start raises: one line, naming the config field to change."""

from __future__ import annotations

__all__ = ["TrainError"]


class TrainError(ValueError):
    """A run that cannot go on as configured: `field` is the dotted path of the `TrainConfig`
    field to change (None where no one field is at fault); the message writes field paths
    in backquotes, as `ConfigError`'s do."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field
