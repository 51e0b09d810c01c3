#!/usr/bin/env python3
"""Generate the seed corpus of fuzz_api.c into libgreqprof/tests/corpus/.

Each file is a small program in the byte encoding that fuzz_api.c decodes:
byte 0 configures the run, then each operation is an opcode byte followed by
its argument bytes.  Keep this file in sync with the OP_* enum and the
pick_* helpers of fuzz_api.c.

    python3 libgreqprof/tests/gen_corpus.py [OUTDIR]

The output is deterministic (fixed seeds), so re-running it reproduces the
committed corpus exactly.
"""
import os
import random
import sys

OPS = [
    "SWITCH", "CALL", "RETURN", "RUN", "IDLE", "ATTACH", "INHERIT", "CLOSE",
    "CLEAR", "FLUSH", "FORGET", "TSET", "PSET", "DEFAULT", "NAME", "TAG",
    "WAITED", "NEWPROF", "RETAIN", "NEWTRACER", "CHECK", "CLOCKS", "SPAWN",
    "FAILALLOC", "WAIT_AT", "SESSION",
]
OP = {name: i for i, name in enumerate(OPS)}

# cfg byte bits (see LLVMFuzzerTestOneInput)
TWO_TRACERS = 1
SET_CPU_MODE = 2          # mode = (cfg >> 2) % 3
CPU_OFF, CPU_ESTIMATE, CPU_EXACT = 0 << 2, 1 << 2, 2 << 2
CALL_WALL = 16
MAX_DEPTH_3 = 32
HISTORY_4 = 64
SMALL_CAPS_P0 = 128

# profile selector: 0..2 = slot, 3 = NULL
NULL_PROF = 3
# key byte 255 is the invalid key 0
ZERO_KEY = 255
# tracer parameters (gqp_tracer_param) and value-table indexes
T_CPU_MODE, T_WINDOW, T_CALL_CLOCK, T_LONG, T_DEPTH, T_GREENLETS, T_HISTORY = \
    range(1, 8)
P_MAX_SPANS, P_POLICY, P_FUNCS, P_EDGES, P_GREENLETS, P_NAME = range(1, 7)
V = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 7: 5, 16: 6, 100: 7, 1000: 8, 100000: 9,
     -1: 10, 255: 11, 4096: 12, 1 << 20: 13, 1 << 40: 14, "max": 15}


def amount(n, scale=0):
    """Encodes n * 10**k (k from the scale table index), n < 32."""
    assert 0 <= n < 32 and 0 <= scale < 8
    return (scale << 5) | n


class Prog:
    def __init__(self, cfg=0):
        self.b = bytearray([cfg])

    def op(self, name, *args):
        self.b.append(OP[name])
        for a in args:
            self.b.append(a & 0xFF)
        return self

    # well-behaved switch: from = the running greenlet
    def sw(self, to, t=0, dead=False):
        return self.op("SWITCH", t, 0, to, 5 if dead else 0)

    def sw_from(self, frm, to, t=0):
        assert 0 <= frm < 36
        return self.op("SWITCH", t, 220 + frm, to, 0)

    def sw_zero_from(self, to, t=0):
        return self.op("SWITCH", t, 200, to, 0)

    def call(self, f, t=0):
        return self.op("CALL", t, f)

    def ret(self, t=0):
        return self.op("RETURN", t)

    def run(self, n, scale=0, t=0):
        return self.op("RUN", t, amount(n, scale))

    def idle(self, n, scale=0, t=0):
        return self.op("IDLE", t, amount(n, scale))

    def attach(self, key, prof, t=0):
        return self.op("ATTACH", t, key, prof)

    def inherit(self, child, parent, t=0):
        return self.op("INHERIT", t, child, parent)

    def tset(self, param, value, t=0):
        return self.op("TSET", t, param, V[value])

    def pset(self, prof, param, value):
        return self.op("PSET", prof, param, V[value])

    def name(self, prof, key, name, fn, live_id=True, null_name=False,
             null_fn=False):
        # idsel bit 0: use the live id of `key` in tracer 0 (else key as id);
        # bit 1: name NULL; bit 2: fn_name NULL
        idsel = (1 if live_id else 0) | (2 if null_name else 0) | \
            (4 if null_fn else 0)
        self.op("NAME", prof, idsel, key, len(name))
        self.b.extend(name)
        self.b.append(len(fn))
        self.b.extend(fn)
        return self

    def waited(self, prof, back, length, n, t=0, reverse=False):
        return self.op("WAITED", t, prof, back, length, n, 1 if reverse else 0)

    def newprof(self, slot, max_spans, keep_last=False, tiny=0, pol_extra=0):
        return self.op("NEWPROF", slot, max_spans,
                       (1 if keep_last else 0) | pol_extra, tiny)

    def bytes(self):
        return bytes(self.b)


