"""Seeds of the tests' random draws: fresh every session, reproducible from a failure.

``tests/conftest.py`` fixes ``DASH_TEST_SALT`` once per session (unless the caller set it) and
prints it in pytest's header; a seed is crc32 of the test's own parts (``hash()`` of a str
changes per process) plus that salt, and every failure message names the seed and the salt
(``seed_tag``): rerun with the printed ``DASH_TEST_SALT`` to get the same inputs.
"""

from __future__ import annotations

import os
import zlib

# conftest.py sets the variable before any test module is imported; "0" only when this module is
# used outside pytest.
SALT = int(os.environ.get("DASH_TEST_SALT") or 0)


def seed_of(*parts) -> int:
    """A seed from ``parts`` and the session's salt."""
    return (zlib.crc32(repr(parts).encode()) + SALT) % 2**31


def seed_tag(seed: int) -> str:
    """What a failure message says about its inputs."""
    return f"seed={seed} (DASH_TEST_SALT={SALT})"
