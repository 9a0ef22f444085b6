# SPDX-License-Identifier: Apache-2.0
"""KV events on the wire (docs/kv_events.md): a ZeroMQ subscriber written against vLLM's format
alone (python3-zmq, python3-msgpack; no blockkv import in its decoding) rebuilds the set of
cached blocks of every medium from the events, and after a long random run with prefix hits,
evictions, host demotions and promotions, resets, lost messages (replay) and a full publisher
queue (resync) it equals what the manager holds."""

import pickle
import random

import blockkv
import msgpack
import pytest
import zmq

from conftest import allocate, kv_config

BLOCK = 4
TOPIC = b"blockkv"


def events_config(**kwargs):
    kwargs.setdefault("replay_endpoint", "tcp://127.0.0.1:*")
    kwargs.setdefault("topic", TOPIC.decode())
    return blockkv.KVEventsConfig("tcp://127.0.0.1:*", **kwargs)


def make_manager(events, device_blocks=24, host_blocks=32):
    config = blockkv.StateManagerConfig(
        memory_config=allocate(device_blocks), max_tracked_sequences=8,
        max_ragged_sequence_count=8, max_ragged_batch_size=256, offload=True,
        offload_config=blockkv.OffloadConfig(host_blocks=host_blocks),
        prefix_cache=blockkv.PrefixCacheConfig(), kv_events=events)
    return blockkv.StateManager(config, (kv_config(block_size=BLOCK),), device="cpu")


class Router:
    """What a vLLM KV router keeps: per (medium, group) the set of block hashes, from
    KVEventBatch = [ts, events, data_parallel_rank] payloads with array_like tagged events."""

    def __init__(self):
        self.blocks = {}
        self.expected_seq = 0

    def apply(self, payload):
        ts, events, dp_rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and dp_rank == 0
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                assert len(event) == 10
                (_, hashes, parent, token_ids, block_size, lora_id, medium, lora_name,
                 extra_keys, group) = event
                assert block_size == BLOCK and len(token_ids) == BLOCK * len(hashes)
                assert parent is None or len(parent) == 16
                assert lora_id is None and lora_name is None and extra_keys is None
                self.blocks.setdefault((medium, group), set()).update(
                    int.from_bytes(h, "big") for h in hashes)
            elif tag == "BlockRemoved":
                assert len(event) == 4
                _, hashes, medium, group = event
                self.blocks.setdefault((medium, group), set()).difference_update(
                    int.from_bytes(h, "big") for h in hashes)
            else:
                assert event == ["AllBlocksCleared"]
                self.blocks.clear()

    def held(self, medium, group=0):
        return self.blocks.get((medium, group), set())


class Subscriber:
    """SUB for the live stream, DEALER for replays (vLLM's subscriber example's protocol)."""

    def __init__(self, manager, lose_every=0):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(manager.kv_events_endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.RCVTIMEO, 10000)  # a hang guard, not a timing assertion
        self.replay.connect(manager.kv_events_replay_endpoint)
        self.router = Router()
        self.lose_every = lose_every
        self.received = 0
        self.lost = 0
        self.replays = 0

    def catch_up(self):
        """Asks for every batch from the next expected sequence number on."""
        self.replay.send_multipart([b"", self.router.expected_seq.to_bytes(8, "big")])
        self.replays += 1
        while True:
            empty, seq_bytes, payload = self.replay.recv_multipart()
            assert empty == b""
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                assert payload == b""
                return
            assert seq == self.router.expected_seq
            self.router.apply(payload)
            self.router.expected_seq += 1

    def poll(self):
        while self.sub.poll(0):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC
            seq = int.from_bytes(seq_bytes, "big")
            self.received += 1
            if self.lose_every and self.received % self.lose_every == 0:
                self.lost += 1  # as if the network lost it: the next one shows a gap
                continue
            if seq < self.router.expected_seq:
                continue  # already applied through a replay
            if seq > self.router.expected_seq:
                self.catch_up()  # a gap (or the messages before this SUB joined)
                continue
            self.router.apply(payload)
            self.router.expected_seq += 1

    def close(self):
        self.sub.close(0)
        self.replay.close(0)
        self.ctx.term()


def test_config_has_vllms_names_and_validates():
    c = blockkv.KVEventsConfig("tcp://*:5557", replay_endpoint="tcp://*:5558", topic="kv",
                               max_queue_size=8)
    assert (c.endpoint, c.replay_endpoint, c.topic, c.max_queue_size) == (
        "tcp://*:5557", "tcp://*:5558", "kv", 8)
    assert blockkv.KVEventsConfig().replay_endpoint is None
    assert pickle.loads(pickle.dumps(c)) == c
    config = blockkv.StateManagerConfig(prefix_cache=blockkv.PrefixCacheConfig(), kv_events=c)
    assert config.kv_events == c and "kv_events=KVEventsConfig(" in repr(config)
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(ValueError, match="KVEventsConfig.endpoint = 'http://x:1'"):
        blockkv.KVEventsConfig("http://x:1")
    with pytest.raises(ValueError, match="max_queue_size"):
        blockkv.KVEventsConfig(max_queue_size=0)
    with pytest.raises(ValueError, match="kv_events needs prefix_cache.enabled"):
        blockkv.StateManagerConfig(kv_events=c)
    with pytest.raises(TypeError, match="kv_events must be None or a blockkv.KVEventsConfig"):
        blockkv.StateManagerConfig(prefix_cache=blockkv.PrefixCacheConfig(), kv_events="tcp://x")


