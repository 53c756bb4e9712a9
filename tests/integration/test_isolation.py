"""One session never sees another's data: persistent buffers placed over an old
lane, and ephemeral memory of a lane shared by two sessions, read as zero."""
import os

from conftest import Session


def read_mem(s, name, n):
    with open(s.file(f"mem/{name}"), "rb") as f:
        return f.read(n)


def test_new_buffer_over_an_old_lane_reads_zero(salusd_factory):
    d = salusd_factory(sim_memory="128M", gpus=1).start()
    a = Session(d)
    a.cmd("need persistent=1M ephemeral=100M\nbegin\nalloc t 100M\nfill t 7 dtype=u8\nend\n")
    assert a.wait() == "done 1\n"
    a.close()
    b = Session(d)
    b.cmd("need persistent=100M ephemeral=1M\nalloc w 100M\n")
    data = read_mem(b, "w", 100 << 20)
    assert data.count(0) == len(data)
    b.close()


def test_shared_lane_ephemeral_is_cleared_between_sessions(salusd_factory):
    d = salusd_factory(sim_memory="16M", gpus=1).start()
    c, e = Session(d), Session(d)
    c.cmd("need persistent=1M ephemeral=10M\n")
    e.cmd("need persistent=1M ephemeral=10M\nalloc w 1M\n")
    assert c.status()["lane"] == e.status()["lane"]
    c.cmd("begin\nalloc t 10M\nfill t 9 dtype=u8\nend\n")
    assert c.wait() == "done 1\n"
    # e copies from its own, never-written ephemeral buffer.
    e.cmd("begin\nalloc t 10M\ncopy w t 1M\nend\n")
    assert e.wait() == "done 1\n"
    data = read_mem(e, "w", 1 << 20)
    assert data.count(0) == len(data)
    c.close()
    e.close()
