"""The package logger. ``COMERA_LOG=debug|info|warning`` switches a stderr handler on.

``TORCH_LOGS`` rejects names it does not know, so we use plain ``logging``
under the ``comera_compile`` logger and an environment variable of our own. Where the application
has a root handler of its own that takes the record (torchtitan's, ``logging.basicConfig``), the
record goes there only, in the application's format, not twice.
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "COMERA_LOG"
logger = logging.getLogger("comera_compile")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _EnvHandler(logging.StreamHandler):
    """stderr, unless the record also reaches a root handler of the application's that would print it."""

    def emit(self, record: logging.LogRecord) -> None:
        if logger.propagate and any(record.levelno >= h.level for h in logging.getLogger().handlers):
            return
        super().emit(record)


def _configure_from_env() -> None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return
    if value in ("1", "true", "on"):
        value = "info"
    level = _LEVELS.get(value)
    if level is None:
        raise ValueError(f"{ENV_VAR}={value!r} is not a log level; valid values: {sorted(_LEVELS)} (or 1)")
    if not any(getattr(h, "_comera", False) for h in logger.handlers):
        handler = _EnvHandler()
        handler.setFormatter(logging.Formatter("[comera_compile %(levelname)s] %(message)s"))
        handler._comera = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level)


_configure_from_env()
