"""The collectives of a compiled program, read from its HLO text: what the sharding tests assert
on (a Pallas kernel's operands gathered whole, a weight gathered where it should stay split)."""

import re

COLLECTIVE = r"= (\([^)]*\)|\S+) (all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)\("


def collectives(compiled) -> list[tuple[str, str]]:
    """``(result type, op)`` of each collective in a compiled program, e.g. ``("u8[1,32,128]{2,0,1}",
    "all-gather")``."""
    return re.findall(COLLECTIVE, compiled.as_text())
