"""Defaults that more than one layer needs, written once: the scenario schema and the policies read them."""

from __future__ import annotations

DEFAULT_BUDGETS_S: dict[str, float] = {"interactive": 3.0, "batch": 60.0}  # wait budget per tier
DEFAULT_BUDGET_S = 3.0  # wait budget of a tier that has none of its own
DEFAULT_HEADROOM = 0.9  # fraction of the pool maximum one gateway fills, leaving room for the others
# a retrying client's header: seconds since its first attempt at this request, which a gateway counts
# against the tier's budget as the simulated one does (a retry has spent that much of its wait already)
RETRY_ELAPSED_HEADER = "x-retry-elapsed-s"


def default_max_pool_gpu_s(gpus: int, budgets_s: dict[str, float], default_budget_s: float) -> float:
    """The pool's maximum in-flight work when none is set: available GPUs x the largest wait budget."""
    return gpus * max([default_budget_s, *budgets_s.values()])


DEFAULT_ENGINE_KIND = "continuous"  # an engine whose `kind` is left out batches continuously
