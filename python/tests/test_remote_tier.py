# SPDX-License-Identifier: Apache-2.0
"""The remote prefix tier from Python: RemoteTierConfig, StateManagerConfig(remote_tier=...),
two managers sharing blocks through a redis-server this file starts itself (a test that cannot
start one fails), a second OS process hitting what the first stored, remote_tier_stats, and the
errors. Run as `python3 test_remote_tier.py store URL PROMPT_JSON` it is that second process's
child: it stores PROMPT through its own StateManager and prints what it stored."""

import contextlib
import copy
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import blockkv
import pytest
import torch

from conftest import allocate, kv_config

BLOCK = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_redis(*extra):
    """A redis-server on 127.0.0.1 on a free port, persistence off, password "pw", `extra` more
    arguments, until the block ends; its port."""
    port = free_port()
    scratch = tempfile.mkdtemp(prefix="blockkv-redis-")
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", scratch, "--requirepass", "pw", *map(str, extra)],
        stdout=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, "redis-server exited at start"
                time.sleep(0.05)
        else:
            pytest.fail(f"redis-server did not answer on port {port}")
        yield port
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def redis_server():
    """A redis-server on 127.0.0.1 on a free port, persistence off; its port."""
    with started_redis() as port:
        yield port


@pytest.fixture
def redis_cluster():
    """A Redis Cluster of 3 masters on 127.0.0.1 (free ports and bus ports, persistence off),
    joined by `redis-cli --cluster create`; its ports."""
    procs, ports, scratch = [], [], tempfile.mkdtemp(prefix="blockkv-redis-cluster-")
    try:
        for i in range(3):
            port, bus = free_port(), free_port()
            node_dir = os.path.join(scratch, str(i))
            os.mkdir(node_dir)
            procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", node_dir, "--cluster-enabled", "yes",
                 "--cluster-port", str(bus), "--cluster-require-full-coverage", "no"],
                stdout=subprocess.DEVNULL))
            ports.append(port)
        for port, proc in zip(ports, procs):
            for _ in range(200):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert proc.poll() is None, "redis-server exited at start"
                    time.sleep(0.05)
            else:
                pytest.fail(f"redis-server did not answer on port {port}")
        subprocess.run(["redis-cli", "--cluster", "create"] +
                       [f"127.0.0.1:{p}" for p in ports] +
                       ["--cluster-replicas", "0", "--cluster-yes"],
                       stdout=subprocess.DEVNULL, check=True, timeout=120)
        for _ in range(400):
            infos = [subprocess.run(["redis-cli", "-p", str(p), "cluster", "info"],
                                    capture_output=True, text=True, check=False).stdout
                     for p in ports]
            if all("cluster_state:ok" in i and "cluster_known_nodes:3" in i for i in infos):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the redis cluster did not reach cluster_state:ok")
        yield ports
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)


def make_manager(remote):
    config = blockkv.StateManagerConfig(memory_config=allocate(32),
                                        prefix_cache=blockkv.PrefixCacheConfig(),
                                        remote_tier=remote)
    return blockkv.StateManager(config, (kv_config(block_size=BLOCK),), device="cpu")


def caches(manager):
    return [torch.from_dlpack(manager.get_cache(i)).view(torch.int16) for i in range(2)]


