"""The DLRM benchmark's report: speedups are the peer's time over ours and the table-kind
orderings are judged on modelled table traffic, paired per iteration."""

import pytest

from helpers import load_benchmark


def _result(kind, dist, steps, table_times, peer_steps=None, hit_rate=0.5, modelled=None):
    r = dict(table_kind=kind, distribution=dist, losses=[0.7] * len(steps), steps=steps,
             table_times=table_times, modelled_table_times=modelled or table_times,
             slow_device="a file mapping (/tmp/x.heap)", phases=dict(lookup=0.01, interaction=0.01, mlp=0.1,
                                                  update=0.01),
             tables=dict(hit_rate=hit_rate, slow_read_bytes=0, slow_write_bytes=0,
                         fast_read_bytes=0), manager={"moved": {}})
    if peer_steps is not None:
        r.update(peer_steps=peer_steps, peer_losses=[0.7] * len(steps),
                 peer_phases=dict(r["phases"]))
    return r


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("dlrm")


def test_the_torch_goal_is_the_peers_step_time_over_ours(bench, capsys):
    rows = [_result("static", "uniform", [2.0] * 3, [1.0] * 3),
            _result("simple", "uniform", [1.0, 1.0, 1.0], [0.1] * 3, peer_steps=[1.6, 1.5, 1.7])]
    bench.report(rows, "uniform", "torch")
    out = capsys.readouterr().out
    assert "goal dlrm speedup vs torch (uniform): 1.60x (target >= 1.5x): met" in out
    assert "simple tables" in out


@pytest.mark.parametrize("dist, static, dynamic, winner, line", [
    ("uniform", [1.0, 1.0, 1.0], [2.0, 3.0, 2.0], "static",
     "goal static beats dynamic under uniform: 2.00x (target >= 1x): met"),
    ("zipf", [1.0, 1.0, 1.0], [2.0, 2.0, 4.0], "static",
     "goal dynamic beats static under zipf: 0.50x (target >= 1x): not met"),
    ("zipf", [3.0, 3.0, 3.0], [1.0, 1.5, 1.0], "dynamic",
     "goal dynamic beats static under zipf: 3.00x (target >= 1x): met"),
])
def test_orderings_compare_modelled_table_traffic_per_iteration(bench, capsys, dist, static,
                                                               dynamic, winner, line):
    steps = [10.0] * 3                  # equal steps: the ordering comes from the tables alone
    # measured times the other way round: the goal follows the modelled traffic
    bench.report([_result("static", dist, steps, dynamic, modelled=static),
                  _result("dynamic", dist, steps, static, modelled=dynamic)], dist, None,
                 "optane")
    out = capsys.readouterr().out
    assert f"{dist}: {winner} tables win on modelled table traffic (fast DRAM, slow optane)" in out
    assert line in out
    assert "measured embedding time" in out and "slow memory here: a file mapping" in out
    assert "speedup vs" not in out      # no peer, no peer goal


def test_table_traffic_time_counts_every_byte_at_its_tiers_bandwidth():
    from cachedarrays.models.dlrm import traffic_time
    stats = dict(fast_read_bytes=110e9, fast_write_bytes=60e9, slow_read_bytes=30e9,
                 slow_write_bytes=11e9)
    assert traffic_time(stats) == pytest.approx(4.0)                # 1 s each at dram/optane
    assert traffic_time(stats, slow="dram") == pytest.approx(2 + 30 / 110 + 11 / 60)
    owed = dict(stats, dirty_bytes=110e9)           # write-backs owed: read fast, write slow
    assert traffic_time(owed) == pytest.approx(4.0 + 1.0 + 110 / 11)
    with pytest.raises(ValueError, match="'slow_write_bytes'.* missing"):
        traffic_time({k: v for k, v in stats.items() if k != "slow_write_bytes"})
    with pytest.raises(ValueError, match="unknown device profile 'pmem9'"):
        traffic_time(stats, slow="pmem9")


def test_help_lists_defaults_and_choices(bench, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")           # one line per flag
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    for text in ("--threads", "--plot PATH", "--no-progress", "(default: 20)",
                 "{fast,simple,static,dynamic}", "(default: ['simple', 'static', 'dynamic'])",
                 "(default: small)", "{torch}"):
        assert text in out


@pytest.mark.parametrize("peer", [None, "torch"])
def test_predictions_time_each_batch_size_and_agree_with_the_peer(bench, capsys, peer):
    """The prediction section: one line per batch size with our median, and with a peer its
    median, the paired speedup headline and the largest difference between the two models'
    probabilities (the same weights and batches)."""
    if peer:
        pytest.importorskip("torch")
    from cachedarrays.models.dlrm import configs
    cfg = configs.get_config("tiny", scale=0.01, width_scale=0.25, batch_size=8)
    bench.predictions(cfg, [1, 3], 4, "numpy", 0, peer, None)
    out = capsys.readouterr().out
    for size in (1, 3):
        line = next(x for x in out.splitlines() if x.startswith(f"  batch {size:>5}: ours "))
        assert "n=4]" in line
        if peer:
            assert float(line.split("max |ours - torch| ")[1]) < 1e-5
            assert f"dlrm predict speedup vs torch, batch {size}: " in out
    assert ("speedup" in out) == bool(peer)
