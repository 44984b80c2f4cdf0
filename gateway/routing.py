"""Which data-parallel rank an unpinned request goes to (sans-IO).

Policies (``engine-gateway serve --routing``; without the flag: ``cache`` with two or more
data-parallel ranks, ``load`` with one, and ``load`` where ``cache`` cannot run, logged):

- ``load``: vLLM's own DP balancer, unchanged (the gateway leaves the rank to it).
- ``round-robin``: ranks in turn.
- ``cache``: prefix-cache aware. For each rank r with the prompt's matched prefix blocks
  m(r) (from ``PrefixIndex``, capped at the blocks vLLM can reuse: ``(len - 1) //
  block_size``, it always computes the last token) out of the prompt's B full blocks, and
  vLLM's own load score L(r) (``max(clients * in_flight, waiting + running) + waiting * 6 *
  max(0, kv_usage - 0.5)``, as ``DPLBAsyncMPClient`` scores it)::

      cost(r) = L(r) - prefix_weight * m(r) / B

  The rank of least cost wins (ties: least load, then in turn, as vLLM rotates ties): a
  whole-prompt hit is worth ``prefix_weight`` queued requests. Where no rank holds a block of the
  prompt, a request with a ``routing_key`` goes where that key's last request went
  (sticky), else to the least loaded rank, which the key then sticks to. **Balance
  guard**: if the chosen rank's load exceeds ``guard_ratio * min_load + guard_slack``,
  the least loaded rank takes the request instead. A rank whose index is unsynced (a gap
  being refilled, a restart) counts as holding none of the prompt, so the other ranks'
  matches still place requests; if every rank's is unsynced, or the hashes failed their
  check, the request goes by load alone (``fallback``).

Where ``cache`` reads its matches (``--routing-index``, default ``default_routing_index``;
the other policies keep an index too, for PrefixQuery: the events one where the engines
publish KV events, else the approximate one):
``approximate`` (one gateway's default), the prompts this gateway itself placed on each rank
and the blocks their outputs filled (``ApproximateIndex``: no events, so no cost on the
engines, but a guess); or ``events`` (the default of a group of gateways, and of
``RoutingConfig`` for code that embeds the engine), the engines' KV events
(``PrefixIndex``: exact, and every gateway sees every rank).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ROUTING_INDEXES",
    "ROUTING_POLICIES",
    "Decision",
    "Router",
    "RoutingConfig",
    "default_routing_index",
    "reusable_blocks",
]

ROUTING_POLICIES = ("load", "cache", "round-robin")
ROUTING_INDEXES = ("events", "approximate")
REASONS = ("matched", "sticky", "load", "balance_guard", "fallback", "round_robin")


def default_routing_index(gateway_count: int) -> str:
    """``--routing-index`` when not given: ``approximate`` for one gateway (no KV events:
    nothing on the engines' busy loops), ``events`` for a group of gateways, which then all
    read the same engines' events and predict the same matches."""
    return "events" if gateway_count > 1 else "approximate"


def reusable_blocks(matched: int, prompt_len: int, block_size: int) -> int:
    """Of ``matched`` cached leading blocks, those vLLM reuses for a prompt of
    ``prompt_len`` tokens: it always computes the last token."""
    return min(matched, max(0, (prompt_len - 1) // block_size))


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """``--routing`` and the ``cache`` policy's knobs (see the module docstring)."""

    policy: str = "load"
    prefix_weight: float = 16.0
    guard_ratio: float = 1.5
    guard_slack: float = 8.0
    sticky_keys: int = 100_000  # routing keys remembered (least recently used dropped)
    sticky_keys_per_client: int = 4096  # of one client's (its key's part before ":")
    # Prompt blocks hashed to match one request or PrefixQuery, at most (each costs a few
    # microseconds of the gateway's loop; matching stops sooner, at the first block no
    # rank holds). Ranks that both hold more than this tie there, and load decides.
    max_prefix_blocks: int = 1024
    # The policy was the default, not asked for with --routing: where ``cache`` cannot run
    # (a rank publishes no KV events), the gateway routes by load and says so rather than
    # refuse to start.
    by_default: bool = False
    # Where ``cache`` reads which rank holds what (see the module docstring).
    index: str = "events"

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}")
        if self.index not in ROUTING_INDEXES:
            raise ValueError(f"routing index must be one of {ROUTING_INDEXES}")

    @classmethod
    def from_args(cls, args: Any) -> RoutingConfig:
        """From ``engine-gateway serve``'s --routing flags (an argparse Namespace)."""
        ratio, slack = args.routing_guard
        return cls(
            args.routing,
            args.routing_prefix_weight,
            ratio,
            slack,
            max_prefix_blocks=args.routing_max_blocks,
            by_default=getattr(args, "routing_by_default", False),
            index=getattr(args, "routing_index", None)
            or default_routing_index(getattr(args, "gateway_count", 1)),
        )


@dataclasses.dataclass(frozen=True)
class Decision:
    rank: int | None  # None: vLLM's balancer decides
    reason: str
    predicted_blocks: int = 0  # blocks of the prompt the chosen rank should find cached


class Router:
    """Chooses ranks; counts its decisions by reason."""

    def __init__(self, ranks: int, config: RoutingConfig):
        self.ranks = ranks
        self.config = config
        self.decisions: collections.Counter[str] = collections.Counter()
        self._next = 0
        self._sticky: collections.OrderedDict[str, int] = collections.OrderedDict()
        # Per owner (the gateway prefixes each client's keys with its identity and ":"),
        # its keys in use order: one client cannot push every other client's keys out.
        self._owned: dict[str, collections.OrderedDict[str, None]] = {}

    def choose(
        self,
        matched: Sequence[int | None] | None,
        loads: Sequence[float],
        prompt_len: int,
        block_size: int,
        routing_key: str | None = None,
    ) -> Decision:
        """``matched``: per rank, the prompt's leading blocks cached there, None where the
        index is unsynced (or ``matched`` None: no usable index); ``loads``: vLLM's load
        score per rank."""
        policy = self.config.policy
        if policy == "load":
            decision = Decision(None, "load")
        elif policy == "round-robin":
            decision = Decision(self._next % self.ranks, "round_robin")
            self._next += 1
        else:
            decision = self._by_cache(matched, loads, prompt_len, block_size, routing_key)
        self.decisions[decision.reason] += 1
        return decision

    def _by_cache(
        self,
        matched: Sequence[int | None] | None,
        loads: Sequence[float],
        prompt_len: int,
        block_size: int,
        routing_key: str | None,
    ) -> Decision:
        start = self._next % self.ranks  # ties go in turn (a turn passes when used)
        order = [(start + i) % self.ranks for i in range(self.ranks)]
        least = min(order, key=lambda r: loads[r])
        if matched is None or all(m is None for m in matched) or block_size <= 0:
            self._next += 1
            return Decision(least, "fallback")
        # An unsynced rank's blocks are unknown: counted as none (as after a reset), so
        # the synced ranks' matches still place requests while one rank catches up.
        usable = [reusable_blocks(m or 0, prompt_len, block_size) for m in matched]
        # The share of the prompt cached, over the blocks matching looks at (at most
        # max_prefix_blocks: a long prompt cached to the cap counts as a whole hit).
        blocks = max(1, min(prompt_len // block_size, self.config.max_prefix_blocks))
        weight = self.config.prefix_weight
        if max(usable) > 0:
            costs = [loads[r] - weight * usable[r] / blocks for r in range(self.ranks)]
            best = min(order, key=lambda r: (costs[r], loads[r]))
            reason = "matched" if usable[best] > 0 else "load"
        elif routing_key is not None and routing_key in self._sticky:
            best, reason = self._sticky[routing_key], "sticky"
        else:
            best, reason = least, "load"
        if loads[best] > self.config.guard_ratio * loads[least] + self.config.guard_slack:
            best, reason = least, "balance_guard"
        if reason != "matched" and reason != "sticky":
            self._next += 1
        if routing_key is not None:
            self._remember(routing_key, best)
        return Decision(best, reason, usable[best])

    def _remember(self, routing_key: str, rank: int) -> None:
        sticky = self._sticky
        sticky[routing_key] = rank
        sticky.move_to_end(routing_key)
        owner = routing_key.partition(":")[0] if ":" in routing_key else ""
        owned = self._owned.setdefault(owner, collections.OrderedDict())
        owned[routing_key] = None
        owned.move_to_end(routing_key)
        while len(owned) > self.config.sticky_keys_per_client:
            sticky.pop(owned.popitem(last=False)[0], None)
        while len(sticky) > self.config.sticky_keys:
            oldest, _ = sticky.popitem(last=False)
            oldest_owner = oldest.partition(":")[0] if ":" in oldest else ""
            keys = self._owned.get(oldest_owner)
            if keys is not None:
                keys.pop(oldest, None)
                if not keys:
                    del self._owned[oldest_owner]