def prefill(manager, uid, prompt, fill):
    """Schedules `uid`'s prompt; writes `fill(block index)` into every block it computes."""
    seq = manager.add_sequence(uid, prompt)
    manager.schedule([uid], [len(prompt)])
    table = seq.block_table()
    for b in range(seq.cached_prefix_tokens // BLOCK, len(prompt) // BLOCK):
        for layer in caches(manager):
            layer[table[b]] = fill(b)
    manager.post_forward([uid])
    manager.check_invariants()
    return seq


def test_config_values_copy_pickle_and_errors():
    r = blockkv.RemoteTierConfig("redis://:secret@127.0.0.1:6379/2", model_id="llama")
    assert (r.url, r.model_id, r.timeout_ms, r.tp_rank, r.tp_size) == (
        "redis://:secret@127.0.0.1:6379/2", "llama", 1000, 0, 1)
    assert "secret" not in repr(r)
    rc = blockkv.RemoteTierConfig("redis+cluster://u:secret@10.0.0.1:7000,10.0.0.2:7001")
    assert "secret" not in repr(rc) and "redis+cluster://***@10.0.0.1:7000,10.0.0.2:7001" in repr(rc)
    with pytest.raises(ValueError, match='no host in ":7001"'):
        make_manager(blockkv.RemoteTierConfig("redis+cluster://h:7000,:7001"))
    c = blockkv.StateManagerConfig(prefix_cache=blockkv.PrefixCacheConfig(), remote_tier=r)
    assert c.remote_tier == r
    assert pickle.loads(pickle.dumps(c)) == c
    assert copy.deepcopy(r) == r and pickle.loads(pickle.dumps(r)) == r
    assert blockkv.StateManagerConfig().remote_tier is None
    with pytest.raises(ValueError, match="timeout_ms is 0"):
        blockkv.RemoteTierConfig("redis://h:1", timeout_ms=0)
    with pytest.raises(ValueError, match="max_pending is -1"):
        blockkv.RemoteTierConfig("redis://h:1", max_pending=-1)
    with pytest.raises(ValueError, match="prefix_cache.enabled"):
        blockkv.StateManagerConfig(remote_tier=r)
    with pytest.raises(TypeError, match="remote_tier must be None or a blockkv.RemoteTierConfig"):
        blockkv.StateManagerConfig(prefix_cache=blockkv.PrefixCacheConfig(), remote_tier="redis://")
    with pytest.raises(ValueError, match="not a redis:// URL"):
        make_manager(blockkv.RemoteTierConfig("http://127.0.0.1:1"))
    with pytest.raises(ValueError, match="ssl_cert_reqs=maybe: required or none"):
        make_manager(blockkv.RemoteTierConfig("rediss://127.0.0.1:1?ssl_cert_reqs=maybe"))
    with pytest.raises(ValueError, match="ssl_ca_certs .*/nonexistent.pem.* does not load"):
        make_manager(blockkv.RemoteTierConfig("rediss://127.0.0.1:1?ssl_ca_certs=/nonexistent.pem"))
    with pytest.raises(ValueError, match="no master name"):
        make_manager(blockkv.RemoteTierConfig("redis+sentinel://127.0.0.1:26379"))
    with pytest.raises(ValueError, match="IPv6 address is written in brackets"):
        make_manager(blockkv.RemoteTierConfig("redis://::1:6379"))
    # A queue whose stores could hold more than the host's memory: refused at creation, naming
    # the value; the same manager with a sane queue is then made as usual.
    with pytest.raises(blockkv.ResourceExhaustedError, match="max_pending=2147483647"):
        make_manager(blockkv.RemoteTierConfig("redis://127.0.0.1:1", max_pending=2**31 - 1))
    sane = make_manager(blockkv.RemoteTierConfig("redis://127.0.0.1:1"))
    assert not sane.remote_tier_stats()["connected"]  # nothing listens there: the tier waits


def test_two_managers_share_blocks_through_redis(redis_server):
    url = f"redis://:pw@127.0.0.1:{redis_server}"
    prompt = list(range(500, 500 + 3 * BLOCK + 1))  # 3 full blocks
    a = make_manager(blockkv.RemoteTierConfig(url, model_id="m"))
    prefill(a, 1, prompt, lambda b: 100 + b)
    a.flush_remote_tier()
    sa = a.remote_tier_stats()
    assert (sa["stored"], sa["misses"], sa["hits"], sa["dropped"], sa["errors"]) == (3, 1, 0, 0, 0)
    assert (sa["misses_not_found"], sa["misses_verify_failed"], sa["misses_error"],
            sa["misses_late"]) == (1, 0, 0, 0)
    assert (sa["nodes"], sa["redirects"], sa["topology_refreshes"], sa["reconnects"],
            sa["replica_reads"]) == (1, 0, 0, 0, 0)
    assert sa["connected"]

    b = make_manager(blockkv.RemoteTierConfig(url, model_id="m"))
    seq = prefill(b, 1, prompt, lambda b: -1)
    assert seq.cached_prefix_tokens == 3 * BLOCK
    table = seq.block_table()
    for layer in caches(b):
        for i in range(3):
            assert torch.all(layer[table[i]] == 100 + i)
    sb = b.remote_tier_stats()
    assert (sb["hits"], sb["misses"], sb["invalid"]) == (3, 0, 0)
    assert sb["fetched_bytes"] == sa["stored_bytes"]

    other = make_manager(blockkv.RemoteTierConfig(url, model_id="other"))
    assert prefill(other, 1, prompt, lambda b: 7).cached_prefix_tokens == 0


def test_a_prompt_fetched_ahead_is_taken_by_its_first_schedule(redis_server):
    url = f"redis://:pw@127.0.0.1:{redis_server}"
    prompt = list(range(700, 700 + 3 * BLOCK + 1))
    a = make_manager(blockkv.RemoteTierConfig(url, model_id="m"))
    prefill(a, 1, prompt, lambda b: 40 + b)
    a.flush_remote_tier()
    b = make_manager(blockkv.RemoteTierConfig(url, model_id="m"))
    seq = b.add_sequence(5, prompt)
    ticket = b.fetch_remote_prefix(5)
    assert isinstance(ticket, blockkv.RemoteFetchTicket) and ticket.blocks == 3
    ticket.wait()
    assert ticket.poll() and "done" in repr(ticket)
    b.schedule([5], [len(prompt)])
    assert seq.cached_prefix_tokens == 3 * BLOCK
    table = seq.block_table()
    for layer in caches(b):
        for i in range(3):
            assert torch.all(layer[table[i]] == 40 + i)
    assert b.remote_tier_stats()["hits"] == 3
    stats = b.prefix_cache_stats()
    assert (stats.hit_tokens, stats.remote_hit_tokens, stats.host_hit_tokens) == (3 * BLOCK, 3 * BLOCK, 0)
    assert stats._asdict()["remote_hit_tokens"] == 3 * BLOCK
    with pytest.raises(ValueError, match="was scheduled already"):
        b.fetch_remote_prefix(5)
    with pytest.raises(ValueError, match="sequence 404 is not tracked"):
        b.fetch_remote_prefix(404)
    plain = blockkv.StateManager(
        blockkv.StateManagerConfig(memory_config=allocate(32),
                                   prefix_cache=blockkv.PrefixCacheConfig()),
        (kv_config(block_size=BLOCK),), device="cpu")
    plain.add_sequence(1, prompt)
    with pytest.raises(ValueError, match="no remote tier"):
        plain.fetch_remote_prefix(1)


def test_two_managers_share_blocks_through_a_cluster(redis_cluster):
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in redis_cluster[:2])
    prompt = list(range(700, 700 + 8 * BLOCK + 1))  # 8 full blocks
    a = make_manager(blockkv.RemoteTierConfig(url, model_id="m"))
    prefill(a, 1, prompt, lambda b: 10 + b)
    a.flush_remote_tier()
    sa = a.remote_tier_stats()
    assert (sa["stored"], sa["nodes"], sa["dropped"], sa["errors"]) == (8, 3, 0, 0)
    assert sa["connected"]
    b = make_manager(blockkv.RemoteTierConfig(url, model_id="m"))
    seq = prefill(b, 1, prompt, lambda b: -1)
    assert seq.cached_prefix_tokens == 8 * BLOCK
    table = seq.block_table()
    for layer in caches(b):
        for i in range(8):
            assert torch.all(layer[table[i]] == 10 + i)
    sb = b.remote_tier_stats()
    assert (sb["hits"], sb["misses"], sb["redirects"]) == (8, 0, 0)


