# SPDX-License-Identifier: Apache-2.0
"""Sequence transfer from Python (docs/transfer.md): TransferConfig, StateManagerConfig(transfer=...),
export_sequence / import_sequence / cancel_export between this process and a sender process it
starts (over TCP and over shared memory), the export timeout, tensor-parallel ranks, and the
errors. UCX that cannot start fails these tests."""

import copy
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import blockkv
import pytest
import torch

from conftest import allocate, kv_config

BLOCK = 4
TRANSPORTS = ["tcp", "posix,sysv,cma,self"]

# The sender: one command per line on stdin, one answer per line on stdout.
SENDER = textwrap.dedent("""
    import sys, torch, blockkv
    blockkv.set_log_level("warning")
    transports, layers, tp_rank, tp_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    config = blockkv.StateManagerConfig(
        memory_config=blockkv.MemoryConfig(mode="allocate", size=32),
        prefix_cache=blockkv.PrefixCacheConfig(),
        transfer=blockkv.TransferConfig(transports=transports, tp_rank=tp_rank, tp_size=tp_size))
    kv = blockkv.KVCacheConfig(block_size=4, cache_shape=(layers, 2, 8), cache_dtype="fp16")
    m = blockkv.StateManager(config, (kv,), device="cpu")
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "make":  # uid, tokens: a prefilled sequence whose KV is uid * 1000 + position
            uid, n = int(args[0]), int(args[1])
            seq = m.add_sequence(uid, list(range(100, 100 + n)))
            m.schedule([uid], [n])
            table = seq.block_table()
            for layer in range(layers):
                cache = torch.from_dlpack(m.get_cache(layer)).view(torch.int16)
                for t in range(n):
                    cache[table[t // 4], t % 4] = uid * 1000 + t + layer
            m.post_forward([uid])
            print(m.export_sequence(uid).hex(), flush=True)
        elif cmd == "state":
            m.complete_exports()
            print(m.pending_exports, m.n_tracked_sequences, m.free_blocks[0], flush=True)
        elif cmd == "cancel":
            print(m.cancel_export(int(args[0])), flush=True)
        elif cmd == "import":
            try:
                seq = m.import_sequence(bytes.fromhex(args[0]))
                print("imported", seq.uid, seq.seen_tokens, flush=True)
            except (ValueError, RuntimeError) as e:
                print("error", type(e).__name__, " ".join(str(e).split()), flush=True)
        elif cmd == "quit":
            break
""")


