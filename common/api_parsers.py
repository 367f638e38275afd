"""The API's JSON parser: DRF's, with a limit on nesting.

Python's json module recurses once per nested array or object, so a body nested about 1,000
deep (`[[[[…]]]]`, 2 KB) raised RecursionError: a 500. Bodies are scanned first (only those
with more brackets than the limit allows, at C speed otherwise) and refused when nested deeper
than MAX_DEPTH levels, naming where: `{"resources": {"x": [[[…]]]}}` → 400 with field_errors
`{"resources.x": ["nested deeper than 32 levels"]}`. No request of this API nests more than a
few levels.
"""

from __future__ import annotations

import codecs
import re

from rest_framework import exceptions, parsers
from rest_framework.utils import json

MAX_DEPTH = 32
TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"

# A JSON string (a key when a colon follows it) or a bracket; other tokens do not change the depth.
_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"(?:\s*:)?|[\[\]{}]')


def too_deep(text: str, *, limit: int = MAX_DEPTH) -> str | None:
    """Where JSON `text` first nests deeper than `limit` levels: the dotted keys leading there
    ("resources.x"; array positions are left out; "" when no key leads there, as in a body
    that is itself `[[[…]]]`), or None when it does not. Malformed text is scanned as far as it
    goes (the parser then refuses it)."""
    if text.count("[") + text.count("{") <= limit:
        return None
    keys: list[str] = []  # per open array or object: the key it is the value of ("" in an array)
    key = ""
    for match in _TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            keys.append(key)
            if len(keys) > limit:
                return ".".join(k for k in keys if k)
            key = ""
        elif token in ("]", "}"):
            if keys:
                keys.pop()
            key = ""
        elif token.endswith(":"):
            raw = token[:-1].rstrip()
            try:
                key = json.loads(raw)
            except ValueError:
                key = raw[1:-1]
    return None


class DepthLimitedJSONParser(parsers.JSONParser):
    """DRF's JSONParser (same media type, same strict constants: NaN and Infinity are refused),
    refusing bodies nested deeper than MAX_DEPTH levels: a ValidationError naming the dotted
    key path (400, `field_errors`), or a ParseError when no key leads there."""

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = parsers.get_encoding(parser_context or {})  # type: ignore[attr-defined]  # in DRF, not its stubs
        try:
            text = codecs.getreader(encoding)(stream).read()
        except ValueError as exc:  # UnicodeDecodeError; get_encoding refuses codecs that are not text
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        where = too_deep(text)
        if where:
            raise exceptions.ValidationError({where: [TOO_DEEP]})
        if where == "":
            raise exceptions.ParseError(f"JSON parse error - the body is {TOO_DEEP}")
        try:
            return json.loads(text, parse_constant=json.strict_constant if self.strict else None)
        except ValueError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        except RecursionError:  # where the scan read malformed text differently: still a 400, not a 500
            raise exceptions.ParseError(f"JSON parse error - the body is {TOO_DEEP}") from None
