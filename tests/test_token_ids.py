"""A message's token ids as one numpy array (TokenIds): read without a Python int per id, checked
with the field named, turned into the same Job as a tuple, carried over the link as their bytes,
and a long prompt of ids checked on the event loop."""

import asyncio
import threading

import numpy as np
import pytest

from scorer.request import Doc, InvalidInput, ScoreOptions, ScoreRequest
from scorer.server.convert import Counts, check_counts, request_from_proto
from scorer.server.link import _Frames, for_engine
from scorer.token_ids import SHORT, TokenIds
from scorer.v1 import scorer_pb2 as pb

PLAIN = pb.ScoreOptions(template="plain")


def parsed(msg: pb.ScoreDocsRequest) -> ScoreRequest:
    """``msg`` as the server reads it: its bytes parsed, then converted."""
    return request_from_proto(pb.ScoreDocsRequest.FromString(msg.SerializeToString()), "r")


def ids(n: int, start: int = 10) -> list[int]:
    return [start + i % 200 for i in range(n)]


def test_token_ids_read_as_the_tuple_they_replace():
    t = TokenIds([5, 6, 7, 8])
    assert len(t) == 4 and t[1] == 6 and t[-1] == 8 and type(t[1]) is int
    assert t[1:3] == (6, 7) and isinstance(t[1:3], TokenIds)
    assert list(t) == [5, 6, 7, 8] and t == (5, 6, 7, 8) and t == [5, 6, 7, 8]
    assert t != (5, 6, 7) and t != (5, 6, 7, 9) and t != "abcd"
    assert hash(t) == hash((5, 6, 7, 8))  # equal to the tuple, hashed as it
    assert t + (9,) == (5, 6, 7, 8, 9) and (4,) + t == (4, 5, 6, 7, 8)
    assert not TokenIds([]) and TokenIds([]) == ()
    with pytest.raises(ValueError):
        t.array[0] = 1  # read-only: a Job's ids never change under it
    assert np.asarray(t) is t.array and np.asarray(t, dtype=np.int64).tolist() == [5, 6, 7, 8]
    copied = np.array(t)
    copied[0] = 1
    assert t[0] == 5


def test_a_message_long_id_list_is_copied_to_one_array_and_a_short_one_to_a_tuple():
    long_ids = ids(SHORT + 1)
    msg = pb.ScoreDocsRequest.FromString(
        pb.ScoreDocsRequest(
            prompt_token_ids=long_ids, docs=[pb.Doc(token_ids=[5, 6]), pb.Doc(token_ids=long_ids)]
        ).SerializeToString()
    )
    req = request_from_proto(msg, "r")
    assert isinstance(req.prompt_token_ids, TokenIds) and req.prompt_token_ids == long_ids
    assert type(req.docs[0].token_ids) is tuple and req.docs[0].token_ids == (5, 6)
    assert isinstance(req.docs[1].token_ids, TokenIds) and req.docs[1].token_ids == long_ids
    msg.prompt_token_ids[0] = 7  # a copy: the message's container is not read again
    assert req.prompt_token_ids[0] == long_ids[0]


def test_ids_from_a_message_make_the_job_a_tuple_makes(engine):
    docs = [ids(3, 20), ids(SHORT + 40, 30), ids(7, 40)]
    msg = pb.ScoreDocsRequest(
        prompt_token_ids=ids(1000),
        docs=[pb.Doc(id=f"d{i}", token_ids=d) for i, d in enumerate(docs)],
        options=PLAIN,
    )
    from_msg = engine.tokenize(parsed(msg))
    from_tuples = engine.tokenize(
        ScoreRequest(
            "",
            [Doc(id=f"d{i}", token_ids=tuple(d)) for i, d in enumerate(docs)],
            prompt_token_ids=tuple(ids(1000)),
            options=ScoreOptions(template="plain"),
        )
    )
    assert isinstance(from_msg.prefix_ids, TokenIds) and isinstance(from_tuples.prefix_ids, TokenIds)
    assert from_msg.prefix_ids == from_tuples.prefix_ids == ids(1000)
    assert from_msg.items == from_tuples.items and all(type(i) is tuple for i in from_msg.items)
    assert from_msg.shape == from_tuples.shape and from_msg.scheme == from_tuples.scheme