def test_wrong_password_is_a_permission_error(redis_server):
    with pytest.raises(PermissionError, match="AUTH"):
        make_manager(blockkv.RemoteTierConfig(f"redis://:nope@127.0.0.1:{redis_server}"))


@pytest.fixture
def redis_tls_server(tmp_path):
    """A redis-server with a TLS port (a certificate for 127.0.0.1 signed by a CA made here with
    the openssl tool) beside its plain port; (plain port, TLS port, the CA's file, another CA's)."""
    def openssl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout"]
    for ca in ("ca", "other_ca"):
        openssl("req", "-x509", "-days", "2", "-subj", f"/CN={ca}", *key, tmp_path / f"{ca}.key",
                "-out", tmp_path / f"{ca}.pem")
    openssl("req", "-subj", "/CN=server", *key, tmp_path / "server.key",
            "-out", tmp_path / "server.csr")
    (tmp_path / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", tmp_path / "server.csr", "-CA", tmp_path / "ca.pem",
            "-CAkey", tmp_path / "ca.key", "-CAcreateserial", "-days", "2",
            "-extfile", tmp_path / "server.ext", "-out", tmp_path / "server.pem")
    tls_port = free_port()
    with started_redis("--tls-port", tls_port, "--tls-cert-file", tmp_path / "server.pem",
                       "--tls-key-file", tmp_path / "server.key",
                       "--tls-ca-cert-file", tmp_path / "ca.pem",
                       "--tls-auth-clients", "no") as port:
        yield port, tls_port, tmp_path / "ca.pem", tmp_path / "other_ca.pem"


