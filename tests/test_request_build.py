"""What a delivered RequestProfile keeps of sources that move on after the
request (read out by _registry.read_profile when it is finalized)."""
import gevent

from greqprof import _registry
from test_middleware import ok, serve  # noqa: F401  (serve: the fixture)

LONG_NAME = "n" * 300  # longer than the profile's copy (255 bytes)


def test_names_of_dead_greenlets_are_read_when_the_request_ends(serve):
    def app(environ, start_response):
        g = gevent.Greenlet(gevent.sleep, 0)
        g.name = LONG_NAME
        g.start()
        g.join()
        return ok()(environ, start_response)

    s = serve(app, pct=1.0, linger=0)
    assert s.get("/named").status == 200
    p = s.profile_for("/named")
    assert "spans" not in vars(p)  # not read yet
    # The registry forgets a dead greenlet's name 256 deaths later.
    gevent.joinall([gevent.spawn(int) for _ in range(600)])
    named = [gid for gid, n in _registry.names.items()
             if n and n[0] == LONG_NAME]
    assert not named, "the registry still knows the greenlet"
    spans = [sp for sp in p.spans if sp.fn_name == "gevent.hub.sleep"]
    assert spans and {sp.greenlet_name for sp in spans} == {LONG_NAME}
    g = [g for g in p.greenlets if g.id == spans[0].greenlet_id]
    assert g[0].name == LONG_NAME and g[0].finished


def test_a_snapshot_leaves_the_stacks_to_the_final_profile(serve):
    """An observer's snapshot of an open profile copies the stacks of its
    spans; the final profile takes them out of the registry."""
    snapshots = []

    class Observer:
        def on_response_end(self, req, snapshot, blocking):
            snapshots.append(snapshot)

    def app(environ, start_response):
        import time
        time.sleep(0.12)  # a long span: where it switched out is kept
        gevent.sleep(0)
        return ok()(environ, start_response)

    s = serve(app, pct=1.0, linger=0, blocking_ms=100,
              observers=[Observer()])
    assert s.get("/stacked").status == 200
    p = s.profile_for("/stacked")
    stacked = [sp for sp in p.spans if sp.stack]
    assert stacked and ", in app\n" in stacked[0].stack
    assert [sp.stack for sp in snapshots[0].spans if sp.stack] == \
        [sp.stack for sp in stacked]
    assert stacked[0].stack not in _registry.stacks.values()


def test_function_names_follow_the_code_registry(monkeypatch):
    """The cleaned names of a function key are kept from one sampled
    request to the next, but only while the code registry holds the same
    object under that key: a key given to another function names that
    one."""
    from greqprof import _collect

    def first():
        pass

    def second():
        pass

    key = 0x5A5A5A
    monkeypatch.setitem(_registry.codes, key, first.__code__)
    assert _collect._func_info(key)[0] == "first"
    assert _collect._func_info(key)[0] == "first"
    monkeypatch.setitem(_registry.codes, key, second.__code__)
    assert _collect._func_info(key)[0] == "second"
    monkeypatch.delitem(_registry.codes, key)
    assert _collect._func_info(key)[0] == "<unknown>"


def test_own_frames_get_no_entry_of_their_own_in_a_calls_profile(serve):
    def work():
        return sum(range(10))

    def app(environ, start_response):
        work()
        return ok()(environ, start_response)

    s = serve(app, pct=1.0, calls=True, linger=0)
    assert s.get("/calls").status == 200
    p = s.profile_for("/calls")
    names = {f.name for f in p.calls}
    assert "work" in names
    # (records built without their __init__: every field there, as the
    # constructor would have made them)
    import dataclasses
    for rec in p.calls + [c for f in p.calls for c in f.children]:
        kw = {fld.name: getattr(rec, fld.name)
              for fld in dataclasses.fields(rec)}
        assert set(vars(rec)) == set(kw)
        assert rec == type(rec)(**kw) and hash(rec) == hash(type(rec)(**kw))
    assert any(f.children for f in p.calls)
    assert not [f for f in p.calls if "/greqprof/" in f.filename
                and "/tests/" not in f.filename]


def test_route_numbers_name_each_wait_site_by_its_own_record():
    """route_numbers keeps the text of a wait site per record object: a
    new record (another site) is named after itself, a dropped one "?"."""
    from greqprof import _collect

    def raw_with(records):
        stats = b"".join(_collect.WAIT_SITE_ROW.pack(i, 1000, 1, 1, 0, 0)
                         for i in range(len(records)))
        greenlets = _collect.GREENLET_ROW.pack(1, 5, 2000, 1, 0, 0, 1)
        return (b"", greenlets, None, 0, 3000, (), 1, 0, 0, 0, 0, {}, {},
                (records, stats, 0, b"", 0))

    a = (None, "f", "a.py", 3, ())
    cpu, waiting, sites = _collect.route_numbers(raw_with([a, None]))
    assert (round(cpu * 1e9), round(waiting * 1e9)) == (2000, 3000)
    assert [s for s, _ in sites] == ["f (a.py:3)", "? (:0)"]
    assert _collect.route_numbers(raw_with([a]))[2][0][0] == "f (a.py:3)"
    b = (None, "g", "b.py", 7, ())
    assert _collect.route_numbers(raw_with([b]))[2][0][0] == "g (b.py:7)"
