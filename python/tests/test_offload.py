# SPDX-License-Identifier: Apache-2.0
"""Offload and preemption from Python: BlockedKVCache(offload=True) with offload / restore / spill /
drop and their tickets, StateManager.preempt_sequence / resume_sequence, OffloadConfig, and the
prefix cache's host level. Data is compared byte for byte through torch views of the cache."""

import gc
import os
import pickle

import blockkv
import numpy as np
import pytest
import torch
from conftest import allocate, kv_config, requires_gpu

OffloadConfig = blockkv.OffloadConfig
OffloadTicket = blockkv.OffloadTicket


def offload_cache(num_blocks=8, configs=None, device="cpu", **offload):
    configs = configs if configs is not None else (kv_config(block_size=4),)
    offload.setdefault("host_blocks", 4)
    return blockkv.BlockedKVCache(configs, allocate(num_blocks), offload=True, device=device,
                                  **offload)


def layers(cache, group=0):
    """Every layer of a group as a torch view of its int16 bits (fp16 NaN payloads included)."""
    n = cache.config(group).cache_shape[0]
    return [torch.from_dlpack(cache.get_cache(i, group)).view(torch.int16) for i in range(n)]


def fill(views, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.as_tensor(np.asarray(blocks, dtype=np.int64))
    for view in views:
        view[idx] = torch.randint(-2**15, 2**15, (len(idx), *view.shape[1:]), generator=g,
                                  dtype=torch.int16).to(view.device)
    return [view[idx].clone() for view in views]


def contents(views, blocks):
    idx = torch.as_tensor(np.asarray(blocks, dtype=np.int64))
    return [view[idx].clone() for view in views]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def scribble(views):
    for view in views:
        view.fill_(0x5A5A)


# ---- BlockedKVCache ----------------------------------------------------------------------------

def test_offload_and_restore_are_byte_exact():
    cache = offload_cache(num_blocks=8, host_blocks=4)
    assert cache.offload_enabled and cache.host_blocks == 4 and cache.disk_blocks == 0
    views = layers(cache)
    blocks = cache.reserve(3)
    expected = fill(views, blocks, seed=1)

    handles, ticket = cache.offload(blocks)
    assert isinstance(ticket, OffloadTicket)
    assert handles.dtype == np.int64 and handles.shape == (3,)
    assert len(set(handles.tolist())) == 3
    assert ticket.wait() is None
    assert ticket.poll() and ticket.wait() is None  # done stays done, same status
    # The device blocks went back to the free list once the copy was done.
    assert cache.free_blocks == [8]
    assert cache.free_host_blocks() == 1
    assert all(cache.handle_tier(h) == "host" for h in handles)

    scribble(views)
    restored, ticket = cache.restore(handles)
    assert restored.dtype == np.int32 and restored.shape == (3,)
    ticket.wait()
    assert same(contents(views, restored), expected)
    assert cache.free_blocks == [5] and cache.free_host_blocks() == 4
    stats = cache.offload_stats()
    assert stats["offloaded_blocks"] == 3 and stats["restored_blocks"] == 3
    assert stats["bytes_written"] == 3 * cache.bytes_per_block == stats["bytes_read"]
    assert stats["live_handles"] == 0 and stats["failed_copies"] == 0
    cache.check_invariants()


def test_several_groups_and_handles_from_any_sequence_type():
    configs = (kv_config(block_size=4, layers=1, heads=2, head_size=8),
               kv_config(block_size=8, layers=3, heads=1, head_size=16, dtype="bf16"))
    cache = offload_cache(num_blocks=6, configs=configs, host_blocks=3)
    first, second = layers(cache, 0), layers(cache, 1)
    b0 = cache.reserve(2)
    b1 = cache.reserve(3, cache_group=1)
    e0, e1 = fill(first, b0, seed=2), fill(second, b1, seed=3)
    h0, t0 = cache.offload(b0.tolist())  # a list
    h1, t1 = cache.offload(torch.tensor(b1.tolist()), cache_group=1)  # a torch tensor
    t0.wait()
    t1.wait()
    assert cache.free_blocks == [6, 6]
    scribble(first + second)
    # A handle of group 1 is not a handle of group 0.
    with pytest.raises(ValueError):
        cache.restore(h1, cache_group=0)
    r1, t1 = cache.restore(torch.from_numpy(h1), cache_group=1)
    r0, t0 = cache.restore(h0.tolist())
    t0.wait()
    t1.wait()
    assert same(contents(first, r0), e0) and same(contents(second, r1), e1)
    cache.check_invariants()


def test_handles_pack_index_and_generation():
    cache = offload_cache(num_blocks=4, host_blocks=2)
    views = layers(cache)
    blocks = cache.reserve(1)
    fill(views, blocks, seed=4)
    (old,), ticket = cache.offload(blocks)
    ticket.wait()
    restored, ticket = cache.restore([old])
    ticket.wait()
    # The same block again: a handle entry may be reused, never with the same generation.
    expected = fill(views, restored, seed=5)
    (new,), ticket = cache.offload(restored)
    ticket.wait()
    assert new != old
    if new & 0xFFFFFFFF == old & 0xFFFFFFFF:  # same index: the generation (high 32 bits) moved on
        assert new >> 32 != old >> 32
    # The stale handle is an error, never another block's data.
    with pytest.raises(ValueError, match="not a live handle"):
        cache.restore([old])
    with pytest.raises(ValueError):
        cache.handle_tier(old)
    with pytest.raises(ValueError):
        cache.restore([-1])
    back, ticket = cache.restore(np.array([new], dtype=np.int64))
    ticket.wait()
    assert same(contents(views, back), expected)


def test_disk_tier_round_trip_and_spill(tmp_path):
    path = tmp_path / "kv.bin"
    cache = offload_cache(num_blocks=8, host_blocks=2, disk_path=path, disk_blocks=4)
    assert cache.disk_blocks == 4 and cache.free_disk_blocks() == 4
    assert path.exists()
    views = layers(cache)
    blocks = cache.reserve(5)
    expected = fill(views, blocks, seed=6)

    to_disk, t1 = cache.offload(blocks[:3], tier="disk")
    to_host, t2 = cache.offload(blocks[3:])
    t1.wait()
    t2.wait()
    assert [cache.handle_tier(h) for h in to_disk] == ["disk"] * 3
    assert [cache.handle_tier(h) for h in to_host] == ["host"] * 2
    assert cache.free_disk_blocks() == 1 and cache.free_host_blocks() == 0

    # Spill: the handles stay the same and move to disk.
    with pytest.raises(blockkv.ResourceExhaustedError):  # 2 host handles, 1 free disk slot
        cache.spill(to_host)
    cache.spill(to_host[:1]).wait()
    assert cache.handle_tier(to_host[0]) == "disk" and cache.handle_tier(to_host[1]) == "host"
    assert cache.offload_stats()["spilled_blocks"] == 1

    scribble(views)
    handles = np.concatenate([to_disk, to_host])
    restored, ticket = cache.restore(handles)
    ticket.wait()
    assert same(contents(views, restored), expected)
    assert cache.free_disk_blocks() == 4 and cache.free_host_blocks() == 2
    cache.check_invariants()

    # The file goes with the store: after the cache and every ticket of it.
    del cache, ticket, t1, t2
    gc.collect()
    assert not path.exists()


def test_a_corrupt_disk_slot_is_a_runtime_error_and_keeps_the_handles(tmp_path):
    path = tmp_path / "kv.bin"
    cache = offload_cache(num_blocks=4, host_blocks=1, disk_path=str(path), disk_blocks=2)
    views = layers(cache)
    blocks = cache.reserve(2)
    expected = fill(views, blocks, seed=7)
    handles, ticket = cache.offload(blocks, tier="disk")
    ticket.wait()
    data = path.read_bytes()
    assert len(data) >= 2 * cache.bytes_per_block
    flipped = bytes(b ^ 0xFF for b in data)
    path.write_bytes(flipped)

    restored, ticket = cache.restore(handles)
    with pytest.raises(RuntimeError, match="checksum|XXH3|corrupt"):
        ticket.wait()
    with pytest.raises(RuntimeError):  # the same status on every call
        ticket.wait()
    assert cache.offload_stats()["failed_copies"] == 1
    # Nothing lost: the handles are kept, the blocks it returned are the caller's.
    assert [cache.handle_tier(h) for h in handles] == ["disk", "disk"]
    cache.free(restored)
    path.write_bytes(data)
    restored, ticket = cache.restore(handles)
    ticket.wait()
    assert same(contents(views, restored), expected)


@pytest.mark.parametrize("path,error", [("/dev/null", ValueError), ("/dev/zero", ValueError),
                                        ("/dev/full", blockkv.ResourceExhaustedError)])
def test_a_disk_tier_that_does_not_read_back_is_refused_when_it_opens(path, error):
    """/dev/null used to accept offloads and free the device blocks; the loss showed at restore."""
    if not os.path.exists(path):
        pytest.skip(f"needs {path}")
    with pytest.raises(error, match=path):
        offload_cache(num_blocks=4, host_blocks=1, disk_path=path, disk_blocks=2)
    assert os.path.exists(path)  # a device node is never removed


def test_a_disk_tier_file_that_may_not_be_written_is_a_permission_error():
    """It was NOT_FOUND before (a ValueError); root may write anything but a read-only sysfs file."""
    path = "/sys/devices/system/cpu/online"
    with pytest.raises(PermissionError, match=path):
        offload_cache(num_blocks=4, host_blocks=1, disk_path=path, disk_blocks=2)


def test_a_handle_of_another_cache_is_a_value_error_that_changes_nothing():
    a = offload_cache(num_blocks=4, host_blocks=2)
    b = offload_cache(num_blocks=4, host_blocks=2)
    expected = []
    handles = []
    for cache, seed in ((a, 13), (b, 14)):
        blocks = cache.reserve(1)
        expected.append(fill(layers(cache), blocks, seed=seed))
        h, ticket = cache.offload(blocks)
        ticket.wait()
        handles.append(h)
    # Same history, so a's handle has an index that is live in b: it must not restore b's block.
    assert handles[0][0] & 0xFFFFFFFF == handles[1][0] & 0xFFFFFFFF
    before = (b.free_blocks, b.free_host_blocks(), b.offload_stats())
    with pytest.raises(ValueError, match="not a live handle of this store"):
        b.restore(handles[0])
    with pytest.raises(ValueError):
        b.drop(handles[0])
    with pytest.raises(ValueError):
        b.handle_tier(int(handles[0][0]))
    assert (b.free_blocks, b.free_host_blocks(), b.offload_stats()) == before
    for cache, h, want in ((a, handles[0], expected[0]), (b, handles[1], expected[1])):
        restored, ticket = cache.restore(h)
        ticket.wait()
        assert same(contents(layers(cache), restored), want)
        cache.check_invariants()


def test_offload_errors_change_nothing():
    cache = offload_cache(num_blocks=8, host_blocks=2)
    views = layers(cache)
    blocks = cache.reserve(3)
    expected = fill(views, blocks, seed=9)
    with pytest.raises(blockkv.ResourceExhaustedError, match="3|2"):  # host tier full
        cache.offload(blocks)
    with pytest.raises(ValueError):  # ResourceExhaustedError is a ValueError too, as DeepSpeed's
        cache.offload(blocks)
    with pytest.raises(ValueError):
        cache.offload(blocks[:1], cache_group=1)  # bad group
    with pytest.raises(ValueError):
        cache.offload([8])  # bad id
    with pytest.raises(ValueError):
        cache.offload([blocks[0], blocks[0]])  # repeated id
    with pytest.raises(ValueError, match="disk"):
        cache.offload(blocks[:1], tier="disk")  # no disk tier
    with pytest.raises(ValueError):
        cache.offload(blocks[:1], tier="gpu")
    with pytest.raises(TypeError):
        cache.offload(blocks[:1], tier=1)
    with pytest.raises(ValueError):
        cache.spill([0])  # no disk tier (and no such handle)
    assert cache.free_host_blocks() == 2 and cache.free_blocks == [5]
    assert cache.offload_stats()["live_handles"] == 0
    assert same(contents(views, blocks), expected)

    handles, ticket = cache.offload(blocks[:2])
    ticket.wait()
    with pytest.raises(ValueError):
        cache.restore([handles[0], handles[0]])  # repeated handle
    for group in (-1, 1):  # -1 is not "any group"
        with pytest.raises(ValueError):
            cache.restore(handles, cache_group=group)
    with pytest.raises(ValueError):
        cache.free_host_blocks(1)
    rest = cache.reserve(cache.free_blocks[0])  # nothing free for a restore
    with pytest.raises(blockkv.ResourceExhaustedError):
        cache.restore(handles)
    cache.free(rest)
    cache.drop(handles[:1])
    with pytest.raises(ValueError):
        cache.restore(handles)  # handles[0] is gone: nothing restored
    assert cache.offload_stats()["live_handles"] == 1
    restored, ticket = cache.restore(handles[1:])
    ticket.wait()
    assert same(contents(views, restored), [e[1:2] for e in expected])
    cache.check_invariants()


def test_misused_blocks_are_value_errors_that_change_nothing():
    """Each of these aborted the interpreter ("check failed at src/offload.cc:59: block 0 is
    already free"); now each is a ValueError before anything changes."""
    cache = offload_cache(num_blocks=4, host_blocks=4)
    views = layers(cache)
    with pytest.raises(ValueError, match="block 0 of group 0 is free"):  # never reserved
        cache.offload([0])
    assert cache.free_blocks == [4] and cache.free_host_blocks() == 4
    assert cache.offload_stats()["live_handles"] == 0
    blocks = cache.reserve(2)
    expected = fill(views, blocks, seed=12)
    handles, ticket = cache.offload(blocks)
    # The store holds the blocks until the copy is reaped: free is refused meanwhile.
    with pytest.raises(ValueError, match="held by an offload store"):
        cache.free(blocks)
    # Offloading them again while the first copy runs (or once it freed them) is refused too.
    with pytest.raises(ValueError, match=f"block {blocks[0]} of group 0"):
        cache.offload(blocks)
    assert cache.offload_stats()["live_handles"] == 2 and cache.free_host_blocks() == 2
    ticket.wait()
    assert cache.free_blocks == [4]
    cache.check_invariants()
    restored, ticket = cache.restore(handles)
    ticket.wait()
    assert same(contents(views, restored), expected)
    cache.check_invariants()


def test_offload_off_is_a_runtime_error():
    cache = blockkv.BlockedKVCache((kv_config(),), allocate(2), device="cpu")
    assert not cache.offload_enabled
    blocks = cache.reserve(1)
    for call in (lambda: cache.offload(blocks), lambda: cache.restore([0]),
                 lambda: cache.spill([0]), lambda: cache.drop([0]), cache.offload_stats,
                 lambda: cache.host_blocks, lambda: cache.free_host_blocks()):
        with pytest.raises(RuntimeError, match="offload is off"):
            call()
    assert cache.free_blocks == [1]


def test_offload_arguments_are_checked():
    with pytest.raises(ValueError, match="host_blocks"):  # no default host tier size
        blockkv.BlockedKVCache((kv_config(),), allocate(2), offload=True, device="cpu")
    with pytest.raises(ValueError, match="offload=True"):  # sizes without offload
        blockkv.BlockedKVCache((kv_config(),), allocate(2), device="cpu", host_blocks=4)
    with pytest.raises(ValueError, match="host_blocks"):
        offload_cache(host_blocks=-1)
    with pytest.raises(ValueError, match="disk_path"):
        offload_cache(disk_blocks=4)
    with pytest.raises(ValueError, match="disk"):
        offload_cache(disk_path="/tmp/unused-blockkv-offload.bin")  # a path without a size
    with pytest.raises(TypeError):  # the offload sizes are keyword-only
        blockkv.BlockedKVCache((kv_config(),), allocate(2), None, True, "cpu", 4)
    cache = offload_cache(num_blocks=4, host_blocks=0, host_bytes=3 * kv_config(
        block_size=4).bytes_per_block)
    assert cache.host_blocks == 3


def test_a_ticket_keeps_its_store_alive():
    cache = offload_cache(num_blocks=4, host_blocks=2)
    views = layers(cache)
    blocks = cache.reserve(2)
    expected = fill(views, blocks, seed=10)
    handles, _ = cache.offload(blocks)
    restored, ticket = cache.restore(handles)  # waits for the offload of the same handles
    del cache
    gc.collect()
    ticket.wait()
    assert same(contents(views, restored), expected)
    while not ticket.poll():
        pass
    assert "OffloadTicket" in repr(ticket)


@requires_gpu
def test_cuda_round_trip():
    cache = offload_cache(num_blocks=8, host_blocks=4, device="cuda:0")
    views = layers(cache)
    blocks = cache.reserve(3)
    expected = fill(views, blocks, seed=11)
    torch.cuda.synchronize()  # the store's copy stream does not wait for torch's streams
    handles, ticket = cache.offload(blocks)
    ticket.wait()
    scribble(views)
    torch.cuda.synchronize()
    restored, ticket = cache.restore(handles)
    ticket.wait()  # before any kernel reads the restored blocks
    assert same(contents(views, restored), expected)


# ---- OffloadConfig and StateManagerConfig ------------------------------------------------------

def test_offload_config():
    c = OffloadConfig(host_blocks=16)
    assert (c.host_blocks, c.host_bytes, c.disk_path, c.disk_blocks, c.disk_bytes) == (
        16, 0, None, 0, 0)
    assert repr(c) == "OffloadConfig(host_blocks=16, host_bytes=0)"
    d = OffloadConfig(host_bytes=1 << 20, disk_path=os.path.join("/tmp", "x.bin"),
                      disk_bytes=1 << 30)
    assert d.disk_path == "/tmp/x.bin" and "disk_path='/tmp/x.bin'" in repr(d)
    for clone in (pickle.loads(pickle.dumps(d)), d.__copy__()):
        assert clone == d and clone is not d
    with pytest.raises(ValueError, match="host_blocks"):
        OffloadConfig()
    with pytest.raises(ValueError):
        OffloadConfig(host_blocks=-1)
    with pytest.raises(ValueError):
        OffloadConfig(host_blocks=1, disk_blocks=4)  # disk size without a path
    with pytest.raises(TypeError):
        OffloadConfig(16)
    with pytest.raises(ValueError):  # validated on assignment; unchanged on failure
        c.host_blocks = 0
    assert c.host_blocks == 16
    c.host_bytes = 5
    c.host_blocks = 0
    assert c.host_bytes == 5 and c.host_blocks == 0


def test_state_manager_config_offload_config():
    c = blockkv.StateManagerConfig()
    assert c.offload is False and c.offload_config is None
    assert "offload_config=None" in repr(c)
    c = blockkv.StateManagerConfig(offload=True, offload_config=OffloadConfig(host_blocks=8))
    assert c.offload_config.host_blocks == 8
    c.offload_config.host_blocks = 9  # a view of the config's own
    assert c.offload_config == OffloadConfig(host_blocks=9)
    assert "offload_config=OffloadConfig(host_blocks=9" in repr(c)
    clone = pickle.loads(pickle.dumps(c))
    assert clone == c and repr(clone) == repr(c)
    assert clone != blockkv.StateManagerConfig(offload=True)
    c.offload_config = None
    assert c.offload_config is None
    with pytest.raises(TypeError):
        blockkv.StateManagerConfig(offload_config={"host_blocks": 8})


# ---- StateManager: preemption ------------------------------------------------------------------

def make_offload_manager(num_blocks=16, block_size=4, host_blocks=8, **offload):
    config = blockkv.StateManagerConfig(
        memory_config=allocate(num_blocks), offload=True,
        offload_config=OffloadConfig(host_blocks=host_blocks, **offload))
    return blockkv.StateManager(config, (kv_config(block_size=block_size),), device="cpu")


def manager_layers(manager):
    return [torch.from_dlpack(manager.get_cache(i)).view(torch.int16) for i in range(2)]


def prefill(manager, uid, tokens, seed):
    """Schedules `tokens` tokens, writes their blocks, post_forward: the blocks' contents."""
    manager.schedule([uid], [tokens])
    table = manager.get_sequence(uid).block_table()
    data = fill(manager_layers(manager), table, seed)
    manager.post_forward([uid])
    return data


def test_preempt_and_resume_keep_the_data():
    m = make_offload_manager(num_blocks=16, host_blocks=8)
    a = prefill(m, 1, 10, seed=20)  # 3 blocks
    b = prefill(m, 2, 7, seed=21)   # 2 blocks
    seq = m.get_sequence(1)
    assert not seq.preempted
    assert m.free_blocks == [11]

    ticket = m.preempt_sequence(1)
    assert seq.preempted and "preempted" in repr(seq)
    assert seq.block_table().tolist() == [-1, -1, -1] and seq.all_block_ids().size == 0
    assert seq.seen_tokens == 10 and seq.cur_allocated_blocks == 3
    ticket.wait()
    assert m.free_blocks == [14] and m.free_host_blocks() == 5
    m.check_invariants()

    # Its old blocks are reused and overwritten by another sequence meanwhile.
    prefill(m, 3, 56, seed=22)  # 14 blocks: everything free
    with pytest.raises(ValueError, match="preempted"):
        m.schedule([1], [1])
    with pytest.raises(blockkv.ResourceExhaustedError):  # no free blocks to resume into
        m.resume_sequence(1)
    assert seq.preempted
    m.flush_sequence(3)

    ticket = m.resume_sequence(1)
    assert not seq.preempted and seq.block_table().min() >= 0
    m.schedule([1], [1])  # waits for the copy itself
    ticket.wait()
    assert same(contents(manager_layers(m), seq.block_table()[:3]), a)
    assert same(contents(manager_layers(m), m.get_sequence(2).block_table()), b)
    m.post_forward([1])
    assert seq.seen_tokens == 11
    stats = m.offload_stats()
    assert stats["offloaded_blocks"] == 3 and stats["restored_blocks"] == 3
    assert stats["live_handles"] == 0
    m.check_invariants()


def test_schedule_batch_waits_for_a_resume_and_refuses_a_preempted_sequence():
    m = make_offload_manager(num_blocks=16, host_blocks=8)
    batch = blockkv.RaggedBatchWrapper(m)
    a = prefill(m, 1, 10, seed=26)  # 3 blocks
    m.preempt_sequence(1).wait()
    with pytest.raises(ValueError, match="preempted"):
        m.schedule_batch([1], [1], [5], batch)
    assert not batch.finalized
    ticket = m.resume_sequence(1)
    m.schedule_batch([1], [1], [5], batch)  # waits for the copy itself, the GIL released
    ticket.wait()
    seq = m.get_sequence(1)
    assert same(contents(manager_layers(m), seq.block_table()[:3]), a)
    assert batch.inflight_seq_descriptors().tolist() == [[0, 1, 10, 0]]
    assert batch.kv_indices().tolist() == seq.block_table().tolist()
    m.post_forward(batch)
    assert seq.seen_tokens == 11
    m.check_invariants()


def test_preemption_falls_back_to_disk_and_flush_drops_handles(tmp_path):
    m = make_offload_manager(num_blocks=16, host_blocks=2, disk_path=tmp_path / "kv.bin",
                             disk_blocks=4)
    a = prefill(m, 1, 12, seed=23)  # 3 blocks: more than the host tier holds
    m.preempt_sequence(1).wait()
    assert m.free_disk_blocks() == 1 and m.free_host_blocks() == 2
    scribble(manager_layers(m))
    m.resume_sequence(1).wait()
    assert same(contents(manager_layers(m), m.get_sequence(1).block_table()), a)
    assert m.free_disk_blocks() == 4

    prefill(m, 2, 4, seed=24)
    m.preempt_sequence(2).wait()
    assert m.offload_stats()["live_handles"] == 1
    m.flush_sequence(2)  # a preempted sequence's handles are dropped
    assert m.offload_stats()["live_handles"] == 0 and m.free_host_blocks() == 2
    m.check_invariants()


def test_preemption_errors():
    m = make_offload_manager(num_blocks=16, host_blocks=2)
    with pytest.raises(ValueError):
        m.preempt_sequence(7)  # unknown
    m.schedule([1], [5])
    with pytest.raises(ValueError, match="in flight"):
        m.preempt_sequence(1)
    m.post_forward([1])
    with pytest.raises(ValueError, match="not preempted"):
        m.resume_sequence(1)
    m.preempt_sequence(1).wait()
    with pytest.raises(ValueError, match="already"):
        m.preempt_sequence(1)
    prefill(m, 2, 12, seed=25)  # 3 blocks: the host tier has none left, and there is no disk
    with pytest.raises(blockkv.ResourceExhaustedError):
        m.preempt_sequence(2)
    assert not m.get_sequence(2).preempted
    with pytest.raises(ValueError):
        m.free_host_blocks(1)
    m.check_invariants()


def test_manager_offload_off_and_unsized():
    config = blockkv.StateManagerConfig(memory_config=allocate(8))
    m = blockkv.StateManager(config, (kv_config(),), device="cpu")
    m.schedule([1], [3])
    m.post_forward([1])
    for call in (lambda: m.preempt_sequence(1), lambda: m.resume_sequence(1), m.offload_stats,
                 lambda: m.free_host_blocks()):
        with pytest.raises(RuntimeError, match="offload is off"):
            call()
    assert not m.get_sequence(1).preempted
    assert m.host_prefix_stats() == {"entries": 0, "demoted": 0, "promoted": 0, "dropped": 0}
    config.offload = True  # without offload_config: no host tier to preempt into
    with pytest.raises(ValueError, match="offload_config"):
        blockkv.StateManager(config, (kv_config(),), device="cpu")


def test_prefix_cache_host_level():
    config = blockkv.StateManagerConfig(
        memory_config=allocate(8), offload=True, offload_config=OffloadConfig(host_blocks=16),
        prefix_cache=blockkv.PrefixCacheConfig())
    m = blockkv.StateManager(config, (kv_config(block_size=4),), device="cpu")
    prompt = list(range(100, 117))  # 4 full blocks and one token
    m.add_sequence(1, prompt)
    m.schedule([1], [len(prompt)])
    expected = fill(manager_layers(m), m.get_sequence(1).block_table()[:4], seed=26)
    m.post_forward([1])
    m.flush_sequence(1)  # its 4 full blocks stay cached
    m.add_sequence(2, list(range(500, 532)))
    m.schedule([2], [32])  # all 8 blocks: the cached ones are evicted to the host
    m.post_forward([2])
    stats = m.host_prefix_stats()
    assert stats["demoted"] == 4 and stats["entries"] == 4
    m.flush_sequence(2)
    scribble(manager_layers(m))

    seq = m.add_sequence(3, prompt)
    m.schedule([3], [len(prompt)])
    assert seq.cached_prefix_tokens == 16
    assert m.host_prefix_stats()["promoted"] == 4
    assert same(contents(manager_layers(m), seq.block_table()[:4]), expected)
    m.check_invariants()
