"""During a layer-major prefill the pool gives up the experts of the layers already done first
and those of the layer under way last (``SlotTable.prefill_layer``)."""

from __future__ import annotations

from cachecd_engine.pool.slots import SlotTable


def _full(table: SlotTable, layout: dict[int, list[int]]) -> None:
    for layer, experts in layout.items():
        claim = table.claim(layer, experts, use=True)
        table.filled(claim.slots.values())


def _owners(table: SlotTable) -> set[tuple[int, int]]:
    return {key for key, _ in table.items()}


def test_layers_done_go_first_then_others_then_the_current_one() -> None:
    table = SlotTable(6)
    _full(table, {2: [0, 1], 0: [5, 6], 3: [7, 8]})
    for _ in range(3):  # the earlier layer's experts are the most used: the policy keeps them
        table.use(0, [5, 6])
    table.prefill_layer = 2
    _full(table, {2: [2, 3]})
    assert {(0, 5), (0, 6)}.isdisjoint(_owners(table))  # layer 0 is done: its slots went first
    _full(table, {2: [4]})
    assert (2, 0) in _owners(table) and (2, 1) in _owners(table)  # a later layer's gave way
    assert len({key for key in _owners(table) if key[0] == 3}) == 1
    table.prefill_layer = None


def test_without_a_pass_the_policy_decides() -> None:
    table = SlotTable(4)
    _full(table, {1: [0, 1], 0: [5, 6]})
    for _ in range(3):
        table.use(0, [5, 6])
    _full(table, {1: [2, 3]})
    assert {(0, 5), (0, 6)} <= _owners(table)  # the most used stay when no pass is under way
