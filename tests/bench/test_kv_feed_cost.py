"""bench.probes.kv_feed_cost: its batches are vLLM-shaped, and it runs the three ways of
receiving (drained, woken per batch two ways) and reports each with the decode/apply split."""

import json

from bench.probes.kv_feed_cost import _payloads, main
from gateway.prefix_index import PrefixIndex, decode_batch


def test_the_payloads_are_vllm_shaped_chained_batches():
    index = PrefixIndex(1)
    for seq, payload in enumerate(_payloads(3, 2)):
        index.apply(0, seq, decode_batch(payload))
    chain = [i.to_bytes(32, "big") for i in range(6)]
    assert index.matched_blocks(chain) == [6]


def test_the_probe_runs_every_way_and_reports(tmp_path, capsys):
    out = tmp_path / "cost.json"
    assert (
        main(["--batches", "200", "--rounds", "1", "--interval", "0.001", "--json", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    for way in ("drained every 20 ms (now)", "loop-watched socket (before)", "pyzmq receive"):
        assert way in printed, printed
    result = json.loads(out.read_text())
    assert len(result["results"]) == 3
    assert all(len(costs) == 1 and costs[0] > 0 for costs in result["results"].values())
    assert result["decode"] > 0 and result["apply"] > 0