def test_an_endpoint_in_use_is_a_value_error_and_starts_nothing():
    first = make_manager(events_config())
    with pytest.raises(ValueError, match="replay_endpoint.*Address already in use"):
        make_manager(events_config(replay_endpoint=first.kv_events_replay_endpoint))
    with pytest.raises(RuntimeError, match="publishes no KV events"):
        blockkv.StateManager(
            blockkv.StateManagerConfig(memory_config=allocate(8),
                                       prefix_cache=blockkv.PrefixCacheConfig()),
            (kv_config(block_size=BLOCK),), device="cpu").kv_events_stats


def test_a_router_rebuilds_every_medium_through_losses_replays_and_drops():
    rng = random.Random(20)
    manager = make_manager(events_config(max_queue_size=4, buffer_steps=1_000_000))
    sub = Subscriber(manager, lose_every=7)
    shared = [[rng.randrange(1000, 2000) for _ in range(BLOCK * 5)] for _ in range(6)]
    live = {}  # uid -> tokens
    next_uid = 0
    saw_host = False
    for step in range(1500):
        if step == 700:
            manager._pause_kv_events(True)  # the publisher falls behind: its queue of 4 fills
        if step == 760:
            manager._pause_kv_events(False)
        r = rng.random()
        if len(live) < 2 and r < 0.5:
            prefix = shared[rng.randrange(len(shared))][:BLOCK * rng.randrange(1, 6)]
            prompt = prefix + [rng.randrange(3000, 4000) for _ in range(rng.randrange(1, 9))]
            uid, next_uid = next_uid, next_uid + 1
            manager.add_sequence(uid, prompt)
            manager.schedule([uid], [len(prompt)])
            manager.post_forward([uid])
            live[uid] = prompt
        elif live and r < 0.8:
            uid = rng.choice(sorted(live))
            if len(live[uid]) < 40:
                token = rng.randrange(5000, 6000)
                manager.append_tokens(uid, [token])
                manager.schedule([uid], [1])
                manager.post_forward([uid])
                live[uid].append(token)
        elif live:
            uid = rng.choice(sorted(live))
            manager.flush_sequence(uid)
            del live[uid]
        if rng.random() < 0.003:
            manager.reset_prefix_cache()
        saw_host = saw_host or bool(manager.cached_block_hashes(medium="CPU"))
        sub.poll()
    manager.publish_kv_events(wait=True)
    sub.poll()
    sub.catch_up()
    manager.check_invariants()

    assert sub.router.held("GPU") == manager.cached_block_hashes(medium="GPU")
    assert sub.router.held("CPU") == manager.cached_block_hashes(medium="CPU")
    assert manager.cached_block_hashes()  # the run ends with blocks cached
    assert saw_host and manager.host_prefix_stats()["promoted"] > 0
    stats = manager.kv_events_stats
    assert stats.batches_dropped > 0 and stats.events_dropped > 0
    assert stats.resyncs >= 1
    assert sub.lost > 0 and sub.replays > 0 and stats.replay_requests > 0
    sub.close()


def test_reset_is_all_blocks_cleared_and_int_hashes_are_the_low_64_bits():
    manager = make_manager(events_config(int_block_hashes=True))
    sub = Subscriber(manager)
    prompt = list(range(100, 113))  # 3 full blocks
    manager.add_sequence(1, prompt)
    manager.schedule([1], [len(prompt)])
    manager.post_forward([1])
    manager.flush_sequence(1)
    manager.reset_prefix_cache()
    manager.publish_kv_events(wait=True)
    batches = []
    sub.replay.send_multipart([b"", (0).to_bytes(8, "big")])
    while True:
        _, seq_bytes, payload = sub.replay.recv_multipart()
        if int.from_bytes(seq_bytes, "big", signed=True) == -1:
            break
        batches.append(msgpack.unpackb(payload, raw=False))
    stored = batches[0][1][0]
    assert stored[0] == "BlockStored" and len(stored[1]) == 3
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in stored[1])
    assert stored[2] is None and stored[3] == prompt[:12] and stored[6] == "GPU"
    assert stored[1][1] and stored[9] == 0
    assert batches[-1][1] == [["AllBlocksCleared"]]
    sub.close()


def test_replay_requests_that_are_not_vllms_are_ignored():
    """A request of many frames, one whose start is not 8 bytes and one with a 4 MiB frame get
    no answer, and the well-formed requests before and after them are answered in full. (The
    publisher keeps at most the first frames of a request and has ZeroMQ refuse frames over
    1 KiB; what that saves in memory is not measured here.)"""
    manager = make_manager(events_config())
    manager.add_sequence(1, list(range(100, 109)))
    manager.schedule([1], [9])
    manager.post_forward([1])
    manager.publish_kv_events(wait=True)
    ctx = zmq.Context()

    def ask(sock):
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            _, seq_bytes, _ = sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return seqs
            seqs.append(seq)

    def dealer():
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVTIMEO, 10000)  # a hang guard, not a timing assertion
        sock.connect(manager.kv_events_replay_endpoint)
        return sock

    first = dealer()
    expected = ask(first)
    assert expected, "nothing to replay"
    first.send_multipart([b""] * 10000)  # many frames
    first.send_multipart([b"", b"x" * 7])  # a start of 7 bytes
    assert ask(first) == expected
    huge = dealer()
    huge.send_multipart([b"", b"\0" * (4 << 20)])
    last = dealer()
    assert ask(last) == expected
    assert manager.kv_events_stats.replay_requests == 3
    for sock in (first, huge, last):
        sock.close(0)
    ctx.term()
