"""common/broker.py: the calls Celery's consumer makes when its broker goes away
(`connection.collect()`, then `connection.close()`: celery.worker.consumer.consumer,
on_connection_error_after_connected) on a channel holding an unacknowledged message neither
crash the worker nor lose the message, which goes back on its queue after the visibility
timeout. A private redis-server, killed and restarted with its append-only file."""
from __future__ import annotations

import subprocess
import uuid

import pytest
from kombu import Connection, Exchange, Queue
from kombu.common import ignore_errors

import common.celery  # noqa: F401  (applies the repair, as every worker process does)
from tests.stack import free_port, wait_until


def start_redis(port: int, data_dir) -> subprocess.Popen:
    """A redis-server on `port` that keeps every write in an append-only file in `data_dir`
    (fsync always), so that one killed with SIGKILL comes back with its data."""
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "yes", "--appendfsync", "always", "--dir", str(data_dir)],
                              stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"

    def answers() -> bool:
        try:
            with Connection(url, connect_timeout=1) as probe:
                probe.default_channel.client.ping()
            return True
        except Exception:  # not up yet
            return False

    try:
        wait_until(answers, timeout=10, interval=0.05, what=f"redis-server on port {port} to answer")
    except AssertionError:
        server.kill()
        raise
    return server


@pytest.fixture
def private_redis(tmp_path):
    port = free_port()
    servers = [start_redis(port, tmp_path)]
    yield f"redis://127.0.0.1:{port}/0", port, tmp_path, servers
    for server in servers:
        server.kill()
        server.wait()


def test_a_consumer_cleaned_up_while_the_broker_is_down_keeps_its_message_for_redelivery(private_redis):
    url, port, data_dir, servers = private_redis
    name = f"fgpu-test-broker-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    options = {"visibility_timeout": 0}  # stale at once: restore_visible may take it back
    with Connection(url, transport_options=options) as producer:
        producer.SimpleQueue(queue).put({"n": 1})
    consumer = Connection(url, transport_options=options)
    channel = consumer.default_channel
    channel.client.connection_pool.connection_kwargs["socket_timeout"] = 1
    assert channel.basic_get(name, no_ack=False) is not None and channel.qos._delivered

    servers[0].kill()  # the broker goes away (SIGKILL; its append-only file keeps the data)
    servers[0].wait()
    consumer.collect(socket_timeout=1)  # the restore fails (connection refused), the transport is detached
    ignore_errors(consumer, consumer.close)  # AttributeError ('NoneType' … 'hostname') without the repair
    servers.append(start_redis(port, data_dir))  # the broker restarts

    with Connection(url, transport_options=options) as again:
        channel = again.default_channel
        assert channel.client.hlen(channel.unacked_key) == 1  # still held as unacknowledged
        channel.qos.restore_visible(start=0, num=100)
        back = again.SimpleQueue(queue).get(timeout=5)
        assert back.payload == {"n": 1}
        back.ack()



def test_a_late_ack_on_the_channel_of_a_lost_connection_leaves_the_message_for_redelivery(private_redis):
    """A task that ends after the broker went away (acks_late) acknowledges its message on the
    old channel: that must neither raise (the worker would exit: "'NoneType' object has no
    attribute 'client'") nor lose the message, which the task runs again after the visibility
    timeout (every manager and agent task is idempotent)."""
    url, port, data_dir, servers = private_redis
    name = f"fgpu-test-broker-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), routing_key=name)
    options = {"visibility_timeout": 0}
    with Connection(url, transport_options=options) as producer:
        producer.SimpleQueue(queue).put({"n": 2})
    consumer = Connection(url, transport_options=options)
    channel = consumer.default_channel
    channel.client.connection_pool.connection_kwargs["socket_timeout"] = 1
    message = channel.basic_get(name, no_ack=False)
    assert message is not None

    servers[0].kill()
    servers[0].wait()
    consumer.collect(socket_timeout=1)  # the transport is detached from the channel's connection
    servers.append(start_redis(port, data_dir))
    message.ack()  # AttributeError without the repair
    message.channel.qos.reject(message.delivery_tag, requeue=True)  # nor does a reject raise

    with Connection(url, transport_options=options) as again:
        channel = again.default_channel
        assert channel.client.hlen(channel.unacked_key) == 1
        channel.qos.restore_visible(start=0, num=100)
        back = again.SimpleQueue(queue).get(timeout=5)
        assert back.payload == {"n": 2}
        back.ack()