def bad_long_ids(vocab: int) -> dict:
    """name -> (the request, the field named, the start of its message); every id list is longer
    than SHORT, so numpy checks it."""
    doc = pb.Doc(token_ids=[5, 6])
    return {
        "prompt id == vocab": (
            parsed(
                pb.ScoreDocsRequest(prompt_token_ids=ids(300) + [vocab] + ids(5), docs=[doc], options=PLAIN)
            ),
            "prompt_token_ids",
            f"prompt_token_ids: token id {vocab} outside the vocabulary of {vocab}",
        ),
        "doc id past vocab": (
            parsed(
                pb.ScoreDocsRequest(
                    prompt_token_ids=[1], docs=[doc, pb.Doc(token_ids=ids(200) + [vocab + 5])]
                )
            ),
            "docs[1].token_ids",
            f"docs[1].token_ids: token id {vocab + 5} outside",
        ),
        "a caller's negative id": (
            ScoreRequest("", [Doc(token_ids=(5,))], prompt_token_ids=(*ids(200), -1), options=ScoreOptions()),
            "prompt_token_ids",
            "prompt_token_ids: token id -1 outside",
        ),
        "a caller's id past int64": (
            ScoreRequest(
                "", [Doc(token_ids=(*ids(200), 10**30))], prompt_token_ids=(1,), options=ScoreOptions()
            ),
            "docs[0].token_ids",
            f"docs[0].token_ids: token id {10**30} outside",
        ),
        "no prompt": (
            parsed(pb.ScoreDocsRequest(docs=[doc], options=PLAIN)),
            "prompt",
            "prompt: empty prompt",
        ),
        "an empty doc": (
            parsed(pb.ScoreDocsRequest(prompt_token_ids=ids(300), docs=[doc, pb.Doc(id="x")], options=PLAIN)),
            "docs[1].text",
            "docs[1].text: empty document",
        ),
    }


@pytest.mark.parametrize("case", list(bad_long_ids(1)))
def test_bad_ids_are_refused_naming_the_field(engine, case):
    vocab = engine.limits.vocab_size
    req, field, message = bad_long_ids(vocab)[case]
    with pytest.raises(InvalidInput) as caught:
        engine.tokenize(req)
    assert caught.value.field == field and str(caught.value).startswith(message), str(caught.value)


def test_too_many_prompt_ids_are_refused_before_they_are_copied_and_after(engine):
    positions = engine.limits.max_positions
    msg = pb.ScoreDocsRequest(prompt_token_ids=ids(positions), docs=[pb.Doc(token_ids=[5])], options=PLAIN)
    with pytest.raises(InvalidInput, match="leave no room") as caught:
        check_counts(Counts.of(msg), engine.limits)
    assert caught.value.field == "prompt_token_ids"
    with pytest.raises(InvalidInput, match="leave no room") as caught:
        engine.tokenize(parsed(msg))  # a caller past the counts (Ray's, the Python API) meets the same limit
    assert caught.value.field == "prompt"


class Wire:
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


