import json

import numpy as np
import pytest

from hpcpax.plan import sim
from hpcpax.plan.cost_model import VarSpec

SMALL_MODEL = {
    "name": "tiny",
    "samples_per_worker": 32,
    "compute_ms": 5.0,
    "variables": [
        {"name": "emb", "kind": "sparse", "shape": [20000, 64], "dtype": "float32",
         "access": [{"distribution": "zipf", "exponent": 1.0, "draws": 640}]},
        {"name": "w", "kind": "dense", "shape": [100000], "dtype": "float32"},
    ],
}


def test_presets_ship():
    names = sim.list_presets()
    assert {"lm1b", "parallax_8x6"} <= set(names)
    lm = sim.load_preset("lm1b")
    assert lm["variables"][0]["shape"] == [793470, 512]


def test_lm1b_alpha_derivation_is_plausible():
    specs = sim.variable_specs(sim.load_preset("lm1b"), 6)
    by_name = {s.name: s for s in specs}
    emb, softmax = by_name["embedding"], by_name["softmax_w"]
    # fewer distinct rows than draws; the node union lies between one worker and 6 disjoint workers
    assert 0 < emb.alpha * 793470 < 2560
    assert emb.alpha < emb.alpha_node < 6 * emb.alpha
    assert softmax.alpha * 793470 > 8192
    assert isinstance(emb, VarSpec)


def test_cli_prints_every_strategy(capsys, tmp_path):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(SMALL_MODEL))
    assert sim.main(["--model", str(model), "--cluster", "parallax_8x6", "--nodes", "4",
                     "--bandwidth-gbps", "50", "--latency-us", "3", "--compute-ms", "7"]) == 0
    out = capsys.readouterr().out
    for name in sim.STRATEGIES:
        assert f"\n{name} " in out
    assert "4 nodes x 6 GPUs" in out and "compute 7.0 ms" in out
    assert "speedup of hybrid" in out


def test_cli_json_and_png(capsys, tmp_path):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(SMALL_MODEL))
    png = tmp_path / "out.png"
    assert sim.main(["--model", str(model), "--cluster", "parallax_8x6", "--nodes", "2",
                     "--json", "--png", str(png)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["strategies"]) == set(sim.STRATEGIES)
    assert result["workers"] == 12
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--model", "nosuch"], "preset must be a file or one of"),
    (["--nodes", "0"], "--nodes must be >= 1, not 0"),
    (["--servers-per-node", "-1"], "--servers-per-node must be >= 0, not -1"),
    (["--partitions", "0"], "--partitions must be >= 1, not 0"),
    (["--bandwidth-gbps", "0"], "--bandwidth-gbps must be > 0, not 0"),
    (["--latency-us", "-1"], "--latency-us must be >= 0, not -1"),
    (["--compute-ms", "-5"], "--compute-ms must be >= 0, not -5"),
])
def test_cli_refuses_bad_input_with_the_reason(capsys, argv, message):
    """Exit status 2 and one line naming the flag, no traceback."""
    with pytest.raises(SystemExit) as exited:
        sim.main(["--model", "lm1b", "--cluster", "parallax_8x6", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and "Traceback" not in err


def test_lm1b_on_parallax_cluster_hybrid_beats_allreduce_and_allgather(capsys):
    assert sim.main(["--model", "lm1b", "--cluster", "parallax_8x6"]) == 0
    out = capsys.readouterr().out
    result = sim.simulate(sim.load_preset("lm1b"), sim.load_preset("parallax_8x6"))
    s = result["strategies"]
    assert s["hybrid"]["samples_per_s"] > s["horovod"]["samples_per_s"] > s["allreduce"]["samples_per_s"]
    assert "48 workers" in out


def test_report_names_bottlenecks_scaling_and_quotes_the_paper(capsys):
    assert sim.main(["--model", "lm1b", "--cluster", "parallax_8x6", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "bottleneck" in out and "by number of nodes" in out
    assert " 1 node " in out and "2 nodes" in out and "1 nodes" not in out
    assert "on 2 nodes x 6 GPUs (12 workers, 1 server/node)" in out
    assert "2.8x over TensorFlow and 6.02x over Horovod" in out
    result = sim.simulate(sim.load_preset("lm1b"), dict(sim.load_preset("parallax_8x6"), num_nodes=2))
    known = {"compute", "latency", "intra link", "inter link", "node NIC", "server CPU",
             "client kernels", "host staging"}
    assert all(s["bottleneck"] in known for s in result["strategies"].values())


def test_allgather_scales_worse_than_the_parameter_server():
    """Allgathered bytes per worker grow with the workers; the PS's do not."""
    scale = sim.scaling(sim.load_preset("lm1b"), sim.load_preset("parallax_8x6"))
    gain = {name: scale[8][name][0] / scale[1][name][0] for name in ("horovod", "hybrid")}
    assert gain["horovod"] < gain["hybrid"]


def test_partitions_beyond_the_servers_parallelize_server_work():
    model, cluster = sim.load_preset("lm1b"), sim.load_preset("parallax_8x6")
    at = {p: sim.simulate(model, cluster, partitions=p)["strategies"]["hybrid"]
          for p in (2, 8, 64)}
    assert at[2]["samples_per_s"] < at[8]["samples_per_s"] < at[64]["samples_per_s"]
    assert at[64]["resources"]["server CPU"] < at[8]["resources"]["server CPU"] / 4


def test_oversubscribed_collectives_wait_for_their_ranks_turns_every_round():
    from hpcpax.comm.polling import WITHIN_SPIN_SECONDS
    from hpcpax.plan import collectives as coll

    assert sim.oversubscription_round_wait(2, 2) == sim.oversubscription_round_wait(1, 4) == 0.0
    assert sim.oversubscription_round_wait(16, 2) == pytest.approx(7 * WITHIN_SPIN_SECONDS / 2)
    plain = coll.Links(1e-5, 1e8, 1e-5, 1e8)
    waiting = coll.Links(1e-5, 1e8, 1e-5, 1e8, round_wait_s=1e-3)
    nodes = list(range(8))
    ring = coll.allgatherv(nodes, 1 << 20, waiting, algorithm="ring")
    assert ring.seconds - coll.allgatherv(nodes, 1 << 20, plain, algorithm="ring").seconds \
        == pytest.approx(7e-3)
    scattered = coll.alltoallv(nodes, np.full((8, 8), 1000.0), waiting)
    assert scattered.seconds - coll.alltoallv(nodes, np.full((8, 8), 1000.0), plain).seconds \
        == pytest.approx(1e-3)  # every send posted at once: one wait
    cluster = dict(sim.load_preset("parallax_8x6"), num_nodes=2)
    slower = sim.simulate(sim.load_preset("lm1b"), dict(cluster, round_wait_s=1e-3))
    base = sim.simulate(sim.load_preset("lm1b"), cluster)
    assert all(slower["strategies"][s]["step_s"] >= base["strategies"][s]["step_s"]
               for s in ("allreduce", "ps", "hybrid"))
    assert slower["strategies"]["ps"]["step_s"] > base["strategies"]["ps"]["step_s"]
