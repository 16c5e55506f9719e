"""The library's one logger.

``PYFUSED_LOG=debug`` (or ``info``) turns on pyfused's own log lines on stderr without touching the
root logger; every decision that is not the user's (which method ``auto`` chose, why a fast path
was not taken) is logged at debug level through ``logger``.
"""
import logging
import os

logger = logging.getLogger("pyfused")

_level = os.environ.get("PYFUSED_LOG", "").strip().upper()
if _level:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[pyfused %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(getattr(logging, _level, logging.DEBUG))
