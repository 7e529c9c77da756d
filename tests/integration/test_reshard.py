"""pathwaysutils' reshard plugin program (`pathwaysutils.experimental.reshard.reshard`) through
isthmus: arrays move between shardings and slices as `jax.device_put` moves them, donation
included, equal to numpy; a malformed `reshardRequest` gets INVALID_ARGUMENT naming its field.
"""

import pytest

from isthmus.testing import run_python


@pytest.fixture(scope="module")
def client(server):
    """One client run of both scripts on the suite's fleet (2 slices x 2 hosts x 2 devices)."""
    if server.kind != "fleet":
        pytest.skip("moving arrays across slices needs the fleet backend")
    result = run_python(MOVES + MALFORMED, server.address, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout


PRELUDE = """
import json, base64
import jax, numpy as np, jax.numpy as jnp
import pathwaysutils
pathwaysutils.initialize()
from pathwaysutils.experimental import reshard as experimental
from pathwaysutils import plugin_executable
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devices = jax.devices()
grid = Mesh(np.array(devices).reshape(2, -1), ("a", "b"))
line = Mesh(np.array(devices), ("x",))
slice0, slice1 = (Mesh(np.array([d for d in devices if d.slice_index == s]), ("x",))
                  for s in (0, 1))
"""

MOVES = PRELUDE + """
def same_as_device_put(x, target, **kw):
    host = np.asarray(x)
    out = experimental.reshard(x, target, **kw)
    expected = jax.device_put(host, target)
    assert out.sharding == target, (out.sharding, target)
    np.testing.assert_array_equal(np.asarray(out), host)
    assert ([(s.device.id, s.index) for s in out.addressable_shards] ==
            [(s.device.id, s.index) for s in expected.addressable_shards])
    return out

x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
replicated = jax.device_put(x, NamedSharding(line, P()))
rows = same_as_device_put(replicated, NamedSharding(grid, P("a", "b")))      # replicated -> sharded
cols = same_as_device_put(rows, NamedSharding(grid, P("b", "a")))            # one axis -> another
away = same_as_device_put(jax.device_put(x, NamedSharding(slice0, P("x"))),  # slice 0 -> slice 1
                          NamedSharding(slice1, P(None, "x")))
assert {d.slice_index for d in away.sharding.device_set} == {1}
print("MOVED", flush=True)

# Several arrays of several dtypes in one plan, donated: the inputs are gone, as after a
# donating jax.device_put; the results, used by a jitted function, are right.
tree = {"w": jax.device_put(x, NamedSharding(slice0, P("x"))),
        "i": jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(line, P())),
        "h": jax.device_put(x.astype(jnp.bfloat16), NamedSharding(grid, P(None, ("a", "b"))))}
hosts = {k: np.asarray(v) for k, v in tree.items()}
out = experimental.reshard(tree, {"w": NamedSharding(line, P(None, "x")),
                                  "i": NamedSharding(slice1, P("x")),
                                  "h": NamedSharding(grid, P("b"))}, donate=True)
for k in tree:
    assert tree[k].is_deleted(), k
    np.testing.assert_array_equal(np.asarray(out[k]), hosts[k])
    assert out[k].dtype == hosts[k].dtype, k
try:
    np.asarray(tree["w"] + 1)
    print("USED A DONATED ARRAY")
except Exception as e:
    print("DONATED", "deleted" in str(e), flush=True)
np.testing.assert_array_equal(np.asarray(jax.jit(lambda w: w * 2)(out["w"])), x * 2)
kept = jax.device_put(x, NamedSharding(grid, P("a")))
copy = experimental.reshard(kept, NamedSharding(grid, P("b")), donate=False)
assert not kept.is_deleted()
np.testing.assert_array_equal(np.asarray(kept) + np.asarray(copy), x * 2)

# pathwaysutils' other reshard uses the stock client's own (ReshardArrays).
from pathwaysutils import reshard as ifrt
back = ifrt.reshard(copy, NamedSharding(slice0, P("x")), donate=True)
assert copy.is_deleted()
np.testing.assert_array_equal(np.asarray(back), x)

# A cached plan runs again: the client then names the outputs itself.
for step in range(3):
    y = jax.device_put(x + step, NamedSharding(grid, P("a", "b")))
    z = experimental.reshard(y, NamedSharding(slice1, P("x")), cache_resharding_plans=True)
    np.testing.assert_array_equal(np.asarray(z), x + step)
print("RESHARDS OK", flush=True)
"""


def test_reshard_moves_arrays_like_device_put(client):
    assert "MOVED" in client
    assert "DONATED True" in client
    assert "RESHARDS OK" in client


MALFORMED = """
def spec(sharding, ndim, **extra):
    return {"devices": {"device_ids": [d.id for d in sharding._addressable_device_assignment]},
            "xla_hlo_sharding": base64.b64encode(
                sharding._to_xla_hlo_sharding(ndim).to_proto().SerializeToString()).decode(),
            **extra}

def outcome(body, args=None):
    try:
        program = plugin_executable.PluginExecutable(json.dumps({"reshardRequest": body}))
        if args is not None:
            program.call(args, [NamedSharding(line, P())] * len(args),
                         [a.aval for a in args])[1].result()
        return "OK"
    except Exception as e:
        return str(e)[:300]

rows, rep = NamedSharding(line, P("x")), NamedSharding(line, P())
good = {"donateInput": False, "inSharding": [spec(rows, 1)], "outSharding": [spec(rep, 1)]}
v = jax.device_put(np.arange(8, dtype=np.float32), rows)
cases = {
    "good": (good, [v]),
    "donate": ({**good, "donateInput": "yes"}, None),
    "missing": ({"donateInput": False, "inSharding": [spec(rows, 1)]}, None),
    "counts": ({**good, "outSharding": [spec(rep, 1)] * 2}, None),
    "unknown": ({**good, "shapes": [[8]]}, None),
    "base64": ({**good, "inSharding": [{**spec(rows, 1), "xla_hlo_sharding": "%%"}]}, None),
    "device": ({**good, "outSharding": [{"devices": {"device_ids": [0, 999]},
                                          "xla_hlo_sharding": ""}]}, None),
    "twice": ({**good, "outSharding": [{**spec(rep, 1), "devices": {"device_ids": [1, 1]}}]},
              None),
    "tiles": ({**good, "outSharding": [{**spec(rows, 1), "devices": {"device_ids": [0, 1]}}]},
              None),
    "memory": ({**good, "outSharding": [spec(rep, 1, memory_kind="hbm-of-mars")]}, None),
    "argument": (good, [jax.device_put(np.arange(8, dtype=np.float32), rep)]),
}
for name, (body, args) in cases.items():
    print(name, "=>", outcome(body, args), flush=True)
"""


def test_malformed_requests_name_the_field(client):
    outcomes = dict(line.split(" => ", 1) for line in client.splitlines() if " => " in line)
    assert outcomes.pop("good") == "OK"
    expected = {"donate": "reshardRequest.donateInput",
                "missing": "reshardRequest.outSharding",
                "counts": "outSharding",
                "unknown": "reshardRequest.shapes",
                "base64": "reshardRequest.inSharding[0].xla_hlo_sharding",
                "device": "reshardRequest.outSharding[0].devices",
                "twice": "reshardRequest.outSharding[0].devices.device_ids",
                "tiles": "reshardRequest.outSharding[0].xla_hlo_sharding",
                "memory": "reshardRequest.outSharding[0].memory_kind",
                "argument": "reshardRequest.inSharding[0]"}
    for name, field in expected.items():
        assert "INVALID_ARGUMENT" in outcomes[name] and field in outcomes[name], (
            name, outcomes[name])
