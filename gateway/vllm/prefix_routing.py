"""Prefix-cache-aware routing over data-parallel ranks, mixed into ``VllmEngine``.

Owns the ``Router`` (gateway/routing.py), the ``PrefixIndex`` and the ``KvEventFeed``
that fills it from vLLM's KV events (or, with ``--routing-index approximate``, the
``ApproximateIndex`` of what this gateway placed, and the ``PlacedSequences`` whose
generated blocks join it as they end), and the ``PrefixHasher`` that hashes prompts as the
engines do. ``_route`` places one processed request (before it is copied into its n
samples, which so stay on one rank); ``prefix_match`` answers PrefixQuery; each step's
prefill stats give the index's accuracy (predicted against vLLM's ``num_cached_tokens``).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from typing import Any

from ..approximate_index import ApproximateIndex, PlacedSequences, chained_block_hashes
from ..kv_event_feed import KvEventFeed
from ..prefix_index import PrefixIndex
from ..routing import Decision, Router, RoutingConfig, reusable_blocks
from .args import remove_kv_events_folder
from .prefix_hashes import PrefixHasher

logger = logging.getLogger(__name__)

_PREDICTIONS_KEPT = 100_000  # requests routed whose prefill has not been seen yet


class RoutingAccuracy:
    """Predicted cached tokens against what vLLM then reported, for routed requests."""

    def __init__(self) -> None:
        self.requests = 0
        self.exact = 0
        self.predicted_tokens = 0
        self.cached_tokens = 0

    def note(self, predicted: int, cached: int) -> None:
        self.requests += 1
        self.exact += predicted == cached
        self.predicted_tokens += predicted
        self.cached_tokens += cached


class PrefixRouting:
    """Rank choice for unpinned requests; see gateway/routing.py for the policies."""

    _vllm_config: Any
    _client: Any

    def _init_routing(self) -> None:
        """No routing (``_start_routing`` sets it up)."""
        self.router: Router | None = None
        self.prefix_index: PrefixIndex | None = None
        self.approximate_index: ApproximateIndex | None = None
        self.placed_sequences: PlacedSequences | None = None
        self.kv_feed: KvEventFeed | None = None
        self._hasher: PrefixHasher | None = None
        self._hash_check: bool | None = None  # None: no published block checked yet
        self._predicted: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._prefix_queried = False  # a client asked PrefixQuery (``_notes_placements``)
        self.routing_accuracy = RoutingAccuracy()

    def _start_routing(self, config: RoutingConfig) -> None:
        """Set up ``config``'s policy; with KV events on, bind the feed (before the
        engines take requests: nothing they publish is missed)."""
        ranks = self._vllm_config.parallel_config.data_parallel_size
        if config.policy == "cache" and config.index == "approximate":
            self.router = Router(ranks, config)  # its index is made at the first request
            return
        sources = self._client.get_kv_event_sources()
        silent = [
            rank
            for rank in range(ranks)
            if rank not in sources or not sources[rank].enable_kv_cache_events
        ]
        if silent and config.policy == "cache":
            problem = (
                f"rank(s) {silent} publish no KV events (a headless rank on another host needs"
                ' --kv-events-config with "endpoint": "tcp://*:0" and "replay_endpoint":'
                ' "tcp://*:0", and VLLM_HOST_IP set to its private address:'
                " docs/DEPLOYMENT.md)"
            )
            if not config.by_default:
                raise ValueError(f"--routing cache needs every rank's KV events; {problem}")
            logger.warning("routing: load, not the default cache: %s", problem)
            config = dataclasses.replace(config, policy="load")
        self.router = Router(ranks, config)
        if silent:
            return
        publishers = [sources[rank].endpoint for rank in range(ranks)]
        replays = [sources[rank].replay_endpoint for rank in range(ranks)]
        self.prefix_index = PrefixIndex(ranks)
        self._hasher = PrefixHasher(self._vllm_config)
        if not self._hasher.reproducible:
            logger.error(
                "--prefix-caching-hash-algo %s draws a random seed per process unless"
                " PYTHONHASHSEED is set: the gateway cannot reproduce the engines' block"
                " hashes and routes by load",
                self._hasher.algorithm,
            )
        self.kv_feed = KvEventFeed(self.prefix_index, publishers, replays)
        self.kv_feed.start()

    async def _stop_routing(self) -> None:
        if self.kv_feed is not None:
            await self.kv_feed.aclose()
        remove_kv_events_folder(self._vllm_config)  # (a group's supervisor removes its own)

    # ------------------------------------------------------------ placing requests

    def _reads_approximate(self) -> bool:
        """Whether routing and PrefixQuery read the approximate index: ``--routing cache``
        with ``--routing-index approximate``, or any other policy where the engines publish
        no KV events (the events index, where they do: the operator's --kv-events-config)."""
        router = self.router
        if router is not None and router.config.policy == "cache":
            return router.config.index == "approximate"
        return self.prefix_index is None

    def _notes_placements(self) -> bool:
        """Whether placements are noted in the approximate index: for ``cache`` routing on
        it, and for PrefixQuery once a client asked one (a pool in front of this gateway):
        a gateway nobody queries does not follow every request's tokens (~0.1 µs a token
        at the zero-compute ceiling) for nothing."""
        router = self.router
        routes_by_cache = router is not None and router.config.policy == "cache"
        return self._reads_approximate() and (routes_by_cache or self._prefix_queried)

    def _route(self, core_request: Any, routing_key: str | None) -> Decision | None:
        """Choose the rank of an unpinned request (sets ``data_parallel_rank``). A request
        the gateway does not place (one rank, or vLLM's balancer) is noted on the rank it
        went to once submitted (``_placed_by_engine_client``)."""
        router = self.router
        if router is None:
            return None
        noting = self._notes_placements()
        if router.ranks == 1:  # nothing to choose; noted before it is sent (outputs follow)
            if noting:
                self._note_placement(core_request, 0)
            return None
        if core_request.data_parallel_rank is not None:
            if noting:  # its prompt will be cached where it was pinned: note it
                self._note_placement(core_request, core_request.data_parallel_rank)
            return None
        placed: list | None = None  # approximate: the prompt's block hashes, to record
        if router.config.policy != "cache":
            decision = router.choose(None, (), 0, 0, routing_key)
            if decision.rank is not None and noting:
                _, placed = self._approximate_hashes(core_request)
        else:
            approximate = self._reads_approximate()
            prompt_len = len(core_request.prompt_token_ids or ())
            if approximate:
                matched, block_size, placed = self._approximate_matches(core_request)
            else:
                matched, block_size = self._matched_blocks(core_request)
            if matched is not None and _skips_reading_the_cache(core_request):
                # vLLM computes its whole prompt (prompt logprobs): no rank gives it a hit.
                matched = [None if m is None else 0 for m in matched]
            decision = router.choose(
                matched, self._load_scores(), prompt_len, block_size, routing_key
            )
            predicted = self._predicted
            predicted[core_request.request_id] = decision.predicted_blocks * block_size
            if len(predicted) > _PREDICTIONS_KEPT:
                predicted.popitem(last=False)
        if decision.rank is not None:
            core_request.data_parallel_rank = decision.rank
            self._count_as_waiting(decision.rank)
            self._record_placement(core_request, decision.rank, placed)
        return decision

    def _record_placement(self, core_request: Any, rank: int, placed: list | None) -> None:
        """Approximate index: the prompt with these block hashes was sent to ``rank``,
        held there until the request computes it; its generated blocks join them when it
        ends (``_follow_generation``)."""
        index, sequences = self.approximate_index, self.placed_sequences
        if placed is None or index is None or sequences is None:
            return
        # The output's blocks chain on from the prompt's last hash (``_approximate_hashes``).
        seed = _approximate_seed(index, core_request)
        prompt = core_request.prompt_token_ids or ()
        sequences.start(core_request.request_id, rank, prompt, placed, seed)

    def _note_placement(self, core_request: Any, rank: int) -> None:
        """``_record_placement`` of a request whose prompt was not hashed while routing."""
        _, placed = self._approximate_hashes(core_request)
        self._record_placement(core_request, rank, placed)

    def _placed_by_engine_client(self, core_request: Any) -> None:
        """A request submitted over several ranks without one from the gateway (vLLM's
        balancer chose): noted on the rank it went to, for PrefixQuery."""
        router = self.router
        if router is None or router.ranks == 1 or core_request.data_parallel_rank is not None:
            return  # noted by ``_route``
        if not self._notes_placements():
            return
        # vLLM's DP client records the engine it chose for each request.
        chosen = getattr(self._client, "reqs_in_flight", {}).get(core_request.request_id)
        engines = getattr(self._client, "core_engines", [])
        rank = engines.index(chosen) if chosen in engines else None
        if rank is not None:
            self._note_placement(core_request, rank)

    def _follow_generation(self, outputs: Any) -> None:
        """Approximate index: each step's tokens of the requests it placed; an ended
        request's blocks are recorded on its rank."""
        if self.placed_sequences is not None:
            self.placed_sequences.observe(outputs)

    def _generation_aborted(self, request_ids: Any) -> None:
        """Aborted requests keep in vLLM's cache the blocks they computed: recorded."""
        sequences = self.placed_sequences
        if sequences is not None:
            for request_id in request_ids:
                sequences.end(request_id)

    def _count_as_waiting(self, rank: int) -> None:
        """As vLLM's balancer does for its own picks: count the request as waiting on its
        rank until the coordinator's next snapshot (every 100 ms) says otherwise, so that
        a burst spreads instead of following a stale snapshot (it pins nothing itself
        for a request that names its rank)."""
        counts = getattr(self._client, "lb_engines", None)
        if counts is not None and rank < len(counts):
            counts[rank][0] += getattr(self._client, "client_count", 1)

    def _prefix_cache_cleared(self) -> None:
        """Every engine's prefix cache was reset."""
        if self.prefix_index is not None:
            self.prefix_index.clear_all()
        self._approximate_cache_dropped()

    def _approximate_cache_dropped(self) -> None:
        """Every engine dropped its prefix cache without a reset from the gateway (Sleep):
        the approximate index forgets (the events index reads vLLM's AllBlocksCleared)."""
        if self.approximate_index is not None:
            self.approximate_index.clear()
        if self.placed_sequences is not None:
            self.placed_sequences.clear()

    def _moved_prediction(self, core_request: Any, sample_ids: list[str]) -> None:
        """A request split into n samples: the first carries the prediction; the others
        find the blocks of the whole prompt cached, the first's (vLLM caches a prompt's full
        blocks as it schedules them: seen as 51,200 cached tokens against 16,384 predicted
        on the routing bench's GRPO run before this), unless they read no cache. The
        approximate index follows each sample's generation."""
        if self.placed_sequences is not None:
            self.placed_sequences.split(core_request.request_id, sample_ids)
        predicted = self._predicted
        tokens = predicted.pop(core_request.request_id, None) if predicted else None
        if tokens is None or not sample_ids:
            return
        siblings = tokens
        block_size = self._vllm_config.cache_config.block_size or 0
        if block_size and not _skips_reading_the_cache(core_request):
            prompt_len = len(core_request.prompt_token_ids or ())
            whole = reusable_blocks(prompt_len // block_size, prompt_len, block_size)
            siblings = max(tokens, whole * block_size)
        predicted[sample_ids[0]] = tokens
        for sample_id in sample_ids[1:]:
            predicted[sample_id] = siblings

    def _matched_blocks(
        self, core_request: Any, held: bool = True
    ) -> tuple[list[int | None] | None, int]:
        """Per rank, the prompt's leading blocks cached there (``held``: counting those
        requests placed there will compute, as routing does), and the block size."""
        if self._reads_approximate():
            matched, block_size, _ = self._approximate_matches(core_request, held)
            return matched, block_size
        index, hasher = self.prefix_index, self._hasher
        if index is None or hasher is None:
            return None, 0
        if self.kv_feed is not None:
            self.kv_feed.drain()  # the batches published since the last look, now
        block_size = index.block_size() or hasher.block_size or 0
        if not self._hashes_usable() or not block_size:
            return None, block_size
        hashes = hasher.iter_block_hashes(core_request, block_size)
        limit = self.router.config.max_prefix_blocks if self.router is not None else None
        return index.matched_blocks(hashes, limit), block_size

    def _approximate_matches(
        self, core_request: Any, held: bool = True
    ) -> tuple[list[int | None], int, list]:
        """Per rank, the prompt's leading blocks this gateway placed there (``held``: also
        those not computed yet); the block size; the prompt's block hashes
        (``_approximate_hashes``), for ``record``."""
        block_size, hashes = self._approximate_hashes(core_request)
        index = self._approximate_setup()
        matched: list[int | None] = [*index.matched_blocks(hashes, held=held)]
        return matched, block_size, hashes

    def _approximate_hashes(self, core_request: Any) -> tuple[int, list]:
        """The block size and the prompt's block hashes (up to ``max_prefix_blocks``) for the
        approximate index: our own (``chained_block_hashes``) for the blocks before its
        first multimodal item, so that a text prompt and an image prompt sharing them
        match there as vLLM reuses them; from the block holding that item on, each of
        vLLM's (which hold the items' hashes) chained onto ours."""
        index = self._approximate_setup()
        block_size = self._vllm_config.cache_config.block_size or 0
        limit = self.router.config.max_prefix_blocks if self.router is not None else None
        seed = _approximate_seed(index, core_request)
        tokens = core_request.prompt_token_ids or ()
        if not core_request.mm_features or block_size <= 0:
            return block_size, chained_block_hashes(tokens, block_size, seed, limit)
        first_item = min(feature.mm_position.offset for feature in core_request.mm_features)
        text = first_item // block_size * block_size
        hashes = chained_block_hashes(tokens[:text], block_size, seed, limit)
        if limit is not None and len(hashes) >= limit:
            return block_size, hashes
        if self._hasher is None:
            self._hasher = PrefixHasher(self._vllm_config)
        theirs = self._hasher.iter_block_hashes(core_request, block_size)
        parent = hashes[-1] if hashes else hash(seed)
        rest = limit - len(hashes) if limit is not None else None
        for block in itertools.islice(
            theirs, len(hashes), None if rest is None else len(hashes) + rest
        ):
            parent = hash((parent, block))
            hashes.append(parent)
        return block_size, hashes

    def _approximate_setup(self) -> ApproximateIndex:
        """The approximate index, sized by each rank's KV-cache blocks (known once the
        engines are up), made on first use."""
        if self.approximate_index is None:
            ranks = self._vllm_config.parallel_config.data_parallel_size
            total = self._vllm_config.cache_config.num_gpu_blocks or 0  # summed over ranks
            self.approximate_index = ApproximateIndex(ranks, total // ranks)
            block_size = self._vllm_config.cache_config.block_size or 0
            limit = self.router.config.max_prefix_blocks if self.router is not None else None
            self.placed_sequences = PlacedSequences(self.approximate_index, block_size, limit)
        return self.approximate_index

    def _hashes_usable(self) -> bool:
        """Our hashes are the engines' (checked on the first blocks they published)."""
        hasher, index = self._hasher, self.prefix_index
        if hasher is None or index is None or not hasher.reproducible:
            return False
        if self._hash_check is None:
            for rank in index.ranks:
                if rank.verified is None and rank.root_blocks_seen:
                    rank.verified = all(hasher.verify(*seen) for seen in rank.root_blocks_seen)
                    rank.root_blocks_seen.clear()
                    if not rank.verified:
                        self._hash_check = False
                        logger.error(
                            "the gateway's block hashes differ from what an engine published"
                            " (hash algorithm or seed): routing by load"
                        )
                        break
            else:
                if all(rank.verified for rank in index.ranks):
                    self._hash_check = True
        return self._hash_check is not False

    def _load_scores(self) -> list[float]:
        """vLLM's own load score per rank (DPLBAsyncMPClient.get_core_engine_for_request)."""
        client = self._client
        counts = getattr(client, "lb_engines", None)
        engines = getattr(client, "core_engines", None)
        inflight = getattr(client, "engine_inflight", None)
        ranks = self._vllm_config.parallel_config.data_parallel_size
        if counts is None or engines is None or inflight is None:
            return [0.0] * ranks
        clients = getattr(client, "client_count", 1)
        scores = []
        for r in range(ranks):
            waiting, running, kv_usage = counts[r]
            score = float(max(clients * inflight[engines[r]], waiting + running))
            if waiting:
                score += waiting * 6.0 * max(0.0, kv_usage - 0.5)
            scores.append(score)
        return scores

    def _note_prefill(self, outputs: Any) -> None:
        """Predicted cached tokens against vLLM's, at each routed request's prefill."""
        predicted = self._predicted
        for out in outputs:
            stats = out.prefill_stats
            if stats is not None:
                tokens = predicted.pop(out.request_id, None)
                if tokens is not None:
                    self.routing_accuracy.note(tokens, stats.num_cached_tokens)

    def routing_stats(self) -> dict[str, Any] | None:
        """A snapshot for /metrics (None: vLLM's balancer alone, nothing to report)."""
        router = self.router
        if router is None:
            return None
        index, feed, accuracy = self.prefix_index, self.kv_feed, self.routing_accuracy
        ranks = index.ranks if index is not None else []
        approximate = self.approximate_index
        return {
            "policy": router.config.policy,
            # What routing (with ``cache``) and PrefixQuery read.
            "index": "approximate" if self._reads_approximate() else "events",
            "decisions": dict(router.decisions),
            "index_blocks": (
                approximate.sizes()
                if approximate is not None and self._reads_approximate()
                else [len(rank.blocks) for rank in ranks]
            ),
            "synced": [rank.synced for rank in ranks],
            "feed_connected": [rank.connected for rank in ranks],
            "feed_disconnects": [rank.disconnects for rank in ranks],
            "feed_lag_s": [rank.lag_s for rank in ranks],
            "gaps": [rank.gaps for rank in ranks],
            "restarts": [rank.restarts for rank in ranks],
            "resets": [rank.resets for rank in ranks],
            "hash_check": self._hash_check,
            "event_batches": feed.batches if feed is not None else 0,
            "replayed_batches": feed.replayed if feed is not None else 0,
            "malformed_batches": feed.malformed if feed is not None else 0,
            "event_lag_s": feed.lag_s if feed is not None else 0.0,
            "predictions": accuracy.requests,
            "exact_predictions": accuracy.exact,
            "predicted_cached_tokens": accuracy.predicted_tokens,
            "reported_cached_tokens": accuracy.cached_tokens,
        }

    # ------------------------------------------------------------ PrefixQuery

    def prefix_matches(self, core_request: Any) -> tuple[list[int | None], int]:
        """Per rank, the prompt's leading tokens cached there as vLLM would reuse them
        (whole blocks, at most ``len - 1`` tokens; None: that rank's index is unsynced
        or unchecked), and the block size."""
        self._prefix_queried = True
        matched, block_size = self._matched_blocks(core_request, held=False)
        ranks = self._vllm_config.parallel_config.data_parallel_size
        if matched is None or not block_size:
            return [None] * ranks, block_size
        prompt_len = len(core_request.prompt_token_ids or ())
        return [
            None if m is None else reusable_blocks(m, prompt_len, block_size) * block_size
            for m in matched
        ], block_size


def _approximate_seed(index: ApproximateIndex, core_request: Any) -> tuple:
    """What a request's first block hash chains from: the index's secret, its LoRA and its
    cache salt (blocks of other adapters or salts never match)."""
    lora = core_request.lora_request
    return (index.secret, lora.lora_name if lora is not None else None, core_request.cache_salt)


def _skips_reading_the_cache(core_request: Any) -> bool:
    """vLLM's rule (``Request.get_skip_reading_prefix_cache``): a request that asks for
    prompt logprobs reads no cached block."""
    params = core_request.sampling_params or core_request.pooling_params
    return bool(getattr(params, "skip_reading_prefix_cache", False))
