"""Text normalisation rules, as one DuckDB SQL expression and a Python twin that gives identical results.

The SQL form runs over whole tables in the store (millions of rows in seconds); the Python form states the
rules plainly and lets tests prove the two agree. The rules are part of the extraction key, so `rules_id`
must change whenever the output of either form could change.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

REJECT_NULL = "null text"
REJECT_EMPTY = "empty after normalisation"
REJECT_NUL = "contains a NUL character"

# Exactly the code points for which Python's str.isspace() is true, as inclusive ranges. Written out
# because RE2's \s is ASCII-only; tests check this list against str.isspace().
WHITESPACE_RANGES = (
    (0x09, 0x0D),
    (0x1C, 0x20),
    (0x85, 0x85),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
)


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    """A regex class of literal characters, which RE2 (DuckDB) and Python's re read the same way."""
    return "[" + "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in ranges) + "]"


WHITESPACE_CLASS = _char_class(WHITESPACE_RANGES)
_RUN = WHITESPACE_CLASS + "+"
# Whitespace other than a plain space, or two spaces in a row: text without either has nothing to collapse.
# Checking first is ~3x cheaper in DuckDB than always running regexp_replace, as most prompts are single-spaced.
_NOT_SPACE = tuple((a, b - 1) if b == 0x20 else (a, b) for a, b in WHITESPACE_RANGES)
_NEEDS_COLLAPSE = _char_class(_NOT_SPACE) + "|  "
_RUN_RE = re.compile(_RUN)


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class NormaliseRules:
    """NFC, collapse whitespace runs to one space and trim are always on; `remove_period` also strips
    trailing dots and spaces (so "Hello world." and "Hello world" become one prompt)."""

    remove_period: bool = False

    @property
    def rules_id(self) -> str:
        """Stable name of the rules; part of the extraction key."""
        return "nfc+trim+ws+rstrip_period" if self.remove_period else "nfc+trim+ws"

    def sql(self, column_sql: str) -> str:
        """DuckDB expression giving the normalised text of `column_sql` (NULL stays NULL)."""
        nfc = f"nfc_normalize({column_sql})"
        collapsed = (
            f"CASE WHEN regexp_matches({nfc}, {_sql_literal(_NEEDS_COLLAPSE)}) "
            f"THEN regexp_replace({nfc}, {_sql_literal(_RUN)}, ' ', 'g') ELSE {nfc} END"
        )
        out = f"trim({collapsed})"
        if self.remove_period:
            out = f"rtrim({out}, '. ')"
        return out

    def apply(self, text: str) -> str:
        """Python reference of `sql`: same steps, same order."""
        out = _RUN_RE.sub(" ", unicodedata.normalize("NFC", text)).strip(" ")
        if self.remove_period:
            out = out.rstrip(". ")
        return out


def prompt_hash(text: str) -> str:
    """SHA-256 hex of the UTF-8 bytes of normalised text; equals DuckDB's sha256() of the same string."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
