"""protocol.terminal_stream's output line, taken apart without decoding its text: json_string gives
json.dumps's literal for any text, encode_output the same bytes as `encode` of the frame's dict,
and output_literal the data's literal from such a line, and nothing from any other line."""

from __future__ import annotations

import json
import random

from protocol.terminal_stream import encode, encode_output, json_string, output_literal

TEXTS = [
    "",
    "plain",
    'quotes " and \\ backslashes \\" \\\\"',
    "lines\r\n\ttabs\x08\x1b[01;34mcolours\x1b[0m",
    "rare controls \x00\x01\x0c\x1f and \x7f",
    "é, 中文, \u2028\u2029, 🙂",
    "lone \ud800 surrogate",
    'a","offset":1,"n":2}',
]


def texts() -> list[str]:
    rng = random.Random(35)
    alphabet = [chr(c) for c in range(0, 128)] + ["é", "中", "🙂", "\u2028"]
    return TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40))) for _ in range(3000)]


def test_json_string_is_the_literal_json_dumps_gives_for_any_text():
    for text in texts():
        assert json_string(text) == json.dumps(text, ensure_ascii=False), repr(text)


def test_an_output_line_is_encodes_bytes_and_gives_back_its_data_as_a_literal_that_decodes_to_it():
    for text in texts():
        if "\ud800" in text:  # not UTF-8: no terminal output holds one (the pipe decodes with "replace")
            continue
        line = encode_output(text, 1234, 5)
        assert line == encode({"type": "terminal.output", "data": text, "offset": 1234, "n": 5})
        literal = output_literal(line, json.loads(line))
        assert literal is not None and json.loads(literal) == text
        assert json.loads('{"type": "output", "data": ' + literal + "}") == {"type": "output", "data": text}


def test_lines_of_another_layout_give_no_literal_and_are_decoded_whole():
    others = [
        encode({"type": "terminal.output", "data": "scrollback"}),  # no offset
        encode({"type": "terminal.output", "offset": 3, "n": 1, "data": "keys in another order"}),
        encode({"type": "terminal.output", "data": "x", "extra": "y", "offset": 3, "n": 1}),
        encode({"type": "terminal.exit", "code": 0}),
        # keys written twice, json.loads keeping the last: the slice before the offset is not one string
        b'{"type":"terminal.output","data":"x","type":"terminal.output","offset":1,"n":2}\n',
        b'{"type":"terminal.output","data":"x","data":"y","offset":1,"n":2}\n',
        b'{"type":"terminal.output","data":"x","n":9,"offset":1,"n":2}\n',
    ]
    for line in others:
        assert output_literal(line, json.loads(line)) is None, line
