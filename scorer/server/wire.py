"""The counts of a serialized ScoreDocsRequest, read off its wire format before it is parsed.

Protobuf's parser holds the interpreter lock for the whole message: a 40 MB message of 20M
prompt token ids held the event loop ~0.3 s on a 2-core VM before the limits could refuse it.
Here a large message's fields are walked by their lengths alone (the docs, a few fields each),
and a packed list of token ids is counted as the bytes that end a varint (below 0x80), by numpy
without a copy: ~20 ms for that message. Only the options are parsed, a small message.

A message in any other form (token ids not packed, which protobuf's parsers accept too; a field
of an unknown wire type; a length past the end) gives None: the caller parses it and checks the
counts on the parsed message.
"""

from __future__ import annotations

import numpy as np

from ..v1 import scorer_pb2 as pb
from .convert import Counts

VARINT, I64, LEN, I32 = 0, 1, 2, 5
DOCS, OPTIONS, REQUEST_ID, PROMPT_TOKEN_IDS = 2, 3, 5, 6  # ScoreDocsRequest's fields
DOC_ID, DOC_TOKEN_IDS = 1, 3  # Doc's


class _Irregular(Exception):
    pass


def counts(data: bytes, max_docs: int) -> Counts | None:
    """``data``'s counts, None where it is not in the form read here. Past ``max_docs`` docs the
    rest are counted, not read (the call is refused for their number)."""
    try:
        return _counts(memoryview(data), max_docs)
    except _Irregular:
        return None


def _counts(data: memoryview, max_docs: int) -> Counts:
    options = bytearray()
    prompt_ids = request_id = 0
    doc_ids: list[int] = []
    id_bytes: list[int] = []
    for field, span in _fields(data, 0, len(data)):
        if field == DOCS:
            if len(doc_ids) < max_docs:
                ids, id_size = _doc(data, *span)
            else:
                ids, id_size = 0, 0
            doc_ids.append(ids)
            id_bytes.append(id_size)
        elif field == OPTIONS:
            options += data[span[0] : span[1]]  # occurrences merge, as concatenated messages do
        elif field == REQUEST_ID:
            request_id = span[1] - span[0]
        elif field == PROMPT_TOKEN_IDS:
            prompt_ids += _packed(data, *span)
    try:
        parsed = pb.ScoreOptions.FromString(bytes(options))
    except Exception:
        raise _Irregular from None
    return Counts(parsed, prompt_ids, doc_ids, id_bytes, request_id)


def _doc(data: memoryview, start: int, end: int) -> tuple[int, int]:
    ids = id_size = 0
    for field, (a, b) in _fields(data, start, end):
        if field == DOC_ID:
            id_size = b - a
        elif field == DOC_TOKEN_IDS:
            ids += _packed(data, a, b)
    return ids, id_size


def _fields(data: memoryview, pos: int, end: int):
    """(field number, (start, end) of its value) of each length-delimited field in
    ``data[pos:end]``; other fields skipped; raises _Irregular for a varint of token ids."""
    while pos < end:
        key, pos = _varint(data, pos, end)
        field, wire = key >> 3, key & 7
        if wire == LEN:
            size, pos = _varint(data, pos, end)
            if pos + size > end:
                raise _Irregular
            yield field, (pos, pos + size)
            pos += size
        elif wire == VARINT:
            if field in (PROMPT_TOKEN_IDS, DOC_TOKEN_IDS):  # token ids one by one: parsed instead
                raise _Irregular
            _, pos = _varint(data, pos, end)
        elif wire in (I64, I32):
            pos += 8 if wire == I64 else 4
        else:
            raise _Irregular
    if pos != end:
        raise _Irregular


def _varint(data: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Irregular


def _packed(data: memoryview, start: int, end: int) -> int:
    """The varints of a packed field: the bytes that end one (below 0x80)."""
    if start == end:
        return 0
    values = np.frombuffer(data, np.uint8, end - start, start)
    if values[-1] >= 0x80:
        raise _Irregular
    return int(np.count_nonzero(values < 0x80))