class Sender:
    def __init__(self, transports, layers=2, tp_rank=0, tp_size=1, stop=None):
        env = dict(os.environ, UCX_LOG_FILE="/dev/stderr")
        if stop is not None:  # where the process stops itself (src/transfer.cc, a test hook)
            env["BLOCKKV_TRANSFER_TEST_STOP"] = stop
        self.proc = subprocess.Popen([sys.executable, "-c", SENDER, transports, str(layers),
                                      str(tp_rank), str(tp_size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        assert self.proc.stdout.readline().strip() == "ready"

    def post(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def send(self, line):
        self.post(line)
        return self.proc.stdout.readline().strip()

    def wait_stopped(self):
        _, status = os.waitpid(self.proc.pid, os.WUNTRACED)
        return os.WIFSTOPPED(status)

    def export(self, uid, tokens):
        return bytes.fromhex(self.send(f"make {uid} {tokens}"))

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def sender_factory():
    senders = []

    def make(*args, **kwargs):
        senders.append(Sender(*args, **kwargs))
        return senders[-1]

    yield make
    for s in senders:
        if s.proc.poll() is None:
            s.proc.kill()
        s.proc.wait()


def receiver(transports, layers=2, timeout_ms=10000, prefix=True, **transfer):
    config = blockkv.StateManagerConfig(
        memory_config=allocate(32),
        prefix_cache=blockkv.PrefixCacheConfig() if prefix else None,
        transfer=blockkv.TransferConfig(transports=transports, timeout_ms=timeout_ms, **transfer))
    return blockkv.StateManager(config, (kv_config(block_size=BLOCK, layers=layers),), device="cpu")


def test_config_values_copy_pickle_and_errors():
    t = blockkv.TransferConfig(transports="tcp", devices="lo", timeout_ms=500,
                               export_timeout_ms=0, tp_rank=1, tp_size=2)
    assert (t.transports, t.devices, t.timeout_ms) == ("tcp", "lo", 500)
    assert (t.export_timeout_ms, t.tp_rank, t.tp_size) == (0, 1, 2)
    d = blockkv.TransferConfig()
    assert (d.transports, d.devices, d.timeout_ms) == ("", "", 10000)
    assert (d.export_timeout_ms, d.tp_rank, d.tp_size) == (120000, 0, 1)
    c = blockkv.StateManagerConfig(transfer=t)
    assert c.transfer == t
    assert t != blockkv.TransferConfig(transports="tcp", devices="lo", timeout_ms=500,
                                       export_timeout_ms=0, tp_rank=0, tp_size=2)
    assert ("TransferConfig(transports='tcp', devices='lo', timeout_ms=500, export_timeout_ms=0, "
            "tp_rank=1, tp_size=2)") in repr(c)
    assert pickle.loads(pickle.dumps(c)) == c
    assert copy.deepcopy(t) == t and pickle.loads(pickle.dumps(t)) == t
    assert blockkv.StateManagerConfig().transfer is None
    with pytest.raises(ValueError, match="timeout_ms is 0"):
        blockkv.TransferConfig(timeout_ms=0)
    with pytest.raises(ValueError, match="export_timeout_ms is -1; it must be >= 0"):
        blockkv.TransferConfig(export_timeout_ms=-1)
    with pytest.raises(ValueError, match="tp_rank is 2 and tp_size 2; they must satisfy"):
        blockkv.TransferConfig(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="tp_rank is 0 and tp_size 0"):
        blockkv.TransferConfig(tp_size=0)
    with pytest.raises(TypeError, match="transfer must be None or a blockkv.TransferConfig"):
        blockkv.StateManagerConfig(transfer="tcp")


@pytest.mark.parametrize("transports", TRANSPORTS)
def test_import_moves_the_kv_and_the_sender_frees_after_the_confirm(sender_factory, transports):
    sender = sender_factory(transports)
    descriptor = sender.export(7, 10)
    assert isinstance(descriptor, bytes)
    assert sender.send("state") == "1 1 29"  # exported: pinned, its 3 blocks held
    m = receiver(transports)
    seq = m.import_sequence(descriptor)
    assert (seq.uid, seq.seen_tokens, seq.in_flight_tokens) == (7, 10, 0)
    table = seq.block_table()
    for layer in range(2):
        cache = torch.from_dlpack(m.get_cache(layer)).view(torch.int16)
        for t in range(10):
            assert bool((cache[table[t // BLOCK], t % BLOCK] == 7000 + t + layer).all()), (layer, t)
    assert sender.send("state") == "0 0 32"
    # It continues decoding here.
    m.append_tokens(7, [5])
    m.schedule([7], [1])
    m.post_forward([7])
    assert m.get_sequence(7).seen_tokens == 11
    m.check_invariants()
    sender.close()


def test_start_import_returns_at_once_and_complete_imports_commits(sender_factory):
    sender = sender_factory("tcp")
    descriptor = sender.export(7, 10)
    m = receiver("tcp")
    os.kill(sender.proc.pid, signal.SIGSTOP)
    try:
        ticket = m.start_import(descriptor)
        assert isinstance(ticket, blockkv.ImportTicket) and ticket.uid == 7
        assert not ticket.poll() and m.pending_imports == 1
        with pytest.raises(ValueError, match="being imported"):
            m.schedule([7], [1])
        m.schedule([1], [5])  # the engine runs meanwhile
        m.post_forward([1])
        assert m.complete_imports() == []
    finally:
        os.kill(sender.proc.pid, signal.SIGCONT)
    ticket.wait()
    assert ticket.poll()
    assert m.complete_imports() == [(7, None)]
    assert m.pending_imports == 0
    assert m.get_sequence(7).seen_tokens == 10
    assert sender.send("state") == "0 0 32"
    m.check_invariants()
    sender.close()


def test_killed_sender_raises_and_changes_nothing(sender_factory):
    for started in (False, True):
        sender = sender_factory("tcp")
        descriptor = sender.export(7, 10)
        sender.proc.kill()
        sender.proc.wait()
        m = receiver("tcp", timeout_ms=3000)
        if started:  # reported by complete_imports
            m.start_import(descriptor).wait()
            [(uid, error)] = m.complete_imports()
            assert uid == 7 and isinstance(error, RuntimeError)
            assert "nothing was imported" in str(error)
        else:
            with pytest.raises(RuntimeError, match="nothing was imported"):
                m.import_sequence(descriptor)
        assert (m.free_blocks[0], m.n_tracked_sequences) == (32, 0)
        assert m.get_sequence(7) is None
        m.check_invariants()


def test_layout_mismatch_cancel_and_bad_descriptors_are_value_errors(sender_factory):
    sender = sender_factory("tcp", layers=3)
    descriptor = sender.export(7, 6)
    m = receiver("tcp", layers=2)
    with pytest.raises(ValueError, match="differs from this engine's"):
        m.import_sequence(descriptor)
    with pytest.raises(ValueError, match="not a sequence descriptor"):
        m.import_sequence(b"x" * 64)
    with pytest.raises(ValueError, match="truncated|corrupt|fewer than"):
        m.import_sequence(descriptor[:-9])
    assert sender.send("cancel 7") == "unclaimed"
    assert sender.send("state") == "0 1 30"
    same = receiver("tcp", layers=3)
    with pytest.raises(ValueError, match="refused"):
        same.import_sequence(descriptor)
    assert (same.free_blocks[0], same.n_tracked_sequences) == (32, 0)
    sender.close()


def test_exported_sequence_is_pinned_until_cancelled():
    m = receiver("tcp")
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.schedule([1], [5])
    m.post_forward([1])
    m.export_sequence(1)
    assert m.pending_exports == 1
    with pytest.raises(ValueError, match="exported"):
        m.schedule([1], [1])
    with pytest.raises(ValueError, match="exported"):
        m.flush_sequence(1)
    assert m.cancel_export(1) == "unclaimed"
    assert m.pending_exports == 0
    m.flush_sequence(1)
    m.check_invariants()


def test_without_transfer_config_export_and_import_are_value_errors():
    config = blockkv.StateManagerConfig(memory_config=allocate(8))
    m = blockkv.StateManager(config, (kv_config(block_size=BLOCK),), device="cpu")
    m.get_or_create_sequence(1)
    with pytest.raises(ValueError, match="StateManagerConfig.transfer is not set"):
        m.export_sequence(1)
    with pytest.raises(ValueError, match="StateManagerConfig.transfer is not set"):
        m.import_sequence(b"")


def test_expired_export_stays_here_and_its_descriptor_is_refused_naming_the_expiry(sender_factory):
    m = receiver("tcp", export_timeout_ms=1)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    m.schedule([1], [5])
    m.post_forward([1])
    descriptor = m.export_sequence(1)
    time.sleep(0.02)  # past the 1 ms
    m.schedule([1], [1])  # the next schedule took the export back: schedulable again
    m.post_forward([1])
    assert (m.pending_exports, m.get_sequence(1).seen_tokens, m.free_blocks[0]) == (0, 6, 30)
    with pytest.raises(ValueError, match="no pending export"):
        m.cancel_export(1)
    other = sender_factory("tcp")
    answer = other.send("import " + descriptor.hex())
    assert answer.startswith("error ValueError"), answer
    assert "expired, unclaimed for 1 ms" in answer and "export_timeout_ms" in answer, answer
    assert other.send("state") == "0 0 32"
    m.check_invariants()


def test_tensor_parallel_ranks_import_only_their_own_rank(sender_factory):
    ranks = [sender_factory("tcp", tp_rank=r, tp_size=2) for r in range(2)]
    shards = [s.export(7, 10) for s in ranks]
    m = receiver("tcp", tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match="rank 0 of 2; this engine is rank 1 of 2"):
        m.import_sequence(shards[0])
    assert (m.free_blocks[0], m.n_tracked_sequences) == (32, 0)
    assert ranks[0].send("state") == "1 1 29"
    seq = m.import_sequence(shards[1])
    assert (seq.uid, seq.seen_tokens) == (7, 10)
    assert ranks[1].send("state") == "0 0 32"
    single = receiver("tcp")
    with pytest.raises(ValueError, match="rank 0 of 2; this engine is rank 0 of 1"):
        single.import_sequence(shards[0])
    for s in ranks:
        s.close()


def test_cancel_export_says_granted_when_a_receiver_died_after_the_grant(sender_factory):
    # The receiver stops itself once the grant arrived (before it commits and sends DONE), and is
    # killed there: this engine keeps the sequence, and cancel_export says a receiver had it.
    m = receiver("tcp")
    m.add_sequence(7, [1, 2, 3, 4, 5, 6])
    m.schedule([7], [6])
    m.post_forward([7])
    descriptor = m.export_sequence(7)
    other = sender_factory("tcp", stop="receiver_after_grant")
    other.post("import " + descriptor.hex())
    assert other.wait_stopped()
    m.complete_exports()
    assert (m.pending_exports, m.free_blocks[0]) == (1, 30)  # granted: still pinned, held
    other.proc.kill()
    other.proc.wait()
    assert m.cancel_export(7) == "granted"
    assert (m.pending_exports, m.get_sequence(7).seen_tokens, m.free_blocks[0]) == (0, 6, 30)
    m.schedule([7], [1])
    m.post_forward([7])
    m.check_invariants()