def seed_scenario():
    # G=key 0, H=key 1; a=func 2, b=3, c=4
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.sw(0).call(2).run(1)
    p.sw(1).run(10).idle(20).sw(0).run(2)
    p.call(3).run(5).sw(1).run(3).sw(0).idle(4).ret()
    p.call(4).run(7).ret().run(1).ret().op("FLUSH", 0).op("CHECK")
    return p


def seed_scenario_wall():
    p = seed_scenario()
    p.b[0] = SET_CPU_MODE | CPU_ESTIMATE | CALL_WALL
    return p


def recursion():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.sw(0).call(5)
    for _ in range(6):
        p.call(6).run(3)
    for _ in range(6):
        p.ret().run(1)
    p.call(5).call(6).call(5).call(6).ret().ret().ret().ret().ret()
    return p.op("CHECK")


def attach_detach():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.sw(0).call(2).run(10).attach(0, 1).call(3).run(5).ret().run(3).ret()
    p.sw(1).attach(0, 2).run(4).sw(0).call(4).run(2).attach(0, NULL_PROF)
    p.run(2).ret().sw(1).attach(1, 1).run(3).attach(1, 1).sw(2).op("CHECK")
    return p


def inherit():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.sw(0).attach(0, 1).inherit(7, 0).inherit(8, 7).run(3).sw(7).run(4)
    p.call(2).sw(8).call(2).run(1).ret().sw(7).ret().sw(0)
    p.inherit(9, 200).inherit(ZERO_KEY, 0).inherit(9, ZERO_KEY)
    return p.op("CHECK")


def close_attached():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.sw(0).attach(0, 1).run(5).sw(1).run(1).sw(0).call(2).run(1).ret()
    p.call(3).run(1).op("CLOSE", 1).run(3).ret().sw(1).sw(0).call(4).ret()
    p.op("CLOSE", 1).attach(0, 1).sw(1).op("CLEAR", 1).op("CHECK")
    p.op("CLOSE", 0).sw(0).sw(1).op("FLUSH", 0)
    return p


def clear_open_frames():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.sw(0).call(6).run(2).call(6).run(2).call(6).run(1).op("CLEAR", 0)
    p.ret().run(1).ret().op("CHECK").run(1).ret().sw(1).op("CLEAR", 0)
    p.call(2).ret().op("CHECK")
    return p


def span_caps():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.newprof(0, 2, keep_last=True).op("DEFAULT", 0, 0)
    for i in range(12):
        p.run(i + 1).sw(i % 3)
    p.newprof(1, 3).attach(0, 1)
    for i in range(10):
        p.run(20 - i).sw(i % 2)
    p.newprof(2, 0).attach(1, 2)
    for i in range(6):
        p.run(i).sw(i % 2)
    return p.op("CHECK")


