"""The engine configurations the tests run every kind with, from the registry: each
shipped kind (``scheduler.KINDS``) with every combination of its options' ``examples``.
A new kind registered in ``batchlab.core.scheduler`` is tested by these tests with no edit here."""

from __future__ import annotations

import itertools
import math

from batchlab.core.scheduler import KINDS


def kind_configs(exclude: tuple[str, ...] = (), per_kind: int | None = None) -> list[tuple[str, dict]]:
    """(kind, options) for every kind and combination of example values (a budget below B
    is skipped). ``per_kind``: at most that many a kind, spread from the first (the edge
    cases) to the last, for tests on the real model."""
    configs = []
    for kind, cls in KINDS.items():
        if kind in exclude:
            continue
        names, values = [], []
        for name, (_, option) in cls.option_specs().items():
            if option is not None and option.examples:
                names.append(name)
                values.append(option.examples)
        mine = [dict(zip(names, combo)) for combo in itertools.product(*values)]
        mine = [o for o in mine if o.get("token_budget", math.inf) >= o.get("max_batch_size", 1)]
        if per_kind is not None and len(mine) > per_kind:
            mine = (
                [mine[round(i * (len(mine) - 1) / (per_kind - 1))] for i in range(per_kind)]
                if per_kind > 1
                else mine[-1:]
            )
        configs += [(kind, o) for o in mine]
    return configs
