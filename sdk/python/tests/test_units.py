"""Pieces that need no server: the SSE parser, key quoting, problem decoding,
and that every problem code of the server has its error class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import idem
from idem._api import SSEMessage, SSEParser, error_from, retry_after, sf_string

STREAM = (
    "\ufeff: keep-alive comment\r\n"
    'id: 1\r\ndata: {"a": "line\u2028separator\u0085next"}\r\n\r\n'
    "id: 2\rdata: first\rdata:second\r\r"
    "data: no id line: keeps the last id\n\n"
    "id: bad\0id\ndata: x\n\n"
    "event: ignored\nretry: 10\nid\ndata\n\n"
    "id: 9\ndata: incomplete at the end"
).encode()

EXPECTED = [
    SSEMessage("1", '{"a": "line\u2028separator\u0085next"}'),
    SSEMessage("2", "first\nsecond"),
    SSEMessage("2", "no id line: keeps the last id"),
    SSEMessage("2", "x"),
    SSEMessage("", ""),
]


def test_sse_in_one_chunk() -> None:
    assert SSEParser().feed(STREAM) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_sse_split_anywhere(size: int) -> None:
    parser = SSEParser()
    out = []
    for i in range(0, len(STREAM), size):
        out += parser.feed(STREAM[i : i + size])
    assert out == EXPECTED


def test_sse_crlf_split_between_chunks_is_one_line_end() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\n\r") == [SSEMessage(None, "a")]
    assert parser.feed(b"\n") == []


def test_sf_strings() -> None:
    assert sf_string("abc") == '"abc"'
    assert sf_string('a"b\\c') == '"a\\"b\\\\c"'
    for bad in ["", "a b", "tab\t", "é", "k" * 256]:
        with pytest.raises(ValueError):
            sf_string(bad)


def test_problems_decode_to_their_class() -> None:
    body = (
        b'{"type":"x","title":"Unprocessable","status":422,"detail":"bound","code":"IDEMPOTENCY_CONFLICT",'
        b'"task_id":"t1","differing_fields":["/amount"]}'
    )
    e = error_from(422, {"x-request-id": "r1"}, body)
    assert isinstance(e, idem.IdempotencyConflictError)
    assert (e.status, e.code, e.task_id, e.differing_fields, e.request_id) == (
        422,
        "IDEMPOTENCY_CONFLICT",
        "t1",
        ["/amount"],
        "r1",
    )
    assert not e.retryable
    newer = error_from(409, {}, b'{"status":409,"detail":"new","code":"SOME_NEW_CODE"}')
    assert type(newer) is idem.IdemError and newer.code == "SOME_NEW_CODE"
    proxy = error_from(502, {"retry-after": "2"}, b"<html>bad gateway</html>")
    assert type(proxy) is idem.IdemError and proxy.code is None and proxy.retry_after == 2 and proxy.retryable
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0


def test_every_problem_code_of_the_server_has_its_class() -> None:
    openapi = json.loads((Path(__file__).resolve().parents[3] / "docs" / "openapi.json").read_text())
    codes = set(openapi["components"]["schemas"]["ProblemCode"]["enum"])
    assert codes and codes == set(idem.ERRORS_BY_CODE)


def test_amounts_carry_their_currency_beside_the_integer() -> None:
    at = "2026-01-01T00:00:00.000Z"
    d = idem.Delivery.from_json({"result": {}, "delivered_at": at, "charge": 100, "currency": "EUR"})
    assert (d.charge, d.currency) == (100, "EUR")
    # A server that does not send it, or a contract without a currency: None.
    assert idem.Delivery.from_json({"result": {}, "delivered_at": at, "charge": 100}).currency is None
    c = idem.Cancellation.from_json({"status": "too_late", "requested_at": at, "fee": 100, "currency": "JPY"})
    assert (c.fee, c.currency) == (100, "JPY")
    assert idem.Cancellation.from_json({"status": "requested", "requested_at": at, "currency": None}).currency is None