def depth_overflow():
    p = Prog(SET_CPU_MODE | CPU_EXACT | MAX_DEPTH_3)
    p.sw(0)
    for f in range(8):
        p.call(f).run(1)
    p.sw(1).call(2).run(2).ret().sw(0)
    for _ in range(9):  # one return too many
        p.ret().run(1)
    p.call(9).ret()
    return p.op("CHECK")


def dead_key_reuse():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.sw(0).run(1).sw(1).run(1)
    for _ in range(5):
        p.sw(0, dead=True).run(2).sw(1).run(1)
    p.call(2).sw(0, dead=True).sw(1).ret()  # dies with a frame open
    return p.op("CHECK")


def huge_keys():
    # key indexes with i % 8 == 1 are UINT64_MAX - i, == 2 are 2**63 + i
    p = Prog(SET_CPU_MODE | CPU_ESTIMATE)
    for k in (1, 2, 9, 10, 57, 58, 1, 2):
        p.sw(k).call(0).run(3).call(1).ret().ret()
    p.sw(ZERO_KEY).call(ZERO_KEY).attach(ZERO_KEY, 0).op("FORGET", 0, ZERO_KEY)
    return p.op("CHECK")


def waited():
    p = Prog(SET_CPU_MODE | CPU_EXACT | HISTORY_4)
    p.sw(0).attach(0, 1).run(10).sw(1).run(20).sw(0).run(5).sw(2).run(5)
    p.sw(1).run(5).sw(2).run(1).sw(0).run(4).sw(1).run(10)
    for back, length, n in ((amount(31), amount(31), 8), (amount(20), amount(9), 1),
                            (amount(5), amount(3), 0), (amount(31, 1), amount(2, 2), 3)):
        p.waited(1, back, length, n)
        p.waited(NULL_PROF, back, length, n)
    p.waited(1, amount(10), amount(5), 4, reverse=True)
    return p


def tracer_params():
    p = Prog()
    p.tset(T_CPU_MODE, 2).tset(T_WINDOW, 1).tset(T_LONG, 4).sw(0).run(5).sw(1)
    for param in range(0, 9):
        p.op("TSET", 0, param, V[7])
    p.op("CLOCKS", 0).op("FLUSH", 0).op("CLOCKS", 0)
    for param, v in ((T_DEPTH, 2), (T_GREENLETS, 2), (T_HISTORY, 1),
                     (T_CALL_CLOCK, 1), (T_CPU_MODE, 1), (T_WINDOW, 100000)):
        p.tset(param, v)
    for k in range(5):
        p.sw(k).call(k).call(k).call(k)
    p.op("FLUSH", 0).tset(T_GREENLETS, 1).sw(3).sw(4).sw(5)
    p.op("TSET", 0, T_DEPTH, 0xFF).b.extend(b"\x00\x00\x00\x00\x00\x00\x00\x05")
    return p.op("CHECK")


def two_tracers():
    p = Prog(TWO_TRACERS | SET_CPU_MODE | CPU_EXACT)
    p.op("DEFAULT", 1, 0)
    for i in range(10):
        p.sw(i % 3, t=0).run(i, t=0).sw(i % 4, t=1).idle(i, t=1)
        p.call(i % 5, t=i % 2).run(1, t=i % 2)
    p.attach(0, 1, t=1).attach(1, 1, t=0).sw(1, t=0).sw(0, t=1)
    p.ret(t=0).ret(t=1).op("NEWTRACER", 1).sw(0, t=1).op("FLUSH", 0)
    return p.op("CHECK")


def names():
    p = Prog(SMALL_CAPS_P0)
    p.sw(0).sw(1)
    p.name(0, 0, b"main-greenlet", b"module.function")
    p.name(0, 1, b"\xff\xfe\x00abc", b"")
    p.name(0, 2, b"x" * 70, b"y" * 70, live_id=False)
    p.name(1, 3, b"", b"fn", live_id=False)
    p.newprof(2, 5, pol_extra=32 | (2 << 6))
    p.name(2, 0, b"truncated-name", b"truncated-fn")
    p.name(0, 0, b"ignored", b"kept", null_name=True)
    p.name(0, 0, b"renamed", b"ignored", null_fn=True)
    p.name(NULL_PROF, 0, b"nobody", b"")
    return p.op("CHECK")


