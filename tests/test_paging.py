"""The page-size benchmark's conversion: through its pages every request reads exactly the slots
it read before, and a shared prompt's full pages are stored once."""

import pytest
import torch

from bench.paging import to_pages, unpage
from scorer.planning import REGISTRY, Shape
from scorer.planning.base import AttentionCall


def _requests(c: AttentionCall) -> list[list[int]]:
    kvp = c.kv_indptr.tolist()
    return [c.kv_indices[kvp[i] : kvp[i + 1]].tolist() for i in range(c.num_requests)]


@pytest.mark.parametrize("scheme", sorted(REGISTRY))
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_every_request_reads_the_same_slots_through_its_pages(scheme: str, page_size: int) -> None:
    plan = REGISTRY[scheme].plan([Shape(37, (3, 16, 9)), Shape(8, (1,))])
    for p in plan.passes:
        paged = to_pages(p, page_size)
        for old, new in zip(p.calls, paged.pass_.calls, strict=True):
            assert new.page_size == page_size and len(new.last_page_len) == old.num_requests
            assert unpage(new, paged.slot_of) == _requests(old)
            assert torch.equal(new.qo_indptr, old.qo_indptr) and new.multi_item is old.multi_item


def test_a_shared_prompt_keeps_its_full_pages_shared() -> None:
    (p,) = REGISTRY["ragged"].plan([Shape(40, (7, 7, 7))]).passes
    paged = to_pages(p, 16)
    # pages 0-15 and 16-31 of the prompt once; per doc one page: prompt 32-39 + the doc's 7
    assert len(paged.slot_of) == 16 * (2 + 3)
    (c,) = paged.pass_.calls
    assert c.kv_indices.tolist() == [0, 1, 2, 0, 1, 3, 0, 1, 4] and c.last_page_len.tolist() == [15] * 3
    kv = torch.arange(p.num_rows, dtype=torch.float32)[:, None, None]
    assert paged.pool(kv, 16).shape == (5, 16, 1, 1)
