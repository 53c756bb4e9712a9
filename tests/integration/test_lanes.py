"""Lanes through /salus: created, shared, grown, moved and deleted, as
gpus/N/lanes shows them (Salus Algorithm 1 and auto-defragmentation)."""
import os

from conftest import Session, wait_until

M = 1 << 20


def lanes(d):
    with open(d.path("gpus", "0", "lanes")) as f:
        rows = [l.split() for l in f.read().splitlines() if not l.startswith("#")]
    return {int(r[0]): {"offset": None if r[1] == "-" else int(r[1]), "size": int(r[2]),
                        "sessions": [] if r[4] == "-" else r[4].split(",")} for r in rows}


def lane_of(d, s):
    return int(s.status()["lane"])


def test_lane_lifecycle(salusd):
    d = salusd
    a = Session(d)
    a.cmd("need persistent=100M ephemeral=300M gpu=0\n")
    b = Session(d)
    b.cmd("need persistent=100M ephemeral=200M gpu=0\n")
    la, lb = lane_of(d, a), lane_of(d, b)
    assert la != lb                                   # created: a new lane each
    ls = lanes(d)
    assert ls[la] == {"offset": 0, "size": 300 * M, "sessions": [a.id]}
    assert ls[lb]["offset"] == 300 * M and ls[lb]["size"] == 200 * M

    c = Session(d)                                    # no room for a third lane:
    c.cmd("need persistent=100M ephemeral=250M gpu=0\n")
    assert lane_of(d, c) == la                        # shared: best-fitting lane >= E
    assert sorted(lanes(d)[la]["sessions"]) == sorted([a.id, c.id])

    e = Session(d)                                    # no lane >= 350M, none fits new:
    e.cmd("need persistent=50M ephemeral=350M gpu=0\n")
    assert lane_of(d, e) == lb                        # grown: the smallest lane that can
    assert lanes(d)[lb]["size"] == 350 * M
    with open(d.path("gpus", "0", "memory")) as f:
        mem = dict(l.split(": ", 1) for l in f.read().splitlines())
    assert int(mem["ephemeral"]) + int(mem["persistent_reserved"]) <= int(mem["capacity"])

    a.close()
    c.close()                                         # lane la empties and is deleted;
    assert wait_until(lambda: la not in lanes(d))
    assert wait_until(lambda: lanes(d)[lb]["offset"] == 0)  # moved: slid down to 0
    # Work keeps running in the moved lane.
    e.cmd("alloc w 1M\nbegin\nalloc t 300M\nfill t 1\ncopy w t 1M\nend x3\n")
    assert e.wait() == "done 3\n"
    b.close()
    e.close()
    assert wait_until(lambda: lanes(d) == {})         # deleted


def test_figure6_two_big_jobs_share_one_lane(salusd_factory):
    d = salusd_factory(sim_memory="12G", gpus=1).start()
    x, y = Session(d), Session(d)
    x.cmd("need persistent=1G ephemeral=7G\n")
    y.cmd("need persistent=1G ephemeral=7G\n")
    assert x.status()["state"] == y.status()["state"] == "admitted"
    assert lane_of(d, x) == lane_of(d, y)
    assert len(lanes(d)) == 1
    for s in (x, y):
        s.cmd("begin\nspin 1000\nend x20\n")
    assert x.wait() == "done 20\n" and y.wait() == "done 20\n"
    x.close()
    y.close()