def tags():
    p = Prog(SET_CPU_MODE | CPU_OFF)
    for i in range(8):
        p.run(i + 1).sw(i % 2)
    for idx in (0, 1, 5, 6, 7, 200):
        p.op("TAG", 0, idx, idx * 3 + 1)
    p.op("TAG", NULL_PROF, 0, 1)
    return p.op("CHECK")


def forget_and_mismatch():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.ret().call(2).sw_zero_from(0).call(3).sw_from(5, 1).sw_from(0, 2)
    p.op("FORGET", 0, 2).op("FORGET", 0, 0).op("FORGET", 0, 40)
    p.call(4).ret().ret().ret().ret().sw_zero_from(3).sw(3).sw(0)
    p.op("SWITCH", 0, 0, 1, 250)  # unknown flag bits
    return p.op("CHECK")


def null_slots():
    p = Prog()
    p.newprof(1, 0xEE).newprof(2, 0xEE).op("DEFAULT", 0, 1).sw(0)
    p.attach(0, 2).op("CLOSE", 1).op("CLEAR", 2).op("RETAIN", 1)
    p.op("PSET", 1, P_MAX_SPANS, 1).op("TAG", 2, 0, 0).waited(1, 1, 1, 1)
    p.op("RETAIN", 0).sw(1).op("NEWPROF", 1, 3, 0, 0).attach(1, 1).sw(0)
    return p.op("CHECK")


def profile_params():
    p = Prog()
    for param in range(0, 8):
        p.op("PSET", 1, param, V[3])
    p.attach(0, 1).sw(0).attach(0, 1).run(3).sw(1).sw(0)
    for param in range(0, 8):
        p.op("PSET", 1, param, V[1])
    p.op("CLEAR", 1).pset(1, P_MAX_SPANS, 1).pset(1, P_POLICY, 1)
    p.run(1).sw(1).run(1).sw(0).run(1).sw(1)
    return p.op("CHECK")


def estimate_windows():
    p = Prog(SET_CPU_MODE | CPU_ESTIMATE)
    for w in (1, 100, 1000, 100000):
        p.op("FLUSH", 0).tset(T_WINDOW, w).sw(0)
        for i in range(10):
            p.call(i % 4).run(i * 3 % 32, i % 4).idle(i * 5 % 32, i % 3)
            p.sw((i + 1) % 3).ret()
    return p.op("CHECK")


def spawn_and_dead_parents():
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.sw(0).attach(0, 1).op("SPAWN", 0, 0, 2).inherit(5, 0).sw(5).run(2)
    p.sw(0).attach(0, NULL_PROF).op("SPAWN", 0, 0, 1).inherit(6, 0).sw(6)
    p.sw(0, dead=True).inherit(7, 0).sw(7).run(1).sw(6)
    p.op("SPAWN", 0, 40, 1).op("SPAWN", 0, ZERO_KEY, 1).op("SPAWN", 0, 6, 3)
    p.sw(8).op("CLOSE", 2).inherit(9, 5).sw(9).op("NEWPROF", 1, 3, 0, 0)
    return p.op("CHECK")


def alloc_failures():
    p = Prog(SET_CPU_MODE | CPU_ESTIMATE)
    for n in range(0, 24, 3):
        p.op("FAILALLOC", n).sw(n % 7 + 10).call(n % 5 + 2).run(n)
        p.op("FAILALLOC", 1).name(0, n % 7 + 10, b"n" * (n + 1), b"f")
        p.op("FAILALLOC", 0).op("NEWPROF", 2, 4, 1, 0x33)
        p.op("FAILALLOC", 2).op("NEWTRACER", 1).op("FAILALLOC", 0)
        p.waited(0, amount(5), amount(9), 4).op("FAILALLOC", 0)
        p.attach(n % 7 + 10, 2).ret().op("FAILALLOC", 0).op("FLUSH", 0)
    return p.op("CHECK")