def test_the_link_carries_a_prompt_of_ids_as_its_bytes(engine):
    msg = pb.ScoreDocsRequest(
        prompt_token_ids=ids(3000), docs=[pb.Doc(id="a", token_ids=[5, 6, 7])], options=PLAIN
    )
    job = engine.tokenize(parsed(msg))
    got = []
    sender = _Frames(lambda end, kind, value: None, lambda end: None)
    receiver = _Frames(lambda end, kind, value: got.append((kind, value)), lambda end: None)
    sender.transport = Wire()
    sender.send("score", (4, for_engine(job), None, "r"))
    wire = b"".join(sender.transport.written)
    assert job.prefix_ids.data in wire  # the ids' 4 bytes each, verbatim: no pickled int per id
    assert len(wire) < len(job.prefix_ids.data) + 3000
    for at in range(0, len(wire), 1000):  # as the socket delivers it, in pieces
        receiver.data_received(wire[at : at + 1000])
    [(kind, (call_id, sent, deadline, request_id))] = got
    assert (kind, call_id, deadline, request_id) == ("score", 4, None, "r")
    assert isinstance(sent.prefix_ids, TokenIds) and sent.prefix_ids == job.prefix_ids
    assert sent.items == job.items and sent.shape == job.shape and sent.scheme == job.scheme


def test_a_long_prompt_of_message_ids_is_checked_on_the_loop(engine):
    """Checking a message's long id list costs numpy's min and max: a call of a 4,000-id prompt
    and 32 short docs stays on the event loop, where the same ids as a tuple (a caller's, checked
    one by one) go to a tokenizer thread, as do many docs."""
    from scorer.server.batcher import BatchPolicy
    from scorer.server.scoring import ScoringService

    docs = [pb.Doc(id=f"d{i}", token_ids=[5, 6, 7, 8]) for i in range(32)]
    long = parsed(pb.ScoreDocsRequest(prompt_token_ids=ids(4000), docs=docs, options=PLAIN))
    as_tuple = ScoreRequest(
        "", long.docs, prompt_token_ids=tuple(long.prompt_token_ids), options=long.options
    )
    many = parsed(pb.ScoreDocsRequest(prompt_token_ids=ids(10), docs=docs * 10, options=PLAIN))
    threads = []

    async def scenario():
        service = ScoringService(engine, BatchPolicy())
        real = service._tokenize
        service._tokenize = lambda *a: threads.append(threading.current_thread().name) or real(*a)
        jobs = [(await service.tokenize(r))[0] for r in (long, as_tuple, many)]
        await service.close()
        return jobs

    jobs = asyncio.run(scenario())
    assert threads[0] == threading.main_thread().name
    assert threads[1].startswith("tokenize") and threads[2].startswith("tokenize")
    assert jobs[0].prefix_ids == jobs[1].prefix_ids and jobs[0].items == jobs[1].items


def test_the_batch_ids_lay_out_long_prompts_as_arrays_and_docs_as_tuples():
    """``engine.logical_tokens``: each call's prompt (from ``cached`` on) then its docs, ids and
    positions, the same whether a chunk is a ``TokenIds`` (read as one array) or a tuple."""
    import random
    from itertools import chain
    from types import SimpleNamespace

    import torch

    from scorer.engine import logical_tokens
    from scorer.token_ids import token_ids

    rng = random.Random(1)
    for _ in range(50):
        batch = [
            SimpleNamespace(
                prefix_ids=token_ids([rng.randrange(2**32) for _ in range(rng.choice([0, 5, 129, 700]))]),
                items=[
                    token_ids([rng.randrange(2**32) for _ in range(rng.choice([1, 129]))])
                    for _ in range(rng.randint(1, 3))
                ],
            )  # fmt: skip
            for _ in range(rng.randint(1, 3))
        ]
        cached = [rng.randint(0, len(j.prefix_ids)) for j in batch]
        ids, pos = logical_tokens(batch, torch.device("cpu"), cached)
        chunks = [c for j, n in zip(batch, cached, strict=True) for c in (j.prefix_ids[n:], *j.items)]
        assert ids.tolist() == list(chain.from_iterable(chunks))
        starts = [
            s for j, n in zip(batch, cached, strict=True) for s in (n, *[len(j.prefix_ids)] * len(j.items))
        ]
        assert pos.tolist() == [s + k for c, s in zip(chunks, starts, strict=True) for k in range(len(c))]
