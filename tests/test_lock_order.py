"""Device-lock grant order (scheduler/runtime/lock_order.py), by hand-checkable cases: priority and
arrival (rule 1), producers before their consumers (rule 2, also transitively and around
cycles), no starvation of a multi-device request (rule 3), held devices."""

from __future__ import annotations

from m2flow.scheduler.runtime.lock_order import LockRequest, grants, reaches, upstream_first


def req(group: str, devices=(0,), priority: int = 0, seq: int = 0) -> LockRequest:
    return LockRequest(f"{group}:0", group, tuple(devices), priority, seq)


def keys(requests) -> list[str]:
    return [r.key for r in requests]


def test_reaches_follows_edges_forward_only():
    downstream = {"a": {"b"}, "b": {"c"}, "x": {"y"}, "y": {"x"}}
    assert reaches(downstream, "a", "b") and reaches(downstream, "a", "c")  # direct, transitive
    assert not reaches(downstream, "c", "a") and not reaches(downstream, "b", "a")
    assert not reaches(downstream, "a", "x")  # unconnected
    assert reaches(downstream, "x", "y") and reaches(downstream, "y", "x")  # a cycle
    assert not reaches(downstream, "a", "a")  # no path back to itself
    assert reaches(downstream, "x", "x")  # ... unless through a cycle


def test_priority_then_arrival():
    reqs = [req("c", priority=2, seq=0), req("a", priority=0, seq=2), req("b", priority=0, seq=1)]
    assert keys(upstream_first(reqs, {})) == ["b:0", "a:0", "c:0"]
    # one device: only the first in that order is granted now
    assert keys(grants(reqs, held=(), downstream={})) == ["b:0"]
    # the input order does not matter
    assert keys(grants(reqs[::-1], held=(), downstream={})) == ["b:0"]


def test_producer_before_consumer_with_lower_priority_and_earlier_arrival():
    cons = req("cons", priority=0, seq=0)  # would go first by rule 1 alone
    prod = req("prod", priority=1, seq=1)
    assert keys(grants([cons, prod], (), {})) == ["cons:0"]  # no dependency known
    assert keys(grants([cons, prod], (), {"prod": {"cons"}})) == ["prod:0"]
    assert keys(upstream_first([cons, prod], {"prod": {"cons"}})) == ["prod:0", "cons:0"]


def test_producer_first_transitively():
    # a -> b -> c, priorities the other way round
    reqs = [req("c", priority=0), req("b", priority=1), req("a", priority=2)]
    downstream = {"a": {"b"}, "b": {"c"}}
    assert keys(upstream_first(reqs, downstream)) == ["a:0", "b:0", "c:0"]
    # with b not waiting, a still precedes c (a feeds c through b)
    assert keys(upstream_first([reqs[0], reqs[2]], downstream)) == ["a:0", "c:0"]


def test_unrelated_request_keeps_its_priority_place():
    # cons must follow prod; other is unrelated and has priority between them: it goes first
    # (cons is not eligible until prod went), then prod, then cons
    reqs = [req("cons", priority=0), req("other", priority=1), req("prod", priority=2)]
    order = upstream_first(reqs, {"prod": {"cons"}})
    assert keys(order) == ["other:0", "prod:0", "cons:0"]


def test_cycle_keeps_rule_one_order():
    a, b = req("a", priority=2), req("b", priority=0)
    cycle = {"a": {"b"}, "b": {"a"}}
    assert keys(upstream_first([a, b], cycle)) == ["b:0", "a:0"]
    assert keys(upstream_first([a, b], {"a": {"b"}})) == ["a:0", "b:0"]  # control: no cycle
    # members of a cycle do not hold each other back behind an unrelated request
    other = req("other", priority=1)
    assert keys(upstream_first([a, b, other], cycle)) == ["b:0", "other:0", "a:0"]
    # a group feeding the cycle goes before both; inside the cycle rule 1 stands
    c = req("c", priority=3)
    fed = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert keys(upstream_first([a, b, c], fed)) == ["c:0", "b:0", "a:0"]
    assert keys(grants([a, b, c], (), fed)) == ["c:0"]


def test_multi_device_request_blocks_later_requests_on_its_devices():
    # ab needs devices 0 and 1; device 0 is held. b1 (device 1, free) comes later in order:
    # granting it would let a stream of single-device requests starve ab.
    ab = req("ab", devices=(0, 1), priority=0)
    b1 = req("b1", devices=(1,), priority=1)
    c2 = req("c2", devices=(2,), priority=2)  # devices ab does not want: not blocked
    assert keys(grants([ab, b1, c2], held={0}, downstream={})) == ["c2:0"]
    # a request before ab in the order does take device 1
    x = req("x", devices=(1,), priority=-1)
    assert keys(grants([ab, b1, c2, x], held={0}, downstream={})) == ["x:0", "c2:0"]
    # once device 0 is free, ab goes (and b1 still waits: ab takes device 1)
    assert keys(grants([ab, b1, c2], held=(), downstream={})) == ["ab:0", "c2:0"]


def test_held_devices_and_disjoint_grants():
    a = req("a", devices=(0,), priority=0)
    b = req("b", devices=(1,), priority=1)
    c = req("c", devices=(0,), priority=2)
    assert keys(grants([a, b, c], held={1}, downstream={})) == ["a:0"]  # b: held; c: after a
    assert keys(grants([a, b, c], held=(), downstream={})) == ["a:0", "b:0"]  # disjoint
    assert keys(grants([a, b, c], held={0, 1}, downstream={})) == []
    assert grants([], held={0}, downstream={}) == []


def test_waiting_producer_on_a_held_device_blocks_its_collocated_consumer():
    # prod and cons share device 0, held by a third worker: neither is granted now, and when
    # the device frees the producer is granted, not the consumer that asked first
    cons = req("cons", devices=(0,), priority=0, seq=0)
    prod = req("prod", devices=(0,), priority=1, seq=1)
    feeds = {"prod": {"cons"}}
    assert grants([cons, prod], held={0}, downstream=feeds) == []
    assert keys(grants([cons, prod], held=(), downstream=feeds)) == ["prod:0"]
    # a consumer on another device is not held back by its producer's wait
    far = req("cons", devices=(1,), priority=0, seq=0)
    assert keys(grants([far, prod], held={0}, downstream=feeds)) == ["cons:0"]