def wait_sites():
    """Attached greenlets switch out, say where they wait (some sites past
    a cap of 2, some keys and sites invalid), are detached, closed or
    cleared while waiting, and flushed."""
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.op("NEWPROF", 1, 3, 0, 0).pset(1, 7, 2)
    p.sw(0).attach(0, 1).inherit(1, 0)
    for i in range(6):
        p.sw(1 + i % 2).op("WAIT_AT", 0, i % 2, 2 + i % 4).idle(3 + i)
        p.sw(i % 2).run(i)
    p.op("WAIT_AT", 0, ZERO_KEY, 2).op("WAIT_AT", 0, 0, 255)
    p.sw(3).op("WAIT_AT", 0, 0, 5).attach(0, NULL_PROF).sw(0).attach(0, 1)
    p.sw(3).op("WAIT_AT", 0, 0, 6).op("CLEAR", 1).sw(0)
    p.sw(3).op("FAILALLOC", 0).op("WAIT_AT", 0, 0, 7).op("FLUSH", 0)
    p.sw(0).sw(3).op("WAIT_AT", 0, 0, 8).op("CLOSE", 1).sw(0)
    return p.op("CHECK")


def session():
    """A session profile beside the default and attached profiles: calls
    open across attaches, detaches, closes, clears, deaths, a session
    replaced and unset, and a flush."""
    p = Prog(SET_CPU_MODE | CPU_EXACT)
    p.op("NEWPROF", 1, 3, 0, 0).op("NEWPROF", 2, 3, 0, 0)
    p.op("DEFAULT", 0, 0).op("SESSION", 0, 0)
    p.sw(0).call(1).attach(0, 1).call(2).call(2).run(3).sw(1).call(3)
    p.sw(0).ret().attach(0, NULL_PROF).ret().call(4).op("CLOSE", 1)
    p.sw(1).ret().sw(0).attach(0, 2).call(5).op("CLEAR", 0).run(2).ret()
    p.op("SESSION", 0, 2).call(1).op("SESSION", 0, 1).ret()
    p.sw(1, dead=True).op("SESSION", 0, NULL_PROF).call(2).op("FLUSH", 0)
    return p.op("CHECK")


def random_prog(seed, nops):
    rnd = random.Random(seed)
    p = Prog(rnd.randrange(256))
    for _ in range(nops):
        op = rnd.choices(range(len(OPS)),
                         weights=[20, 12, 10, 8, 4, 3, 2, 1, 1, 2, 1, 1, 1,
                                  1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 2,
                                  1])[0]
        p.b.append(op)
        for _ in range(rnd.randrange(7)):
            p.b.append(rnd.randrange(40) if rnd.random() < 0.8
                       else rnd.randrange(256))
    return p


SCENARIOS = [
    seed_scenario, seed_scenario_wall, recursion, attach_detach, inherit,
    close_attached, clear_open_frames, span_caps, depth_overflow,
    dead_key_reuse, huge_keys, waited, tracer_params, two_tracers, names,
    tags, forget_and_mismatch, null_slots, profile_params, estimate_windows,
    spawn_and_dead_parents, alloc_failures, wait_sites, session,
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(out, exist_ok=True)
    files = {}
    for fn in SCENARIOS:
        files[fn.__name__] = fn().bytes()
    for i, (seed, nops) in enumerate(((1, 60), (2, 150), (3, 300), (4, 600),
                                      (5, 1000), (6, 200))):
        files["random_%d" % i] = random_prog(seed, nops).bytes()
    for name, data in sorted(files.items()):
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print("wrote %d files to %s" % (len(files), out))


if __name__ == "__main__":
    main()
