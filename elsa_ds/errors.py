"""The one exception type users see."""
from __future__ import annotations


class ElsaError(Exception):
    """A problem with the user's input or environment: the message says what is wrong and how to fix it.

    Entry points print it as one line on stderr and exit with code 2.
    """
