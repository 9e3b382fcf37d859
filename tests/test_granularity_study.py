"""The granularity study's pure parts: where a needle sits in the context, and what a selection keeps of it."""

from __future__ import annotations

import torch

from kvresearch.ops.selection import keep_topk
from kvresearch.studies.granularity import needle_positions, scope_summary, selections


def test_the_needle_is_found_by_any_spelling_of_the_answer() -> None:
    ids = torch.tensor([5, 9, 1, 2, 3, 9, 1, 2])
    assert needle_positions(ids, [[7, 7], [1, 2, 3]]) == [2, 3, 4]  # the first spelling is absent
    assert needle_positions(ids, [[9, 1]]) == [1, 2]  # its first occurrence
    assert needle_positions(ids, [[4]]) == []


def test_a_head_holds_the_needle_only_with_every_token_of_it() -> None:
    scores = [torch.zeros(2, 10) for _ in range(2)]
    scores[0][0, [3, 4]] = 5.0  # layer 0, head 0 wants the needle (positions 3, 4)
    scores[1][1, 3] = 5.0  # layer 1, head 1 wants half of it
    per_head = scope_summary(keep_topk(scores, 0.2, "head"), [3, 4], 10)
    assert per_head["heads_with_needle"] == 0.25  # one of four heads keeps both tokens
    assert per_head["kept_share"] == {"min": 0.2, "median": 0.2, "max": 0.2}
    shared = scope_summary(keep_topk(scores, 0.2, "token_model"), [3, 4], 10)
    assert shared["heads_with_needle"] == 1.0  # both positions rank first by their best head: kept everywhere
    spread = scope_summary(keep_topk(scores, 0.1, "global"), [3, 4], 10)["kept_share"]
    assert spread["max"] >= 0.2 and spread["min"] == 0.0  # one budget: head 0 of layer 0 takes most, a head none


def test_rank_is_blind_to_a_head_whose_scores_run_higher_and_max_is_not() -> None:
    torch.manual_seed(1)
    scores = [torch.randn(2, 20)]
    shifted = [scores[0] + torch.tensor([[10.0], [0.0]])]  # head 0's scores all run 10 higher

    def kept(s: list[torch.Tensor], reduction: str) -> dict[str, list[list[torch.Tensor]]]:
        return selections(s, 0.25, ["token_layer"], [reduction], [None])

    by_rank = kept(scores, "rank")["token_layer/rank"][0][0].tolist()
    assert kept(shifted, "rank")["token_layer/rank"][0][0].tolist() == by_rank
    by_head0 = scores[0][0].topk(5).indices.sort().values.tolist()
    assert kept(shifted, "max")["token_layer"][0][1].tolist() == by_head0  # head 0 decides every position
    assert set(kept(shifted, "rank")) == {"token_layer", "token_layer/rank", "token_layer/threshold"}


def test_pages_add_a_scope_per_token_scope_and_page_size() -> None:
    torch.manual_seed(2)
    scores = [torch.randn(2, 20) for _ in range(2)]
    kept = selections(scores, 0.25, ["head", "token_layer", "token_model"], ["max"], [None, None], (1, 4))
    assert set(kept) == {"head", "token_layer", "token_model", "token_layer/page4", "token_model/page4"} | {
        "token_layer/threshold"
    }
    paged = kept["token_model/page4"][0][0].tolist()
    assert len(paged) == 8 and {p // 4 for p in paged} == {paged[0] // 4, paged[4] // 4}  # two whole pages


def test_the_threshold_at_token_layer_keeps_the_share_over_the_layers_unevenly() -> None:
    torch.manual_seed(3)
    scores = [torch.randn(2, 20), torch.randn(2, 20) + 1.0]  # layer 1's scores run higher: it keeps more
    kept = selections(scores, 0.25, ["token_layer"], ["max"], [None, None])["token_layer/threshold"]
    counts = [len(layer[0]) for layer in kept]
    assert sum(counts) == 10 and counts[1] > counts[0]  # a quarter of the 40 positions, more in layer 1
    assert all(torch.equal(layer[0], layer[1]) for layer in kept)  # one decision for both heads
    floor = min(float(scores[i][:, p].max()) for i, layer in enumerate(kept) for p in layer[0].tolist())
    dropped = [float(scores[i][:, p].max()) for i in range(2) for p in range(20) if p not in kept[i][0].tolist()]
    assert max(dropped) < floor  # every kept position clears what every dropped one misses