def test_a_tls_server_is_a_tier_with_its_certificate_checked(redis_tls_server):
    port, tls_port, ca, other_ca = redis_tls_server
    prompt = list(range(900, 900 + 2 * BLOCK + 1))  # 2 full blocks
    secure = make_manager(blockkv.RemoteTierConfig(
        f"rediss://:pw@127.0.0.1:{tls_port}?ssl_ca_certs={ca}"))
    assert secure.remote_tier_stats()["connected"]
    prefill(secure, 1, prompt, lambda b: 40 + b)
    secure.flush_remote_tier()
    assert secure.remote_tier_stats()["stored"] == 2
    plain = make_manager(blockkv.RemoteTierConfig(f"redis://:pw@127.0.0.1:{port}"))
    seq = prefill(plain, 1, prompt, lambda b: -1)
    assert seq.cached_prefix_tokens == 2 * BLOCK
    for layer in caches(plain):
        assert torch.all(layer[seq.block_table()[1]] == 41)
    with pytest.raises(PermissionError, match="certificate does not verify"):
        make_manager(blockkv.RemoteTierConfig(
            f"rediss://:pw@127.0.0.1:{tls_port}?ssl_ca_certs={other_ca}"))


def test_no_server_at_start_leaves_the_tier_unconnected():
    m = make_manager(blockkv.RemoteTierConfig(f"redis://127.0.0.1:{free_port()}"))
    prefill(m, 1, list(range(40)), lambda b: 1)
    s = m.remote_tier_stats()
    assert not s["connected"] and s["stored"] == 0 and s["hits"] == 0


def test_a_second_process_hits_what_the_first_process_stored(redis_server):
    url = f"redis://:pw@127.0.0.1:{redis_server}"
    prompt = list(range(900, 900 + 4 * BLOCK + 1))  # 4 full blocks
    child = subprocess.run([sys.executable, __file__, "store", url, json.dumps(prompt)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["stored", "4"]
    # This process's first request: every full block from the child's stores.
    m = make_manager(blockkv.RemoteTierConfig(url, model_id="m"))
    seq = prefill(m, 1, prompt, lambda b: -1)
    assert seq.cached_prefix_tokens == 4 * BLOCK
    table = seq.block_table()
    for layer in caches(m):
        for i in range(4):
            assert torch.all(layer[table[i]] == 200 + i)
    s = m.remote_tier_stats()
    assert (s["hits"], s["misses"], s["stored"]) == (4, 0, 0)


def test_tensor_parallel_ranks_agree_over_torch_distributed(redis_server):
    """Two ranks, two processes, a gloo group: rank 0's tier holds 4 blocks of the prompt,
    rank 1's 2; both take the 2 every rank holds."""
    url = f"redis://:pw@127.0.0.1:{redis_server}"
    port = free_port()
    prompt = list(range(300, 300 + 4 * BLOCK + 1))
    ranks = [subprocess.Popen([sys.executable, __file__, "agree", url, str(rank), str(port),
                               json.dumps(prompt)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err
        assert out.split() == ["agreed", "2", "cached", str(2 * BLOCK), "data", "ok"], out


def agree_main(url, rank, port, prompt):
    """A rank of test_tensor_parallel_ranks_agree_over_torch_distributed."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)

    def all_reduce_min(values):
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return t.tolist()

    config = blockkv.RemoteTierConfig(url, model_id="m", tp_rank=rank, tp_size=2)
    held = 4 - 2 * rank
    writer = make_manager(config)
    prefill(writer, 1, prompt[:held * BLOCK + 1], lambda b: 10 * rank + b)
    writer.flush_remote_tier()
    dist.barrier()  # every rank's blocks are stored
    reader = make_manager(config)
    seq = reader.add_sequence(7, prompt)
    reader.fetch_remote_prefix(7)
    agreed = reader.agree_remote_prefix([7], all_reduce_min)
    reader.schedule([7], [len(prompt)])
    table = seq.block_table()
    ok = all(torch.all(layer[table[b]] == 10 * rank + b)
             for layer in caches(reader) for b in range(agreed[0]))
    print("agreed", *agreed, "cached", seq.cached_prefix_tokens, "data", "ok" if ok else "wrong")
    with pytest.raises(ValueError, match="returned 1 values"):
        other = reader.add_sequence(8, prompt)
        del other
        reader.agree_remote_prefix([8], lambda values: values[:1])
    dist.destroy_process_group()


def store_main(url, prompt):
    """The child of test_a_second_process_hits_what_the_first_process_stored."""
    m = make_manager(blockkv.RemoteTierConfig(url, model_id="m"))
    prefill(m, 1, prompt, lambda b: 200 + b)
    m.flush_remote_tier()
    print("stored", m.remote_tier_stats()["stored"])


if __name__ == "__main__" and sys.argv[1:2] == ["store"]:
    store_main(sys.argv[2], json.loads(sys.argv[3]))
if __name__ == "__main__" and sys.argv[1:2] == ["agree"]:
    agree_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
